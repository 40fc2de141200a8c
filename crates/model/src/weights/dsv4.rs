//! DeepSeek V4's tensors: the stream mixes, the compressors, the lightning indexer, the
//! attention block, and the hash-routing table.

use gguf::GgmlType;

use super::{Binder, Matrix};
use crate::error::{Result, bad_tensor};
use crate::hparams::Hparams;
use crate::names::TensorName;

/// DeepSeek V4's mix of `hc` residual streams around a block: `fn` (`(2 + hc)·hc` rows of
/// `hc·n_embd`, or `hc` rows for the head's collapse), `base` and the per-output `scale`.
#[derive(Clone, Debug)]
pub struct HyperMix {
    pub fn_: Matrix,
    pub base: Vec<f32>,
    pub scale: Vec<f32>,
}

/// A DeepSeek V4 compressor: every `ratio` positions pool into one row of `width` by a
/// softmax over the window of `gate + ape[pos % ratio]`, then RMSNorm and RoPE at the window's
/// first position. `overlap` (ratio 4): `kv`/`gate` give two rows per position, the first
/// half pooled into the next window's row, the second into its own.
#[derive(Clone, Debug)]
pub struct Compressor {
    pub ratio: usize,
    pub width: usize,
    pub overlap: bool,
    pub kv: Matrix,
    pub gate: Matrix,
    /// `ratio` rows of `kv.rows` values.
    pub ape: Vec<f32>,
    pub norm: Vec<f32>,
}

/// The lightning indexer of a ratio-4 layer: scores each compressed row for a query as
/// `Σ_h w_h · relu(q_h · k)` and keeps the best `index_topk`.
#[derive(Clone, Debug)]
pub struct Indexer {
    /// `q_lora_rank` → `index_n_head × index_head_dim`.
    pub q_b: Matrix,
    /// `n_embd` → `index_n_head` head weights.
    pub proj: Matrix,
    pub compressor: Compressor,
}

/// DeepSeek V4 attention: low-rank query with a weightless per-head RMSNorm, one shared
/// key/value head, sinks, the compressor (and indexer) of compressed layers, the grouped
/// output projection, and the layer's two stream mixes.
#[derive(Clone, Debug)]
pub struct Dsv4Attention {
    pub norm: Vec<f32>,
    pub q_a: Matrix,
    pub q_a_norm: Vec<f32>,
    pub q_b: Matrix,
    pub kv: Matrix,
    pub kv_norm: Vec<f32>,
    /// `o_groups · o_lora_rank` rows of `n_head · head_dim / o_groups`: group `g` is rows
    /// `g·o_lora_rank..`.
    pub o_a: Matrix,
    pub o_b: Matrix,
    pub sinks: Vec<f32>,
    pub compressor: Option<Compressor>,
    pub indexer: Option<Indexer>,
    pub hc_attn: HyperMix,
    pub hc_ffn: HyperMix,
}

impl<'m> Binder<'m> {
    /// A hyper-connection mix of `rows` outputs over `hc · n_embd` inputs.
    pub(super) fn hyper_mix(
        &self,
        [f, b, s]: [TensorName; 3],
        il: usize,
        hp: &Hparams,
        rows: usize,
        n_scale: usize,
    ) -> Result<HyperMix> {
        let hc = hp.dsv4.as_ref().expect("dsv4").hc;
        Ok(HyperMix {
            fn_: self.matrix(&f.weight(il), hc * hp.n_embd, rows)?,
            base: self.vector(&b.weight(il), rows)?,
            scale: self.vector(&s.weight(il), n_scale)?,
        })
    }

    /// The head's collapse of the streams (`output_hc_*`), when the file holds the head.
    pub fn hyper_head(&self, hp: &Hparams) -> Result<Option<HyperMix>> {
        use TensorName as T;
        let Some(p) = &hp.dsv4 else { return Ok(None) };
        if self.get(&T::HcHeadFn.weight(0)).is_none() {
            return Ok(None);
        }
        self.hyper_mix([T::HcHeadFn, T::HcHeadBase, T::HcHeadScale], 0, hp, p.hc, 1)
            .map(Some)
    }

    /// A compressor named `[kv, gate, ape, norm]`.
    pub(super) fn compressor(
        &self,
        [kv, gate, ape, norm]: [TensorName; 4],
        il: usize,
        hp: &Hparams,
        ratio: usize,
        width: usize,
    ) -> Result<Compressor> {
        let overlap = ratio == 4;
        let rows = if overlap { 2 * width } else { width };
        Ok(Compressor {
            ratio,
            width,
            overlap,
            kv: self.matrix(&kv.weight(il), hp.n_embd, rows)?,
            gate: self.matrix(&gate.weight(il), hp.n_embd, rows)?,
            ape: self.vector_rows(&ape.weight(il), rows, ratio)?,
            norm: self.vector(&norm.weight(il), width)?,
        })
    }

    /// DeepSeek V4 attention of layer `il`.
    pub(super) fn dsv4_attention(&self, hp: &Hparams, il: usize) -> Result<Dsv4Attention> {
        use TensorName as T;
        let p = hp.dsv4.as_ref().expect("dsv4");
        let (d, hd, nh) = (hp.n_embd, hp.head_dim_k, hp.n_head);
        let r = p.q_lora_rank;
        let mix = (2 + p.hc) * p.hc;
        let ratio = p.ratio(il);
        let compressor = (ratio > 0)
            .then(|| {
                self.compressor(
                    [
                        T::AttnCompressorKv,
                        T::AttnCompressorGate,
                        T::AttnCompressorApe,
                        T::AttnCompressorNorm,
                    ],
                    il,
                    hp,
                    ratio,
                    hd,
                )
            })
            .transpose()?;
        let indexer = (ratio == 4)
            .then(|| -> Result<Indexer> {
                Ok(Indexer {
                    q_b: self.matrix(
                        &T::IndexerAttnQB.weight(il),
                        r,
                        p.index_n_head * p.index_head_dim,
                    )?,
                    proj: self.matrix(&T::IndexerProj.weight(il), d, p.index_n_head)?,
                    compressor: self.compressor(
                        [
                            T::IndexerCompressorKv,
                            T::IndexerCompressorGate,
                            T::IndexerCompressorApe,
                            T::IndexerCompressorNorm,
                        ],
                        il,
                        hp,
                        ratio,
                        p.index_head_dim,
                    )?,
                })
            })
            .transpose()?;
        Ok(Dsv4Attention {
            norm: self.vector(&T::AttnNorm.weight(il), d)?,
            q_a: self.matrix(&T::AttnQA.weight(il), d, r)?,
            q_a_norm: self.vector(&T::AttnQANorm.weight(il), r)?,
            q_b: self.matrix(&T::AttnQB.weight(il), r, nh * hd)?,
            kv: self.matrix(&T::AttnKv.weight(il), d, hd)?,
            kv_norm: self.vector(&T::AttnKvANorm.weight(il), hd)?,
            o_a: self.matrix(
                &T::AttnOutA.weight(il),
                nh * hd / p.o_groups,
                p.o_groups * p.o_lora_rank,
            )?,
            o_b: self.matrix(&T::AttnOutB.weight(il), p.o_groups * p.o_lora_rank, d)?,
            sinks: self.vector(&T::AttnSinks.weight(il), nh)?,
            compressor,
            indexer,
            hc_attn: self.hyper_mix(
                [T::HcAttnFn, T::HcAttnBase, T::HcAttnScale],
                il,
                hp,
                mix,
                3,
            )?,
            hc_ffn: self.hyper_mix([T::HcFfnFn, T::HcFfnBase, T::HcFfnScale], il, hp, mix, 3)?,
        })
    }

    /// The `n_vocab × k` expert ids of a hash-routed layer (I32 in the file).
    pub(super) fn hash_routes(
        &self,
        il: usize,
        hp: &Hparams,
        k: usize,
        n_expert: usize,
    ) -> Result<Option<Vec<u32>>> {
        let name = TensorName::FfnGateTid2Eid.weight(il);
        let Some(t) = self.get(&name) else {
            return Ok(None);
        };
        let dims = t.info.shape.dims();
        if t.info.dtype != GgmlType::I32 || dims.len() != 2 || dims[0] as usize != k {
            return Err(bad_tensor(
                &name,
                format!(
                    "type {} shape {dims:?}, expected I32 [{k}, n_vocab]",
                    t.info.dtype
                ),
            ));
        }
        let ids: Vec<u32> = t
            .data()
            .chunks_exact(4)
            .map(|b| i32::from_le_bytes([b[0], b[1], b[2], b[3]]))
            .map(|v| u32::try_from(v).ok().filter(|&e| (e as usize) < n_expert))
            .collect::<Option<Vec<u32>>>()
            .ok_or_else(|| bad_tensor(&name, format!("an expert id outside 0..{n_expert}")))?;
        let _ = hp;
        Ok(Some(ids))
    }
}
