//! Activation wire formats for hidden states between stages: f32 (exact), bf16 (round to
//! nearest even), and 8-bit e4m3 with one f32 scale per token row (the row's max maps to 448,
//! e4m3's largest finite value — better than ds4's unscaled e4m3). Logits always travel as f32.

use serde::{Deserialize, Serialize};

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum ActFormat {
    F32,
    Bf16,
    E4m3,
}

impl ActFormat {
    pub fn from_bits(bits: u32) -> Option<ActFormat> {
        match bits {
            32 => Some(ActFormat::F32),
            16 => Some(ActFormat::Bf16),
            8 => Some(ActFormat::E4m3),
            _ => None,
        }
    }

    pub fn bits(self) -> u32 {
        match self {
            ActFormat::F32 => 32,
            ActFormat::Bf16 => 16,
            ActFormat::E4m3 => 8,
        }
    }

    /// Bytes for `rows × cols` values.
    pub fn encoded_len(self, rows: usize, cols: usize) -> usize {
        match self {
            ActFormat::F32 => rows * cols * 4,
            ActFormat::Bf16 => rows * cols * 2,
            ActFormat::E4m3 => rows * (4 + cols),
        }
    }

    pub fn encode(self, data: &[f32], cols: usize, out: &mut Vec<u8>) {
        match self {
            ActFormat::F32 => out.extend(data.iter().flat_map(|v| v.to_le_bytes())),
            ActFormat::Bf16 => out.extend(
                data.iter()
                    .flat_map(|&v| kernels::blocks::f32_to_bf16_bits(v).to_le_bytes()),
            ),
            ActFormat::E4m3 => {
                for row in data.chunks_exact(cols) {
                    let amax = row.iter().fold(0f32, |m, v| m.max(v.abs()));
                    let scale = if amax > 0.0 && amax.is_finite() {
                        amax / E4M3_MAX
                    } else {
                        1.0
                    };
                    out.extend_from_slice(&scale.to_le_bytes());
                    let inv = 1.0 / scale;
                    out.extend(row.iter().map(|&v| f32_to_e4m3(v * inv)));
                }
            }
        }
    }

    /// Decodes `rows × cols` values; `None` when the byte count does not match.
    pub fn decode(self, bytes: &[u8], rows: usize, cols: usize) -> Option<Vec<f32>> {
        if bytes.len() != self.encoded_len(rows, cols) {
            return None;
        }
        Some(match self {
            ActFormat::F32 => bytes
                .chunks_exact(4)
                .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
                .collect(),
            ActFormat::Bf16 => bytes
                .chunks_exact(2)
                .map(|c| kernels::blocks::bf16_bits_to_f32(u16::from_le_bytes([c[0], c[1]])))
                .collect(),
            ActFormat::E4m3 => {
                let mut out = Vec::with_capacity(rows * cols);
                for row in bytes.chunks_exact(4 + cols) {
                    let scale = f32::from_le_bytes([row[0], row[1], row[2], row[3]]);
                    out.extend(row[4..].iter().map(|&b| e4m3_to_f32(b) * scale));
                }
                out
            }
        })
    }
}

/// Rows whose last `exact` values travel as raw f32 bits whatever the format: what a stage
/// carries besides the stream (GLM-5's sparse-attention selection, `Hparams::carried_width`).
/// Each row is its first `cols - exact` values in the format, then the exact ones.
impl ActFormat {
    pub fn encoded_len_exact_tail(self, rows: usize, cols: usize, exact: usize) -> usize {
        self.encoded_len(rows, cols - exact) + rows * exact * 4
    }

    pub fn encode_exact_tail(self, data: &[f32], cols: usize, exact: usize, out: &mut Vec<u8>) {
        if exact == 0 || self == ActFormat::F32 {
            return self.encode(data, cols, out);
        }
        for row in data.chunks_exact(cols) {
            let (lossy, tail) = row.split_at(cols - exact);
            self.encode(lossy, lossy.len(), out);
            out.extend(tail.iter().flat_map(|v| v.to_bits().to_le_bytes()));
        }
    }

    /// Decodes what [`ActFormat::encode_exact_tail`] wrote; `None` when the byte count does not
    /// match.
    pub fn decode_exact_tail(
        self,
        bytes: &[u8],
        rows: usize,
        cols: usize,
        exact: usize,
    ) -> Option<Vec<f32>> {
        if exact == 0 || self == ActFormat::F32 {
            return self.decode(bytes, rows, cols);
        }
        if exact > cols || bytes.len() != self.encoded_len_exact_tail(rows, cols, exact) {
            return None;
        }
        let lossy = cols - exact;
        let row_bytes = self.encoded_len(1, lossy) + exact * 4;
        let mut out = Vec::with_capacity(rows * cols);
        for row in bytes.chunks_exact(row_bytes) {
            let (head, tail) = row.split_at(row_bytes - exact * 4);
            out.extend(self.decode(head, 1, lossy)?);
            out.extend(
                tail.chunks_exact(4)
                    .map(|c| f32::from_bits(u32::from_le_bytes([c[0], c[1], c[2], c[3]]))),
            );
        }
        Some(out)
    }
}

/// Largest finite e4m3 (OCP FP8 E4M3FN: no infinities, one NaN pattern).
pub const E4M3_MAX: f32 = 448.0;

pub fn e4m3_to_f32(b: u8) -> f32 {
    let sign = if b & 0x80 != 0 { -1.0 } else { 1.0 };
    let exp = ((b >> 3) & 0x0F) as i32;
    let man = (b & 0x07) as f32;
    if exp == 0x0F && (b & 0x07) == 0x07 {
        return f32::NAN;
    }
    if exp == 0 {
        sign * man / 8.0 * 2f32.powi(-6)
    } else {
        sign * (1.0 + man / 8.0) * 2f32.powi(exp - 7)
    }
}

/// Round to nearest even, saturating at ±448.
pub fn f32_to_e4m3(v: f32) -> u8 {
    if v.is_nan() {
        return 0x7F;
    }
    let sign = if v.is_sign_negative() { 0x80u8 } else { 0 };
    let a = v.abs().min(E4M3_MAX);
    // Search the 127 non-negative finite codes: exact nearest with ties to even code.
    let mut lo = 0u8;
    let mut hi = 0x7Eu8;
    while lo < hi {
        let mid = (lo + hi).div_ceil(2);
        if e4m3_to_f32(mid) <= a {
            lo = mid
        } else {
            hi = mid - 1
        }
    }
    let below = lo;
    let code = if below == 0x7E {
        below
    } else {
        let (vb, va) = (e4m3_to_f32(below), e4m3_to_f32(below + 1));
        let (db, da) = (a - vb, va - a);
        if db < da || (db == da && below.is_multiple_of(2)) {
            below
        } else {
            below + 1
        }
    };
    sign | code
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_exact_tail_keeps_its_bit_patterns_in_every_format() {
        let (rows, cols, exact) = (3, 10, 4);
        let data: Vec<f32> = (0..rows * cols)
            .map(|i| match i % cols {
                c if c < cols - exact => 0.37 * i as f32 - 2.0,
                c if c == cols - 1 => f32::from_bits(u32::MAX),
                c => f32::from_bits((i * 1000 + c) as u32),
            })
            .collect();
        for f in [ActFormat::F32, ActFormat::Bf16, ActFormat::E4m3] {
            let mut buf = Vec::new();
            f.encode_exact_tail(&data, cols, exact, &mut buf);
            assert_eq!(
                buf.len(),
                f.encoded_len_exact_tail(rows, cols, exact),
                "{f:?}"
            );
            let back = f.decode_exact_tail(&buf, rows, cols, exact).unwrap();
            for (i, (a, b)) in data.iter().zip(&back).enumerate() {
                if i % cols >= cols - exact {
                    assert_eq!(a.to_bits(), b.to_bits(), "{f:?} value {i}");
                } else {
                    assert!((a - b).abs() <= 0.1 * a.abs().max(1.0), "{f:?} value {i}");
                }
            }
            assert!(f.decode_exact_tail(&buf[1..], rows, cols, exact).is_none());
        }
    }

    #[test]
    fn e4m3_round_trips_every_code_and_rounds_to_nearest() {
        for b in 0u8..=0xFE {
            if b & 0x7F == 0x7F {
                continue;
            }
            let v = e4m3_to_f32(b);
            let back = f32_to_e4m3(v);
            assert!(
                back == b || (v == 0.0 && back & 0x7F == 0),
                "{b:#x} -> {v} -> {back:#x}"
            );
        }
        assert_eq!(e4m3_to_f32(f32_to_e4m3(1000.0)), 448.0);
        assert_eq!(e4m3_to_f32(f32_to_e4m3(1.06)), 1.0);
        assert_eq!(e4m3_to_f32(f32_to_e4m3(1.07)), 1.125);
    }

    #[test]
    fn formats_round_trip_within_their_precision() {
        let rows = 3;
        let cols = 64;
        let data: Vec<f32> = (0..rows * cols)
            .map(|i| ((i * 37 % 101) as f32 - 50.0) * 0.37)
            .collect();
        for (f, tol) in [
            (ActFormat::F32, 0.0),
            (ActFormat::Bf16, 1.0 / 128.0),
            (ActFormat::E4m3, 1.0 / 16.0),
        ] {
            let mut buf = Vec::new();
            f.encode(&data, cols, &mut buf);
            assert_eq!(buf.len(), f.encoded_len(rows, cols));
            let back = f.decode(&buf, rows, cols).unwrap();
            for (a, b) in data.iter().zip(&back) {
                assert!(
                    (a - b).abs() <= tol * a.abs().max(1.0) * 1.01,
                    "{f:?}: {a} vs {b}"
                );
            }
            assert!(f.decode(&buf[1..], rows, cols).is_none());
        }
    }
}
