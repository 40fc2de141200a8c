//! Shared test helpers: a deterministic generator and random but well-formed weight blocks.

#![allow(dead_code)]

use gguf::GgmlType;
use kernels::blocks::f16_to_bytes;

/// SplitMix64: tiny, deterministic, good enough for test data.
pub struct Rng(u64);

impl Rng {
    pub fn new(seed: u64) -> Rng {
        Rng(seed)
    }
    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }
    /// Uniform in [0, 1).
    pub fn f32(&mut self) -> f32 {
        (self.next_u64() >> 40) as f32 / (1u64 << 24) as f32
    }
    /// Roughly normal (sum of uniforms), mean 0, std 1.
    pub fn normal(&mut self) -> f32 {
        (0..12).map(|_| self.f32()).sum::<f32>() - 6.0
    }
    pub fn bytes(&mut self, n: usize) -> Vec<u8> {
        (0..n).map(|_| self.next_u64() as u8).collect()
    }
    pub fn normals(&mut self, n: usize) -> Vec<f32> {
        (0..n).map(|_| self.normal()).collect()
    }
}

/// A row of `n` elements of type `t` with random quants and sane scales (no NaN/inf).
pub fn random_row(rng: &mut Rng, t: GgmlType, n: usize) -> Vec<u8> {
    use GgmlType as T;
    match t {
        T::F32 => rng
            .normals(n)
            .iter()
            .flat_map(|v| v.to_le_bytes())
            .collect(),
        T::F16 => rng
            .normals(n)
            .iter()
            .flat_map(|v| f16_to_bytes(*v))
            .collect(),
        T::Bf16 => rng
            .normals(n)
            .iter()
            .flat_map(|v| kernels::blocks::f32_to_bf16_bits(*v).to_le_bytes())
            .collect(),
        _ => {
            let (bs, ts) = (t.block_size(), t.type_size());
            let mut row = rng.bytes(n / bs * ts);
            for block in row.chunks_exact_mut(ts) {
                for &off in kernels::blocks::f16_scale_fields(t) {
                    let v = 0.001 + 0.02 * rng.f32();
                    block[off..off + 2].copy_from_slice(&f16_to_bytes(v));
                }
                match t {
                    T::Q8K => block[..4].copy_from_slice(&(0.01 + 0.02 * rng.f32()).to_le_bytes()),
                    T::Mxfp4 => block[0] = 118 + (rng.next_u64() % 12) as u8,
                    // The f16 scale is the top nibbles of the four scale words (bytes 49, 51,
                    // 53, 55): exponent and sign stay those of 0.001…0.016.
                    T::Iq1M => {
                        let d = u16::from_le_bytes(f16_to_bytes(0.001 + 0.015 * rng.f32()));
                        for (i, o) in [49, 51, 53, 55].into_iter().enumerate() {
                            let nibble = ((d >> (4 * i)) & 0xF) as u8;
                            block[o] = (block[o] & 0x0F) | (nibble << 4);
                        }
                    }
                    _ => {}
                }
            }
            if t == T::Q8K {
                // Q8_K carries sums of its quants; keep them consistent.
                for block in row.chunks_exact_mut(ts) {
                    for j in 0..16 {
                        let s: i32 = block[4 + 16 * j..4 + 16 * j + 16]
                            .iter()
                            .map(|&q| q as i8 as i32)
                            .sum();
                        block[260 + 2 * j..262 + 2 * j].copy_from_slice(&(s as i16).to_le_bytes());
                    }
                }
            }
            row
        }
    }
}

/// Every format the kernels compute with.
pub const COMPUTE_TYPES: [GgmlType; 26] = [
    GgmlType::F32,
    GgmlType::F16,
    GgmlType::Bf16,
    GgmlType::Q4_0,
    GgmlType::Q4_1,
    GgmlType::Q5_0,
    GgmlType::Q5_1,
    GgmlType::Q8_0,
    GgmlType::Q2K,
    GgmlType::Q3K,
    GgmlType::Q4K,
    GgmlType::Q5K,
    GgmlType::Q6K,
    GgmlType::Q8K,
    GgmlType::Mxfp4,
    GgmlType::Iq4Nl,
    GgmlType::Iq4Xs,
    GgmlType::Iq2Xxs,
    GgmlType::Iq2Xs,
    GgmlType::Iq2S,
    GgmlType::Iq3Xxs,
    GgmlType::Iq3S,
    GgmlType::Iq1S,
    GgmlType::Iq1M,
    GgmlType::Tq1_0,
    GgmlType::Tq2_0,
];

/// The IQ and ternary formats: no quantizer (their weights come quantized), x86 kernels but (so
/// far) no NEON ones.
pub const IQ_TQ_TYPES: [GgmlType; 11] = [
    GgmlType::Iq4Nl,
    GgmlType::Iq4Xs,
    GgmlType::Iq2Xxs,
    GgmlType::Iq2Xs,
    GgmlType::Iq2S,
    GgmlType::Iq3Xxs,
    GgmlType::Iq3S,
    GgmlType::Iq1S,
    GgmlType::Iq1M,
    GgmlType::Tq1_0,
    GgmlType::Tq2_0,
];
