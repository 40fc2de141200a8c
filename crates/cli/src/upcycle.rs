//! `moeshard upcycle`: turns a dense llama GGUF into a Mixtral-style MoE GGUF that computes the
//! same function. Each FFN's intermediate neurons are split into E experts (gate/up rows,
//! down columns); the router is all zeros so every expert gets weight 1/E after the softmax and
//! top-E renormalization, and each expert's down projection is scaled by E (exact for a power
//! of two, through the block scales). Running it exercises the whole MoE path on real weights.

use std::path::PathBuf;

use anyhow::{Context, bail, ensure};
use gguf::{GgmlType, GgufModel, GgufWriter, Value};

#[derive(clap::Args)]
pub struct UpcycleArgs {
    /// Dense llama-architecture GGUF.
    pub input: PathBuf,
    /// Where to write the MoE GGUF.
    pub output: PathBuf,
    /// Number of experts (a power of two dividing the FFN width into whole blocks).
    #[arg(long, default_value_t = 4)]
    pub experts: usize,
}

pub fn run(args: &UpcycleArgs) -> anyhow::Result<()> {
    let e = args.experts;
    ensure!(
        e >= 2 && e.is_power_of_two(),
        "--experts must be a power of two ≥ 2, got {e}"
    );
    let model = GgufModel::open(&args.input)
        .with_context(|| format!("opening {}", args.input.display()))?;
    let meta = model.metadata();
    let arch = meta.arch()?;
    ensure!(
        arch == "llama",
        "{}: architecture {arch:?}; upcycling needs a dense llama model",
        args.input.display()
    );
    ensure!(
        model.splits().len() == 1,
        "split models are not supported by upcycle"
    );
    let n_layer = meta.arch_u32("block_count")? as usize;
    let n_embd = meta.arch_u32("embedding_length")? as u64;
    let n_ff = meta.arch_u32("feed_forward_length")? as u64;
    ensure!(
        n_ff.is_multiple_of(e as u64),
        "feed_forward_length {n_ff} is not divisible by {e} experts"
    );
    let n_ff_e = n_ff / e as u64;

    let mut w = GgufWriter::with_metadata(meta.clone())?;
    w.set_metadata("llama.expert_count", Value::U32(e as u32))?;
    w.set_metadata("llama.expert_used_count", Value::U32(e as u32))?;
    w.set_metadata("llama.feed_forward_length", Value::U32(n_ff_e as u32))?;
    w.set_metadata(
        "llama.expert_feed_forward_length",
        Value::U32(n_ff_e as u32),
    )?;
    if let Some(name) = meta.get_str("general.name")? {
        w.set_metadata("general.name", format!("{name} (upcycled to {e} experts)"))?;
    }
    let ffn = |il: usize, what: &str| format!("blk.{il}.ffn_{what}.weight");
    for t in model.tensors() {
        let name = &t.info.name;
        let is_ffn =
            (0..n_layer).any(|il| [ffn(il, "gate"), ffn(il, "up"), ffn(il, "down")].contains(name));
        if !is_ffn {
            w.add_tensor(name.clone(), t.info.dtype, t.info.shape.dims(), t.data())?;
        }
    }
    for il in 0..n_layer {
        let get = |what: &str| {
            model
                .tensor(&ffn(il, what))
                .with_context(|| format!("missing {}", ffn(il, what)))
        };
        let (gate, up, down) = (get("gate")?, get("up")?, get("down")?);
        ensure!(
            gate.info.shape.dims() == [n_embd, n_ff],
            "{}: unexpected shape",
            gate.info.name
        );
        ensure!(
            up.info.shape.dims() == [n_embd, n_ff],
            "{}: unexpected shape",
            up.info.name
        );
        ensure!(
            down.info.shape.dims() == [n_ff, n_embd],
            "{}: unexpected shape",
            down.info.name
        );
        // Gate and up: expert k is rows k·F/E.. of the dense matrix, already expert-major.
        w.add_tensor(
            format!("blk.{il}.ffn_gate_exps.weight"),
            gate.info.dtype,
            &[n_embd, n_ff_e, e as u64],
            gate.data(),
        )?;
        w.add_tensor(
            format!("blk.{il}.ffn_up_exps.weight"),
            up.info.dtype,
            &[n_embd, n_ff_e, e as u64],
            up.data(),
        )?;
        // Down: expert k takes columns k·F/E.. of every row, scaled by E.
        let dt = down.info.dtype;
        let Some(part_bytes) = dt.row_bytes(n_ff_e) else {
            bail!(
                "{}: {n_ff_e} columns per expert is not a whole number of {dt} blocks",
                down.info.name
            );
        };
        let (part_bytes, row_bytes) = (part_bytes as usize, down.info.row_bytes() as usize);
        let src = down.data();
        let mut out = Vec::with_capacity(src.len());
        for k in 0..e {
            for r in 0..n_embd as usize {
                let start = r * row_bytes + k * part_bytes;
                let mut part = src[start..start + part_bytes].to_vec();
                kernels::blocks::scale_row_pow2(dt, &mut part, e as f32)
                    .with_context(|| format!("{}: cannot scale {dt} blocks", down.info.name))?;
                out.extend_from_slice(&part);
            }
        }
        w.add_tensor(
            format!("blk.{il}.ffn_down_exps.weight"),
            dt,
            &[n_ff_e, n_embd, e as u64],
            out,
        )?;
        w.add_tensor(
            format!("blk.{il}.ffn_gate_inp.weight"),
            GgmlType::F32,
            &[n_embd, e as u64],
            vec![0u8; 4 * n_embd as usize * e],
        )?;
    }
    w.write_to_path(&args.output)
        .with_context(|| format!("writing {}", args.output.display()))?;
    eprintln!(
        "wrote {} ({n_layer} layers, {e} experts of {n_ff_e})",
        args.output.display()
    );
    Ok(())
}
