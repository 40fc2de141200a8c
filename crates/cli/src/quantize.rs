//! `moeshard quantize`: rewrite a GGUF with its matrices in another block format (like
//! llama-quantize without an importance matrix). Norms, biases and other 1-D tensors, and the
//! MoE router, stay F32; integer tables stay as they are.

use std::path::PathBuf;

use anyhow::{Context, bail};
use gguf::{GgmlType, GgufModel, GgufWriter};

#[derive(clap::Args)]
pub struct QuantizeArgs {
    pub input: PathBuf,
    pub output: PathBuf,
    /// Target type of the matrices: f32, f16, bf16, q8_0, q4_0, q4_1, q5_0, q5_1, q2_K..q6_K, mxfp4.
    #[arg(long = "type")]
    pub dtype: String,
}

pub fn run(args: &QuantizeArgs) -> anyhow::Result<()> {
    let target = GgmlType::from_name(&args.dtype)
        .with_context(|| format!("unknown type {:?}", args.dtype))?;
    let Some(quantize) = kernels::format(target).and_then(|f| f.quantize) else {
        bail!("no quantizer for {target}");
    };
    let model = GgufModel::open(&args.input)
        .with_context(|| format!("opening {}", args.input.display()))?;
    anyhow::ensure!(
        model.splits().len() == 1,
        "split models are not supported by quantize"
    );
    let mut w = GgufWriter::with_metadata(model.metadata().clone())?;
    let (mut converted, mut kept) = (0, 0);
    for t in model.tensors() {
        let info = t.info;
        let dims = info.shape.dims();
        // Integer tables (DeepSeek V4's hash routing `ffn_gate_tid2eid`) are ids, not weights.
        let integer = matches!(
            info.dtype,
            GgmlType::I8 | GgmlType::I16 | GgmlType::I32 | GgmlType::I64
        );
        let keep = dims.len() < 2
            || integer
            || info.name.contains("ffn_gate_inp")
            || info.dtype == target
            || target.row_bytes(dims[0]).is_none();
        if keep {
            w.add_tensor(info.name.clone(), info.dtype, dims, t.data())?;
            kept += 1;
            continue;
        }
        let fmt = kernels::format(info.dtype)
            .with_context(|| format!("{}: cannot dequantize {}", info.name, info.dtype))?;
        let (row_len, rows) = (dims[0] as usize, info.rows() as usize);
        let (src_rb, dst_rb) = (
            info.row_bytes() as usize,
            target.row_bytes(dims[0]).unwrap_or(0) as usize,
        );
        let mut out = vec![0u8; rows * dst_rb];
        let mut tmp = vec![0f32; row_len];
        for r in 0..rows {
            (fmt.dequantize)(&t.data()[r * src_rb..(r + 1) * src_rb], &mut tmp);
            quantize(&tmp, &mut out[r * dst_rb..(r + 1) * dst_rb]);
        }
        w.add_tensor(info.name.clone(), target, dims, out)?;
        converted += 1;
    }
    w.write_to_path(&args.output)
        .with_context(|| format!("writing {}", args.output.display()))?;
    eprintln!(
        "wrote {}: {converted} tensors as {target}, {kept} unchanged",
        args.output.display()
    );
    Ok(())
}
