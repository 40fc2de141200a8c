//! `moeshard synth`: random-weight GGUF files with real model shapes and a llama.cpp
//! Q4_K_M-like quant mix, for benchmarks at sizes no fixture could have. Fast: a pool of random
//! rows is quantized once per (type, row length) and tiled; the file is streamed to disk.
//! llama.cpp can load the result too (it carries a byte-level BPE vocabulary).

use std::path::PathBuf;

use anyhow::{Context, bail};
use gguf::{GgmlType, GgufWriter, Value};

mod dsa;
mod dsv4;
mod glm5next;
mod gpt_oss;
mod presets;

use dsa::{dsa_metadata, push_indexer};
use dsv4::{dsv4_metadata, plan_dsv4};
use glm5next::{glm5next_metadata, plan_glm5next};
use gpt_oss::plan_gpt_oss;
use presets::DSV4_FLASH_LAYERS;
pub use presets::{MlaShape, PRESETS, Preset};

#[derive(clap::Args)]
pub struct SynthArgs {
    /// qwen3-30b-a3b, olmoe-7b-a1b, small-2b, deepseek-v2-lite, deepseek-v3-4l,
    /// glm-5.2-4l, glm-5.3-flash-4l, glm-4.5-air-8l, gpt-oss-20b or deepseek-v4-flash.
    #[arg(long)]
    pub preset: String,
    /// Fewer layers than the preset has (same shapes otherwise): a smaller file to try.
    #[arg(long)]
    pub layers: Option<usize>,
    /// Output GGUF.
    pub output: PathBuf,
    /// Seed of the random rows.
    #[arg(long, default_value_t = 1)]
    pub seed: u64,
    /// Formats of the routed experts (not gpt-oss, whose experts are MXFP4).
    #[arg(long, value_enum, default_value_t = ExpertMix::Q4KM)]
    pub experts: ExpertMix,
}

/// The formats of the routed experts' gate/up and down projections.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum ExpertMix {
    /// Q4_K gate/up, Q6_K down (llama.cpp's Q4_K_M).
    #[value(name = "q4_k_m")]
    Q4KM,
    /// IQ2_XXS gate/up, IQ3_XXS down: the bulk of DeepSeek-class "dynamic" low-bit files.
    #[value(name = "iq2_xxs")]
    Iq2Xxs,
    /// IQ2_XXS gate/up, Q2_K down: the other low-bit expert mix of DeepSeek-class files (the
    /// down projections in a K-quant, which llama-quantize needs no importance matrix for).
    #[value(name = "iq2_xxs-q2_k")]
    Iq2XxsQ2K,
}

impl ExpertMix {
    fn gate_up_down(self) -> (GgmlType, GgmlType) {
        match self {
            ExpertMix::Q4KM => (GgmlType::Q4K, GgmlType::Q6K),
            ExpertMix::Iq2Xxs => (GgmlType::Iq2Xxs, GgmlType::Iq3Xxs),
            ExpertMix::Iq2XxsQ2K => (GgmlType::Iq2Xxs, GgmlType::Q2K),
        }
    }
}

/// SplitMix64.
struct Rng(u64);
impl Rng {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }
    fn normal(&mut self) -> f32 {
        // Box–Muller.
        let u1 = ((self.next() >> 11) as f64 + 1.0) / (1u64 << 53) as f64;
        let u2 = (self.next() >> 11) as f64 / (1u64 << 53) as f64;
        ((-2.0 * u1.ln()).sqrt() * (std::f64::consts::TAU * u2).cos()) as f32
    }
}

/// Random rows of `dtype` for a format without a quantizer (the IQ formats): random bytes, which
/// are valid blocks, with every block's f16 scale set so that the values' RMS is about `std`
/// (measured on the row dequantized with scales of 1).
fn random_rows(
    rng: &mut Rng,
    dtype: GgmlType,
    row_len: usize,
    rb: usize,
    std: f32,
) -> anyhow::Result<Vec<Vec<u8>>> {
    let fields = kernels::blocks::f16_scale_fields(dtype);
    if fields.is_empty() {
        bail!("no quantizer for {dtype}, and no f16 scale to set in random blocks");
    }
    let set_scales = |row: &mut [u8], d: f32| {
        for block in row.chunks_exact_mut(dtype.type_size()) {
            for &o in fields {
                block[o..o + 2].copy_from_slice(&kernels::blocks::f16_to_bytes(d));
            }
        }
    };
    let mut values = vec![0f32; row_len];
    (0..POOL_ROWS)
        .map(|_| {
            let mut row: Vec<u8> = (0..rb).map(|_| rng.next() as u8).collect();
            set_scales(&mut row, 1.0);
            kernels::formats::dequantize_row(dtype, &row, &mut values)
                .with_context(|| format!("cannot dequantize {dtype}"))?;
            let rms = (values.iter().map(|v| v * v).sum::<f32>() / row_len as f32).sqrt();
            set_scales(&mut row, std / rms.max(f32::MIN_POSITIVE));
            Ok(row)
        })
        .collect()
}

/// Quantized random rows, tiled into tensors.
struct RowPool {
    rows: Vec<Vec<u8>>,
}

const POOL_ROWS: usize = 64;

impl RowPool {
    fn new(rng: &mut Rng, dtype: GgmlType, row_len: usize, std: f32) -> anyhow::Result<RowPool> {
        let rb = dtype
            .row_bytes(row_len as u64)
            .with_context(|| format!("{row_len} is not whole {dtype} blocks"))?
            as usize;
        let Some(quantize) = kernels::format(dtype).and_then(|f| f.quantize) else {
            return Ok(RowPool {
                rows: random_rows(rng, dtype, row_len, rb, std)?,
            });
        };
        let rows = (0..POOL_ROWS)
            .map(|_| {
                let v: Vec<f32> = (0..row_len).map(|_| rng.normal() * std).collect();
                let mut q = vec![0u8; rb];
                quantize(&v, &mut q);
                q
            })
            .collect();
        Ok(RowPool { rows })
    }
}

struct TensorPlan {
    name: String,
    dtype: GgmlType,
    shape: Vec<u64>,
    fill: Fill,
}

/// What a tensor holds.
#[derive(Clone, Copy, Debug, PartialEq)]
enum Fill {
    /// Random values of this standard deviation, rows tiled from a pool.
    Random(f32),
    /// Every value this one (F32): norms of 1, hyper-connection bases of 0.
    Const(f32),
    /// Per row (token), `shape[0]` distinct expert ids below this count (I32): hash routing.
    ExpertIds(u32),
}

impl TensorPlan {
    /// Random values of `std`, or norms of one where `std` is 0.
    /// Random rows of `std` (a type without whole blocks of the row falls back to Q8_0).
    pub(super) fn random(name: String, dtype: GgmlType, shape: Vec<u64>, std: f32) -> TensorPlan {
        TensorPlan {
            dtype: whole_blocks_or_q8_0(dtype, shape[0]),
            name,
            shape,
            fill: Fill::Random(std),
        }
    }

    /// F32 values all `value`.
    pub(super) fn constant(name: String, shape: Vec<u64>, value: f32) -> TensorPlan {
        TensorPlan {
            name,
            dtype: GgmlType::F32,
            shape,
            fill: Fill::Const(value),
        }
    }

    fn of_std(name: String, dtype: GgmlType, shape: Vec<u64>, std: f32) -> TensorPlan {
        let fill = if std == 0.0 {
            Fill::Const(1.0)
        } else {
            Fill::Random(std)
        };
        TensorPlan {
            name,
            dtype,
            shape,
            fill,
        }
    }
}

/// Rows that are not whole 256-value super-blocks fall back to Q8_0, as llama-quantize does
/// (e.g. 1408-wide expert down projections).
pub(super) fn whole_blocks_or_q8_0(dtype: GgmlType, row_len: u64) -> GgmlType {
    if dtype.block_size() == 256 && !row_len.is_multiple_of(256) {
        GgmlType::Q8_0
    } else {
        dtype
    }
}

fn plan(p: &Preset, experts: ExpertMix) -> Vec<TensorPlan> {
    if p.arch == "gpt-oss" {
        return plan_gpt_oss(p);
    }
    if let Some(v4) = &p.dsv4 {
        return plan_dsv4(p, v4, experts);
    }
    if let Some(g) = &p.glm5next {
        return plan_glm5next(p, g, experts);
    }
    use GgmlType::{F32, Q4K, Q6K, Q8_0};
    let (exp_gate_up, exp_down) = experts.gate_up_down();
    let (d, hd) = (p.n_embd as u64, p.head_dim as u64);
    let (q, kv) = (p.n_head as u64 * hd, p.n_head_kv as u64 * hd);
    let (e, ff) = (p.n_expert as u64, p.n_ff_exp as u64);
    let t = |name: String, dtype: GgmlType, shape: Vec<u64>, std| {
        TensorPlan::of_std(name, whole_blocks_or_q8_0(dtype, shape[0]), shape, std)
    };
    let mut v = vec![t(
        "token_embd.weight".into(),
        Q4K,
        vec![d, p.n_vocab as u64],
        1.0,
    )];
    for i in 0..p.n_layer {
        let b = |s: &str| format!("blk.{i}.{s}.weight");
        v.push(t(b("attn_norm"), F32, vec![d], 0.0));
        let o_cols = match &p.mla {
            Some(m) => {
                let r = m.kv_lora_rank as u64;
                let q_rows = p.n_head as u64 * hd;
                if m.q_lora_rank > 0 {
                    let ql = m.q_lora_rank as u64;
                    v.push(t(b("attn_q_a"), Q4K, vec![d, ql], 0.02));
                    v.push(t(b("attn_q_a_norm"), F32, vec![ql], 0.0));
                    v.push(t(b("attn_q_b"), Q4K, vec![ql, q_rows], 0.02));
                } else {
                    v.push(t(b("attn_q"), Q4K, vec![d, q_rows], 0.02));
                }
                v.push(t(
                    b("attn_kv_a_mqa"),
                    Q4K,
                    vec![d, r + p.n_rot as u64],
                    0.02,
                ));
                v.push(t(b("attn_kv_a_norm"), F32, vec![r], 0.0));
                // llama.cpp keeps these two in Q8_0 (their rows are head-sized).
                v.push(t(
                    b("attn_k_b"),
                    Q8_0,
                    vec![m.qk_nope as u64, r, p.n_head as u64],
                    0.02,
                ));
                v.push(t(
                    b("attn_v_b"),
                    Q8_0,
                    vec![r, m.v_head_dim as u64, p.n_head as u64],
                    0.02,
                ));
                if let Some(dsa) = &p.dsa {
                    push_indexer(&mut v, p, m, dsa, i);
                }
                p.n_head as u64 * m.v_head_dim as u64
            }
            None => {
                v.push(t(b("attn_q"), Q4K, vec![d, q], 0.02));
                v.push(t(b("attn_k"), Q4K, vec![d, kv], 0.02));
                v.push(t(b("attn_v"), Q6K, vec![d, kv], 0.02));
                if p.qkv_bias {
                    let bias = |s: &str| format!("blk.{i}.{s}.bias");
                    v.push(t(bias("attn_q"), F32, vec![q], 0.02));
                    v.push(t(bias("attn_k"), F32, vec![kv], 0.02));
                    v.push(t(bias("attn_v"), F32, vec![kv], 0.02));
                }
                if p.qk_norm {
                    let n = if p.arch == "olmoe" { (q, kv) } else { (hd, hd) };
                    v.push(t(b("attn_q_norm"), F32, vec![n.0], 0.0));
                    v.push(t(b("attn_k_norm"), F32, vec![n.1], 0.0));
                }
                q
            }
        };
        v.push(t(b("attn_output"), Q4K, vec![o_cols, d], 0.02));
        // GLM's converter names the pre-FFN norm after HF's post_attention_layernorm.
        let ffn_norm = if p.arch == "glm4moe" {
            "post_attention_norm"
        } else {
            "ffn_norm"
        };
        v.push(t(b(ffn_norm), F32, vec![d], 0.0));
        if i < p.n_dense_lead {
            let fd = p.n_ff_dense as u64;
            v.push(t(b("ffn_gate"), Q4K, vec![d, fd], 0.02));
            v.push(t(b("ffn_up"), Q4K, vec![d, fd], 0.02));
            v.push(t(b("ffn_down"), Q6K, vec![fd, d], 0.02));
            continue;
        }
        v.push(t(b("ffn_gate_inp"), F32, vec![d, e], 0.1));
        if p.sigmoid_gating {
            v.push(t(format!("blk.{i}.exp_probs_b.bias"), F32, vec![e], 0.01));
        }
        v.push(t(b("ffn_gate_exps"), exp_gate_up, vec![d, ff, e], 0.02));
        v.push(t(b("ffn_up_exps"), exp_gate_up, vec![d, ff, e], 0.02));
        v.push(t(b("ffn_down_exps"), exp_down, vec![ff, d, e], 0.02));
        if p.n_shared_exp > 0 {
            let fs = (p.n_ff_exp * p.n_shared_exp) as u64;
            v.push(t(b("ffn_gate_shexp"), Q4K, vec![d, fs], 0.02));
            v.push(t(b("ffn_up_shexp"), Q4K, vec![d, fs], 0.02));
            v.push(t(b("ffn_down_shexp"), Q6K, vec![fs, d], 0.02));
        }
    }
    v.push(t("output_norm.weight".into(), F32, vec![d], 0.0));
    v.push(t(
        "output.weight".into(),
        Q6K,
        vec![d, p.n_vocab as u64],
        0.02,
    ));
    v
}

/// A byte-level BPE vocabulary: the 256 byte symbols, placeholders, and an end-of-text token.
fn vocabulary(n_vocab: usize) -> (Vec<String>, Vec<i32>) {
    let mut byte_chars = Vec::with_capacity(256);
    let mut extra = 0u32;
    for b in 0u32..256 {
        let printable =
            (33..=126).contains(&b) || (161..=172).contains(&b) || (174..=255).contains(&b);
        byte_chars.push(if printable {
            char::from_u32(b).expect("valid")
        } else {
            extra += 1;
            char::from_u32(255 + extra).expect("valid")
        });
    }
    let mut tokens: Vec<String> = byte_chars.iter().map(|c| c.to_string()).collect();
    let mut types = vec![1i32; 256];
    while tokens.len() < n_vocab - 1 {
        tokens.push(format!("<synth_{}>", tokens.len()));
        types.push(1);
    }
    tokens.push("<|endoftext|>".into());
    types.push(3);
    (tokens, types)
}

pub fn run(args: &SynthArgs) -> anyhow::Result<()> {
    let Some(p) = PRESETS.iter().find(|p| p.name == args.preset) else {
        bail!(
            "unknown preset {:?}; presets: {}",
            args.preset,
            PRESETS
                .iter()
                .map(|p| p.name)
                .collect::<Vec<_>>()
                .join(", ")
        );
    };
    let mut p = p.clone();
    if let Some(n) = args.layers {
        if n == 0 || n > p.n_layer {
            bail!("--layers {n}: the preset has 1..={} layers", p.n_layer);
        }
        p.n_layer = n;
    }
    write(&p, args.experts, args.seed, &args.output)
}

/// Writes preset `p` (its layer count as given) to `output`.
fn write(
    p: &Preset,
    expert_mix: ExpertMix,
    seed: u64,
    output: &std::path::Path,
) -> anyhow::Result<()> {
    let t0 = std::time::Instant::now();
    let mut w = GgufWriter::new();
    let a = p.arch;
    let u = |v: usize| Value::U32(v as u32);
    w.add_metadata("general.architecture", a)?;
    w.add_metadata("general.name", format!("moeshard synth {}", p.name))?;
    // MOSTLY_MXFP4_MOE (gpt-oss), MOSTLY_IQ2_XXS or MOSTLY_Q4_K_M.
    let file_type = match (a, expert_mix) {
        ("gpt-oss", _) => 38,
        (_, ExpertMix::Iq2Xxs | ExpertMix::Iq2XxsQ2K) => 19,
        (_, ExpertMix::Q4KM) => 15,
    };
    w.add_metadata("general.file_type", Value::U32(file_type))?;
    w.add_metadata("general.quantization_version", Value::U32(2))?;
    if let Some(v4) = &p.dsv4 {
        dsv4_metadata(&mut w, p, v4)?;
    } else if let Some(g) = &p.glm5next {
        glm5next_metadata(&mut w, p, g)?;
    } else {
        generic_metadata(&mut w, p)?;
    }
    if let Some(dsa) = &p.dsa {
        dsa_metadata(&mut w, p, dsa)?;
    }
    let (tokens, types) = vocabulary(p.n_vocab);
    w.add_metadata("tokenizer.ggml.model", "gpt2")?;
    w.add_metadata(
        "tokenizer.ggml.pre",
        if a == "gpt-oss" { "gpt-4o" } else { "qwen2" },
    )?;
    w.add_metadata("tokenizer.ggml.tokens", tokens)?;
    w.add_metadata("tokenizer.ggml.token_type", types)?;
    w.add_metadata("tokenizer.ggml.merges", Vec::<String>::new())?;
    w.add_metadata("tokenizer.ggml.eos_token_id", u(p.n_vocab - 1))?;
    w.add_metadata("tokenizer.ggml.bos_token_id", u(p.n_vocab - 1))?;
    w.add_metadata("tokenizer.ggml.add_bos_token", Value::Bool(false))?;
    let plans = plan(p, expert_mix);
    for t in &plans {
        w.declare_tensor(t.name.clone(), t.dtype, &t.shape)?;
    }
    let mut rng = Rng(seed);
    let mut pools: std::collections::HashMap<(GgmlType, u64, u32), RowPool> =
        std::collections::HashMap::new();
    for t in &plans {
        let want = match t.fill {
            Fill::Random(_) => None,
            Fill::Const(_) => Some(GgmlType::F32),
            Fill::ExpertIds(_) => Some(GgmlType::I32),
        };
        if want.is_some_and(|d| d != t.dtype) {
            bail!("{}: {:?} cannot be written as {}", t.name, t.fill, t.dtype);
        }
        // Distinct ids per row: no more of them than there are experts.
        if let Fill::ExpertIds(n_expert) = t.fill
            && t.shape[0] > u64::from(n_expert)
        {
            bail!(
                "{}: {} distinct ids of {n_expert} experts",
                t.name,
                t.shape[0]
            );
        }
        // Constants draw a pool too (of zeros, unused): the random stream, and so every file of
        // the presets from before constants had their own fill, stays as it was.
        let std = match t.fill {
            Fill::Random(std) => std,
            Fill::Const(_) => 0.0,
            Fill::ExpertIds(_) => continue,
        };
        let key = (t.dtype, t.shape[0], std.to_bits());
        if let std::collections::hash_map::Entry::Vacant(e) = pools.entry(key) {
            e.insert(RowPool::new(&mut rng, t.dtype, t.shape[0] as usize, std)?);
        }
    }
    let by_name: std::collections::HashMap<&str, &TensorPlan> =
        plans.iter().map(|t| (t.name.as_str(), t)).collect();
    let mut mixer = Rng(seed ^ 0x5eed);
    let bytes = w.write_streaming(output, |name, dtype, shape, out| {
        let t = by_name[name];
        let rows: u64 = shape[1..].iter().product();
        let std = match t.fill {
            Fill::Random(std) => std,
            Fill::Const(value) => {
                for _ in 0..rows * shape[0] {
                    out.extend_from_slice(&value.to_le_bytes());
                }
                return;
            }
            Fill::ExpertIds(n_expert) => {
                for _ in 0..rows {
                    write_distinct_ids(&mut mixer, shape[0] as usize, n_expert, out);
                }
                return;
            }
        };
        let pool = &pools[&(dtype, shape[0], std.to_bits())];
        out.reserve((rows as usize) * pool.rows[0].len());
        for _ in 0..rows {
            out.extend_from_slice(&pool.rows[(mixer.next() % POOL_ROWS as u64) as usize]);
        }
    })?;
    eprintln!(
        "wrote {} ({}: {:.2} GiB) in {:.1} s",
        output.display(),
        p.name,
        bytes as f64 / (1u64 << 30) as f64,
        t0.elapsed().as_secs_f64()
    );
    Ok(())
}

/// The keys of the GQA / MLA presets (llama.cpp's qwen3moe, olmoe, deepseek2, glm4moe, gpt-oss).
fn generic_metadata(w: &mut GgufWriter, p: &Preset) -> anyhow::Result<()> {
    let a = p.arch;
    let u = |v: usize| Value::U32(v as u32);
    w.add_metadata(format!("{a}.block_count"), u(p.n_layer))?;
    w.add_metadata(format!("{a}.context_length"), u(p.n_ctx))?;
    w.add_metadata(format!("{a}.embedding_length"), u(p.n_embd))?;
    // OLMoE's and gpt-oss' experts are `feed_forward_length` wide in llama.cpp; Qwen3-MoE has a
    // separate expert width and a (here unused) dense one.
    let ff = if a == "olmoe" || a == "gpt-oss" {
        p.n_ff_exp
    } else if p.n_dense_lead > 0 {
        p.n_ff_dense
    } else {
        p.n_ff_exp * p.n_expert_used
    };
    w.add_metadata(format!("{a}.feed_forward_length"), u(ff))?;
    w.add_metadata(format!("{a}.expert_feed_forward_length"), u(p.n_ff_exp))?;
    w.add_metadata(format!("{a}.attention.head_count"), u(p.n_head))?;
    w.add_metadata(format!("{a}.attention.head_count_kv"), u(p.n_head_kv))?;
    match &p.mla {
        // As the converter writes latent attention: the cache view as key/value lengths,
        // the decompressed heads as the _mla lengths.
        Some(m) => {
            w.add_metadata(
                format!("{a}.attention.key_length"),
                u(m.kv_lora_rank + p.n_rot),
            )?;
            w.add_metadata(format!("{a}.attention.value_length"), u(m.kv_lora_rank))?;
            w.add_metadata(format!("{a}.attention.key_length_mla"), u(p.head_dim))?;
            w.add_metadata(format!("{a}.attention.value_length_mla"), u(m.v_head_dim))?;
            w.add_metadata(format!("{a}.attention.kv_lora_rank"), u(m.kv_lora_rank))?;
            if m.q_lora_rank > 0 {
                w.add_metadata(format!("{a}.attention.q_lora_rank"), u(m.q_lora_rank))?;
            }
        }
        None => {
            w.add_metadata(format!("{a}.attention.key_length"), u(p.head_dim))?;
            w.add_metadata(format!("{a}.attention.value_length"), u(p.head_dim))?;
        }
    }
    if p.n_rot > 0 {
        w.add_metadata(format!("{a}.rope.dimension_count"), u(p.n_rot))?;
    }
    if a == "gpt-oss" {
        w.add_metadata(
            format!("{a}.attention.layer_norm_rms_epsilon"),
            Value::F32(1e-5),
        )?;
        w.add_metadata(format!("{a}.rope.freq_base"), Value::F32(150_000.0))?;
        w.add_metadata(format!("{a}.attention.sliding_window"), u(128))?;
        w.add_metadata(format!("{a}.rope.scaling.type"), "yarn")?;
        w.add_metadata(format!("{a}.rope.scaling.factor"), Value::F32(32.0))?;
        w.add_metadata(format!("{a}.rope.scaling.original_context_length"), u(4096))?;
    } else {
        w.add_metadata(
            format!("{a}.attention.layer_norm_rms_epsilon"),
            Value::F32(1e-6),
        )?;
        w.add_metadata(format!("{a}.rope.freq_base"), Value::F32(1_000_000.0))?;
    }
    w.add_metadata(format!("{a}.expert_count"), u(p.n_expert))?;
    w.add_metadata(format!("{a}.expert_used_count"), u(p.n_expert_used))?;
    if p.n_shared_exp > 0 || p.n_dense_lead > 0 || p.sigmoid_gating {
        w.add_metadata(format!("{a}.expert_shared_count"), u(p.n_shared_exp))?;
        w.add_metadata(format!("{a}.leading_dense_block_count"), u(p.n_dense_lead))?;
        w.add_metadata(
            format!("{a}.expert_gating_func"),
            u(if p.sigmoid_gating { 2 } else { 1 }),
        )?;
        w.add_metadata(format!("{a}.expert_group_count"), u(p.n_group))?;
        w.add_metadata(format!("{a}.expert_group_used_count"), u(p.n_group_used))?;
        w.add_metadata(
            format!("{a}.expert_weights_scale"),
            Value::F32(p.weights_scale),
        )?;
        w.add_metadata(format!("{a}.expert_weights_norm"), Value::Bool(p.norm_topk))?;
    }
    Ok(())
}

/// `k` distinct ids below `n` as little-endian i32s (rejection sampling: `k` is a handful).
fn write_distinct_ids(rng: &mut Rng, k: usize, n: u32, out: &mut Vec<u8>) {
    let mut ids: Vec<u32> = Vec::with_capacity(k);
    while ids.len() < k {
        let id = (rng.next() % u64::from(n)) as u32;
        if !ids.contains(&id) {
            ids.push(id);
        }
    }
    for id in ids {
        out.extend_from_slice(&(id as i32).to_le_bytes());
    }
}

/// Loads a synthetic file and returns the logits of every position of `tokens` (one pass,
/// `kv_type` cache), checking they are finite and moderate.
#[cfg(test)]
pub(super) fn logits_of_file(
    path: &std::path::Path,
    tokens: &[u32],
    kv_type: model::KvType,
) -> (model::Model, Vec<f32>) {
    let model = model::Model::load(path).unwrap();
    let last = model.n_layer() - 1;
    let mut kv = model::KvCache::new(model.kv_layout(kv_type, 0..=last, 512));
    let experts = model::ResidentExperts::new(&model);
    let mut seqs = [model::SeqInput {
        kv: &mut kv,
        n_tokens: tokens.len(),
        logits: model::LogitsWanted::All,
    }];
    let out = model
        .forward(
            &model::Compute::new(2),
            &experts,
            0..=last,
            true,
            model::StageInput::Tokens(tokens),
            &mut seqs,
            &mut model::NoHooks,
        )
        .unwrap();
    let model::StageOutput::Logits(logits) = out else {
        panic!("the last stage gives logits")
    };
    assert_eq!(logits.data.len(), tokens.len() * model.hp.n_vocab);
    assert!(logits.data.iter().all(|v| v.is_finite()));
    let spread = logits.data.iter().fold(0f32, |m, v| m.max(v.abs()));
    assert!(spread > 0.0 && spread < 1e3, "logits up to {spread}");
    (model, logits.data)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Random IQ rows are valid blocks whose values have about the requested RMS.
    #[test]
    fn random_iq_rows_have_the_requested_rms() {
        let mut rng = Rng(7);
        for dtype in [GgmlType::Iq2Xxs, GgmlType::Iq3Xxs] {
            let pool = RowPool::new(&mut rng, dtype, 512, 0.02).unwrap();
            let mut out = vec![0f32; 512];
            for row in &pool.rows {
                kernels::formats::dequantize_row(dtype, row, &mut out).unwrap();
                let rms = (out.iter().map(|v| v * v).sum::<f32>() / 512.0).sqrt();
                assert!((rms - 0.02).abs() < 0.002, "{dtype}: rms {rms}");
            }
        }
    }

    #[test]
    fn iq2_xxs_mix_puts_iq_formats_on_the_routed_experts() {
        let p = PRESETS.iter().find(|p| p.name == "olmoe-7b-a1b").unwrap();
        let plans = plan(p, ExpertMix::Iq2Xxs);
        let of = |name: &str| plans.iter().find(|t| t.name == name).unwrap().dtype;
        assert_eq!(of("blk.0.ffn_gate_exps.weight"), GgmlType::Iq2Xxs);
        assert_eq!(of("blk.0.ffn_up_exps.weight"), GgmlType::Iq2Xxs);
        assert_eq!(of("blk.0.ffn_down_exps.weight"), GgmlType::Iq3Xxs);
        assert_eq!(of("blk.0.attn_q.weight"), GgmlType::Q4K);
        let plans = plan(p, ExpertMix::Iq2XxsQ2K);
        let of = |name: &str| plans.iter().find(|t| t.name == name).unwrap().dtype;
        assert_eq!(of("blk.0.ffn_gate_exps.weight"), GgmlType::Iq2Xxs);
        assert_eq!(of("blk.0.ffn_down_exps.weight"), GgmlType::Q2K);
        assert_eq!(of("blk.0.attn_q.weight"), GgmlType::Q4K);
    }
}
