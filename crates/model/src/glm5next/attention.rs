//! GLM-5.3 Flash's latent attention: DeepSeek's MLA without rope (`q = q_b·RMSNorm(q_a·x)`,
//! the cached latent `RMSNorm(kv_a·x)`, per head keys `k_b·latent` and values `v_b·latent`),
//! computed in the absorbed form (`crate::blocks::mla`), where each query attends only to the
//! positions selected for it: by this layer's k-pool indexer, or on a shared layer by the last
//! layer that ran one.

use kernels::attn::{self, KvElem, Rows};
use kernels::{Input, Isa};

use super::Selection;
use crate::Model;
use crate::blocks::Compute;
use crate::blocks::attention::head_groups;
use crate::blocks::mla::{heads_to_tokens, project_heads};
use crate::blocks::norm::rms_norm_rows_inplace;
use crate::error::{ModelError, Result};
use crate::hparams::Glm5LayerKind;
use crate::kv::KvType;
use crate::pass::{Hooks, SeqInput};
use crate::profile::{Phase, span, timed};
use crate::weights::{KpoolIndexer, MlaAttention};

/// Gathered latent rows of `r` values in the cache's type (the keys, and the values: nope-only
/// attention); the kernels widen f16 as they load, as from the cache itself.
fn latent_rows(gathered: &[u8], r: usize, kt: KvType) -> Rows<'_> {
    Rows {
        data: gathered,
        stride: r * kt.bytes(),
        n: gathered.len() / (r * kt.bytes()).max(1),
        d: r,
        elem: match kt {
            KvType::F32 => KvElem::F32,
            KvType::F16 => KvElem::F16,
        },
    }
}

/// The softmax attention of consecutive heads' queries `q` (`r` each) over `keys` (also their
/// values) into `out` (`r` per head): each head's bits its own (`attn::attend_heads`).
fn attend(isa: Isa, q: &[f32], keys: Rows, scale: f32, scratch: &mut Vec<f32>, out: &mut [f32]) {
    let (r, heads) = (keys.d, out.len() / keys.d.max(1));
    attn::attend_heads(isa, q, r, heads, keys, keys, scale, None, scratch, out, r);
}

/// Copies cached row `pos` (`out.len()` bytes) into `out`.
fn cached_row(bytes: &[u8], pos: usize, out: &mut [u8]) {
    out.copy_from_slice(&bytes[pos * out.len()..(pos + 1) * out.len()]);
}

impl Model {
    /// Latent attention of layer `il` for the normed block input `h`: the block output (`n × d`,
    /// f64; a partial sum over this rank's heads when split). A layer with an indexer replaces
    /// `selection`; one without reads it.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn indexed_mla(
        &self,
        cx: &Compute,
        il: usize,
        w: &MlaAttention,
        indexer: Option<&KpoolIndexer>,
        h: &[f32],
        seqs: &mut [SeqInput],
        pos0: &[usize],
        selection: &mut Option<Selection>,
        hooks: &mut dyn Hooks,
    ) -> Result<Vec<f64>> {
        let hp = &self.hp;
        let m = hp.mla.as_ref().expect("glm5-next has latent attention");
        let files = self.files();
        let (d, r, nope, dv) = (hp.n_embd, m.kv_lora_rank, m.qk_nope, m.v_head_dim);
        let n = h.len() / d;
        let heads = self.shard.heads.clone();
        let nh = heads.len();
        let Some((q_a, q_a_norm)) = &w.q_a else {
            return Err(ModelError::Input(format!(
                "layer {il}: GLM-5.3 Flash's latent attention needs attn_q_a"
            )));
        };
        let hin = Input::new(h, n, d)?;
        let project_span = span(Phase::AttnProject);
        let mut both = cx.project(&hin, &[q_a.weights(files), w.kv_a.weights(files)])?;
        let mut latent = both.pop().expect("kv_a");
        let mut qr = both.pop().expect("q_a");
        rms_norm_rows_inplace(&mut qr, q_a_norm, hp.rms_eps);
        rms_norm_rows_inplace(&mut latent, &w.kv_a_norm, hp.rms_eps);
        let qin = Input::new(&qr, n, q_a.rows)?;
        let q = cx
            .project(
                &qin,
                &[w.q
                    .weights(files)
                    .rows_slice(heads.start * nope..heads.end * nope)],
            )?
            .pop()
            .expect("q_b");
        drop(project_span);
        hooks.observe(Some(il), "kv_cmpr", &latent);
        let mut t = 0;
        for (s, &p0) in seqs.iter_mut().zip(pos0) {
            for i in 0..s.n_tokens {
                s.kv.store(il, p0 + i, &latent[t * r..(t + 1) * r], &[])?;
                t += 1;
            }
        }
        if let Some(ix) = indexer {
            *selection = Some(self.kpool_select(cx, il, ix, h, &qr, seqs, pos0, hooks)?);
        }
        let picked = selection.as_ref().ok_or_else(|| {
            let p = self.glm5_params();
            let from = (0..il)
                .rev()
                .find(|&j| p.kind(j) == Glm5LayerKind::Mla { indexer: true })
                .map_or("(none)".to_string(), |j| j.to_string());
            ModelError::Input(format!(
                "layer {il} reuses the indexer selection of layer {from}, which did not run in \
                 this pass, and the stage before handed none on (carried with the hidden state)"
            ))
        })?;
        // Each head's query taken into latent space: W_kb[h] is kv_lora_rank × qk_nope.
        // Every head's query into the latent space, all heads in one dispatch.
        let k_b: Vec<_> = heads
            .clone()
            .map(|hh| w.k_b.expert(hh).weights(files))
            .collect();
        let q_lat = heads_to_tokens(cx, &project_heads(cx, &q, n, &k_b)?, n, nh, r);
        let attention = span(Phase::Attention);
        let scale = hp.attn_scale();
        let isa = cx.kernels.isa;
        let mut lat_out = vec![0f32; n * nh * r];
        let mut row0 = 0;
        for s in seqs.iter() {
            let bytes = s.kv.keys(il)?;
            let kt = s.kv.layout().kv_type;
            let rows = row0..row0 + s.n_tokens;
            let q_lat = &q_lat;
            let parts = head_groups(nh, cx.n_threads(), s.n_tokens);
            if parts > 1 {
                // Fewer queries than threads (decode): each query's selected rows are gathered
                // once, then its heads are split into groups across the pool. Every head runs
                // the same kernels on the same rows as below, so the bits do not change.
                let per_part = nh / parts;
                for br in rows.clone() {
                    let sel = &picked[br];
                    let row = r * kt.bytes();
                    let mut gathered = vec![0u8; sel.len() * row];
                    for (g, &pos) in gathered.chunks_exact_mut(row).zip(sel) {
                        cached_row(bytes, pos as usize, g);
                    }
                    let keys = latent_rows(&gathered, r, kt);
                    let out = &mut lat_out[br * nh * r..(br + 1) * nh * r];
                    cx.par_rows(out, per_part * r, |first, out_parts| {
                        let mut scratch = Vec::new();
                        for (j, part_out) in out_parts.chunks_exact_mut(per_part * r).enumerate() {
                            let hh = (first + j) * per_part;
                            let q = &q_lat[(br * nh + hh) * r..(br * nh + hh + per_part) * r];
                            attend(isa, q, keys, scale, &mut scratch, part_out);
                        }
                    });
                }
                row0 += s.n_tokens;
                continue;
            }
            cx.par_rows(
                &mut lat_out[rows.start * nh * r..rows.end * nh * r],
                nh * r,
                |first, out_rows| {
                    let mut gathered: Vec<u8> = Vec::new();
                    let mut scratch: Vec<f32> = Vec::new();
                    for (i, out) in out_rows.chunks_exact_mut(nh * r).enumerate() {
                        let br = rows.start + first + i;
                        let sel = &picked[br];
                        let row = r * kt.bytes();
                        gathered.resize(sel.len() * row, 0);
                        for (g, &pos) in gathered.chunks_exact_mut(row).zip(sel) {
                            cached_row(bytes, pos as usize, g);
                        }
                        let keys = latent_rows(&gathered, r, kt);
                        let q = &q_lat[br * nh * r..(br + 1) * nh * r];
                        attend(isa, q, keys, scale, &mut scratch, out);
                    }
                },
            );
            row0 += s.n_tokens;
        }
        drop(attention);
        // Each head's latent output up to its value space: W_vb[h] is v_head_dim × kv_lora_rank.
        let v_b: Vec<_> = heads
            .clone()
            .map(|hh| w.v_b.expert(hh).weights(files))
            .collect();
        let att = heads_to_tokens(cx, &project_heads(cx, &lat_out, n, &v_b)?, n, nh, dv);
        hooks.observe(Some(il), "kqv_out", &att);
        let ain = Input::new(&att, n, nh * dv)?;
        let o_w = w.o.weights(files);
        let o_w = if self.shard.attention_split {
            o_w.cols_slice(heads.start * dv..heads.end * dv)
                .expect("a head split is block-aligned (checked by Shard::new)")
        } else {
            o_w
        };
        let chunk = crate::shard::o_chunk(self.o_dtype, dv, 1);
        let mut out = vec![0f64; n * d];
        timed(Phase::AttnOutput, || {
            cx.matmul_chunked(&o_w, &ain, chunk, &mut out)
        })?;
        Ok(out)
    }
}
