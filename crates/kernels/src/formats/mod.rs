//! One table of every block format we compute with: how to dequantize it, which activation
//! format its dot product pairs with, and the scalar reference dot product. SIMD variants live in
//! `crate::x86` and are checked against these.

pub mod float;
pub mod iq_grids;
pub mod iquants;
pub mod kquants;
pub mod legacy;
pub mod mxfp4;
pub mod quantize_k;
pub mod quantize_legacy;
pub mod ternary;

use gguf::GgmlType;

/// The form activations take for a dot product with a given weight format.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum ActKind {
    /// Plain little-endian f32 values (paired with F32/F16/BF16 weights).
    F32,
    /// Q8_0 blocks (paired with Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, MXFP4, IQ4_NL).
    Q8_0,
    /// Q8_K blocks (paired with the K-quants, the 256-element IQ formats, TQ1_0 and TQ2_0).
    Q8K,
}

impl ActKind {
    /// The ggml type whose blocks hold activations of this kind.
    pub fn ggml_type(self) -> GgmlType {
        match self {
            ActKind::F32 => GgmlType::F32,
            ActKind::Q8_0 => GgmlType::Q8_0,
            ActKind::Q8K => GgmlType::Q8K,
        }
    }

    /// Bytes one activation row of `k` values takes.
    pub fn row_bytes(self, k: usize) -> usize {
        let t = self.ggml_type();
        k / t.block_size() * t.type_size()
    }

    /// Quantizes one row (`src.len()` a multiple of the block size) into `dst`.
    pub fn quantize_row(self, src: &[f32], dst: &mut [u8]) {
        match self {
            ActKind::F32 => float::quantize_f32(src, dst),
            ActKind::Q8_0 => legacy::quantize_q8_0_activations(src, dst),
            ActKind::Q8K => kquants::quantize_q8_k(src, dst),
        }
    }
}

/// `dot(n, weight_row_bytes, activation_row_bytes)` over `n` elements.
pub type DotFn = fn(usize, &[u8], &[u8]) -> f32;
/// Dequantizes whole blocks of `src` into `dst` (`dst.len()` elements).
pub type DequantizeFn = fn(&[u8], &mut [f32]);
/// Quantizes `src` into whole blocks of `dst`.
pub type QuantizeFn = fn(&[f32], &mut [u8]);

/// What the kernels know about one weight format.
#[derive(Clone, Copy)]
pub struct Format {
    pub dtype: GgmlType,
    pub act: ActKind,
    pub dequantize: DequantizeFn,
    pub dot_scalar: DotFn,
    /// A reference quantizer, where we have one (test data, `moeshard synth`).
    pub quantize: Option<QuantizeFn>,
}

/// The formats we can compute with, or `None` for a type we only know the size of.
pub fn format(dtype: GgmlType) -> Option<Format> {
    use GgmlType as T;
    let f = |act, dequantize, dot_scalar, quantize| Format {
        dtype,
        act,
        dequantize,
        dot_scalar,
        quantize,
    };
    Some(match dtype {
        T::F32 => f(
            ActKind::F32,
            float::dequantize_f32 as DequantizeFn,
            float::dot_f32 as DotFn,
            Some(float::quantize_f32 as QuantizeFn),
        ),
        T::F16 => f(
            ActKind::F32,
            float::dequantize_f16,
            float::dot_f16,
            Some(float::quantize_f16),
        ),
        T::Bf16 => f(
            ActKind::F32,
            float::dequantize_bf16,
            float::dot_bf16,
            Some(float::quantize_bf16),
        ),
        T::Q4_0 => f(
            ActKind::Q8_0,
            legacy::dequantize_q4_0,
            legacy::dot_q4_0,
            Some(legacy::quantize_q4_0),
        ),
        T::Q4_1 => f(
            ActKind::Q8_0,
            legacy::dequantize_q4_1,
            legacy::dot_q4_1,
            Some(quantize_legacy::quantize_q4_1),
        ),
        T::Q5_0 => f(
            ActKind::Q8_0,
            legacy::dequantize_q5_0,
            legacy::dot_q5_0,
            Some(quantize_legacy::quantize_q5_0),
        ),
        T::Q5_1 => f(
            ActKind::Q8_0,
            legacy::dequantize_q5_1,
            legacy::dot_q5_1,
            Some(quantize_legacy::quantize_q5_1),
        ),
        T::Q8_0 => f(
            ActKind::Q8_0,
            legacy::dequantize_q8_0,
            legacy::dot_q8_0,
            Some(legacy::quantize_q8_0),
        ),
        T::Mxfp4 => f(
            ActKind::Q8_0,
            mxfp4::dequantize_mxfp4,
            mxfp4::dot_mxfp4,
            Some(mxfp4::quantize_mxfp4),
        ),
        T::Q2K => f(
            ActKind::Q8K,
            kquants::dequantize_q2_k,
            kquants::dot_q2_k,
            Some(quantize_k::quantize_q2_k),
        ),
        T::Q3K => f(
            ActKind::Q8K,
            kquants::dequantize_q3_k,
            kquants::dot_q3_k,
            Some(quantize_k::quantize_q3_k),
        ),
        T::Q4K => f(
            ActKind::Q8K,
            kquants::dequantize_q4_k,
            kquants::dot_q4_k,
            Some(quantize_k::quantize_q4_k),
        ),
        T::Q5K => f(
            ActKind::Q8K,
            kquants::dequantize_q5_k,
            kquants::dot_q5_k,
            Some(quantize_k::quantize_q5_k),
        ),
        T::Q6K => f(
            ActKind::Q8K,
            kquants::dequantize_q6_k,
            kquants::dot_q6_k,
            Some(quantize_k::quantize_q6_k),
        ),
        T::Q8K => f(
            ActKind::Q8K,
            kquants::dequantize_q8_k,
            kquants::dot_q8_k,
            Some(kquants::quantize_q8_k),
        ),
        // No quantizers: IQ weights come already quantized (ggml's IQ quantizers search large
        // tables, most with an importance matrix).
        T::Iq4Nl => f(
            ActKind::Q8_0,
            iquants::dequantize_iq4_nl,
            iquants::dot_iq4_nl,
            None,
        ),
        T::Iq4Xs => f(
            ActKind::Q8K,
            iquants::dequantize_iq4_xs,
            iquants::dot_iq4_xs,
            None,
        ),
        T::Iq2Xxs => f(
            ActKind::Q8K,
            iquants::dequantize_iq2_xxs,
            iquants::dot_iq2_xxs,
            None,
        ),
        T::Iq2Xs => f(
            ActKind::Q8K,
            iquants::dequantize_iq2_xs,
            iquants::dot_iq2_xs,
            None,
        ),
        T::Iq2S => f(
            ActKind::Q8K,
            iquants::dequantize_iq2_s,
            iquants::dot_iq2_s,
            None,
        ),
        T::Iq3Xxs => f(
            ActKind::Q8K,
            iquants::dequantize_iq3_xxs,
            iquants::dot_iq3_xxs,
            None,
        ),
        T::Iq3S => f(
            ActKind::Q8K,
            iquants::dequantize_iq3_s,
            iquants::dot_iq3_s,
            None,
        ),
        T::Iq1S => f(
            ActKind::Q8K,
            iquants::dequantize_iq1_s,
            iquants::dot_iq1_s,
            None,
        ),
        T::Iq1M => f(
            ActKind::Q8K,
            iquants::dequantize_iq1_m,
            iquants::dot_iq1_m,
            None,
        ),
        T::Tq1_0 => f(
            ActKind::Q8K,
            ternary::dequantize_tq1_0,
            ternary::dot_tq1_0,
            None,
        ),
        T::Tq2_0 => f(
            ActKind::Q8K,
            ternary::dequantize_tq2_0,
            ternary::dot_tq2_0,
            None,
        ),
        _ => return None,
    })
}

/// Dequantizes a whole row of `dtype` into `dst`; `None` for a type we cannot compute with.
pub fn dequantize_row(dtype: GgmlType, src: &[u8], dst: &mut [f32]) -> Option<()> {
    (format(dtype)?.dequantize)(src, dst);
    Some(())
}
