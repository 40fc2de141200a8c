//! RMSNorm: `x / sqrt(mean(x²) + eps) · w`, row by row. The mean is accumulated in f64 so long
//! rows do not lose precision to the summation order.

pub fn rms_norm_rows(x: &[f32], w: &[f32], eps: f32, out: &mut [f32]) {
    let d = w.len();
    for (xr, yr) in x.chunks_exact(d).zip(out.chunks_exact_mut(d)) {
        rms_norm(xr, w, eps, yr);
    }
}

pub fn rms_norm(x: &[f32], w: &[f32], eps: f32, out: &mut [f32]) {
    let ss: f64 = x.iter().map(|&v| v as f64 * v as f64).sum();
    let scale = 1.0 / ((ss / x.len() as f64) as f32 + eps).sqrt();
    for ((o, &v), &g) in out.iter_mut().zip(x).zip(w) {
        *o = g * (v * scale);
    }
}

/// In place over rows of `w.len()`.
pub fn rms_norm_rows_inplace(x: &mut [f32], w: &[f32], eps: f32) {
    let d = w.len();
    let mut tmp = vec![0f32; d];
    for row in x.chunks_exact_mut(d) {
        rms_norm(row, w, eps, &mut tmp);
        row.copy_from_slice(&tmp);
    }
}

/// LayerNorm with weight and bias, in place over rows of `w.len()`: `(x − mean) / sqrt(var +
/// eps) · w + b` (mean and variance accumulated in f64, like [`rms_norm`]).
pub fn layer_norm_rows_inplace(x: &mut [f32], w: &[f32], b: &[f32], eps: f32) {
    let d = w.len();
    for row in x.chunks_exact_mut(d) {
        let mean = row.iter().map(|&v| v as f64).sum::<f64>() / d as f64;
        let var = row
            .iter()
            .map(|&v| (v as f64 - mean) * (v as f64 - mean))
            .sum::<f64>()
            / d as f64;
        let scale = 1.0 / (var as f32 + eps).sqrt();
        let mean = mean as f32;
        for ((v, &g), &bias) in row.iter_mut().zip(w).zip(b) {
            *v = (*v - mean) * scale * g + bias;
        }
    }
}
