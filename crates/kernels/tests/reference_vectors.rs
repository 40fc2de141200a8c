//! Bit-exactness against ggml: every format's dequantization equals the reference values
//! produced by ggml's C code (tools/fixtures/quant), and our quantizers reproduce ggml's bytes
//! for the formats we quantize ourselves.

use std::path::PathBuf;

use gguf::GgmlType;
use kernels::format;

struct Vectors {
    dtype: GgmlType,
    n_rows: usize,
    n_per_row: usize,
    source: Vec<f32>,
    quantized: Vec<u8>,
    dequantized: Vec<f32>,
}

fn f32s(b: &[u8]) -> Vec<f32> {
    b.chunks_exact(4)
        .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
        .collect()
}

fn load(name: &str) -> Vectors {
    let path = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("tests/data/quant")
        .join(format!("{name}.bin"));
    let bytes = std::fs::read(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    assert_eq!(&bytes[..4], b"MSQV", "{name}: magic");
    let u = |o: usize| {
        u32::from_le_bytes([bytes[o], bytes[o + 1], bytes[o + 2], bytes[o + 3]]) as usize
    };
    assert_eq!(u(4), 1, "{name}: version");
    let dtype = GgmlType::from_id(u(8) as u32).expect("known type");
    let (n_rows, n_per_row) = (u(12), u(16));
    let n = n_rows * n_per_row;
    let qbytes = n_rows * dtype.row_bytes(n_per_row as u64).unwrap() as usize;
    let mut o = 20;
    let source = f32s(&bytes[o..o + 4 * n]);
    o += 4 * n;
    let quantized = bytes[o..o + qbytes].to_vec();
    o += qbytes;
    let dequantized = f32s(&bytes[o..o + 4 * n]);
    assert_eq!(o + 4 * n, bytes.len(), "{name}: trailing bytes");
    Vectors {
        dtype,
        n_rows,
        n_per_row,
        source,
        quantized,
        dequantized,
    }
}

const ALL: [&str; 26] = [
    "f32", "f16", "bf16", "q4_0", "q4_1", "q5_0", "q5_1", "q8_0", "q2_K", "q3_K", "q4_K", "q5_K",
    "q6_K", "q8_K", "mxfp4", "iq4_nl", "iq4_xs", "iq2_xxs", "iq3_xxs", "iq2_xs", "iq3_s", "iq2_s",
    "iq1_s", "iq1_m", "tq1_0", "tq2_0",
];

#[test]
fn dequantization_is_bit_exact_with_ggml() {
    for name in ALL {
        let v = load(name);
        let f = format(v.dtype).unwrap_or_else(|| panic!("{name}: no format"));
        let rb = v.dtype.row_bytes(v.n_per_row as u64).unwrap() as usize;
        for r in 0..v.n_rows {
            let mut out = vec![0f32; v.n_per_row];
            (f.dequantize)(&v.quantized[r * rb..(r + 1) * rb], &mut out);
            let want = &v.dequantized[r * v.n_per_row..(r + 1) * v.n_per_row];
            for (i, (a, b)) in out.iter().zip(want).enumerate() {
                // NaN payloads included: compare bits (ggml quiets signalling NaNs, as we do).
                let same = a.to_bits() == b.to_bits() || (a.is_nan() && b.is_nan());
                assert!(
                    same,
                    "{name} row {r} element {i}: got {a:e} ({:#x}), ggml {b:e} ({:#x})",
                    a.to_bits(),
                    b.to_bits()
                );
            }
        }
    }
}

#[test]
fn our_quantizers_reproduce_ggml_bytes() {
    let mut checked = Vec::new();
    for name in ALL {
        let v = load(name);
        let Some(quantize) = format(v.dtype).and_then(|f| f.quantize) else {
            continue;
        };
        let rb = v.dtype.row_bytes(v.n_per_row as u64).unwrap() as usize;
        for r in 0..v.n_rows {
            let mut out = vec![0u8; rb];
            quantize(&v.source[r * v.n_per_row..(r + 1) * v.n_per_row], &mut out);
            let want = &v.quantized[r * rb..(r + 1) * rb];
            if v.dtype == GgmlType::F16 || v.dtype == GgmlType::Bf16 {
                // NaN inputs: ggml writes a canonical quiet NaN; compare NaN-ness there.
                for (i, (a, b)) in out.chunks_exact(2).zip(want.chunks_exact(2)).enumerate() {
                    let (a, b) = (
                        u16::from_le_bytes([a[0], a[1]]),
                        u16::from_le_bytes([b[0], b[1]]),
                    );
                    let nan = |x: u16| match v.dtype {
                        GgmlType::F16 => (x & 0x7c00) == 0x7c00 && (x & 0x03ff) != 0,
                        _ => (x & 0x7f80) == 0x7f80 && (x & 0x007f) != 0,
                    };
                    assert!(
                        a == b || (nan(a) && nan(b)),
                        "{name} row {r} value {i}: {a:#06x} vs ggml {b:#06x}"
                    );
                }
            } else {
                assert_eq!(
                    out, want,
                    "{name} row {r}: quantized bytes differ from ggml"
                );
            }
        }
        checked.push(name);
    }
    // The formats whose quantizers the engine relies on must be among those checked.
    for must in ["q8_0", "q8_K", "q4_0", "mxfp4", "f16", "bf16"] {
        assert!(checked.contains(&must), "no quantizer checked for {must}");
    }
}
