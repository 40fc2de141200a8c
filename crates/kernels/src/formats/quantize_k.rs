//! Reference quantizers for the K-quants Q2_K … Q6_K, byte-identical with ggml's
//! `quantize_row_q*_K_ref` (the path `llama-quantize` takes without an importance matrix).
//!
//! Byte identity depends on doing every float operation in ggml's order and precision: each
//! `a * b * c` below is `(a * b) * c` as in the C source, sums run in index order, and nothing is
//! fused into a multiply-add (ggml's reference x86-64 build has no FMA). Integer-to-byte stores
//! truncate (`as u8` / `as i8`) exactly like C's implicit conversions.

use crate::blocks::*;
use crate::formats::kquants::nearest_int;

/// ggml's `GROUP_MAX_EPS`: a group whose largest magnitude is below this counts as all zero.
const GROUP_MAX_EPS: f32 = 1e-15;

/// The scale search of `make_qkx2_quants`: try `nstep + 1` inverse scales
/// `(nmax + rmin + rdelta * is) / (max - min)` and keep the one with the least weighted error.
#[derive(Clone, Copy)]
struct Search {
    rmin: f32,
    rdelta: f32,
    nstep: i32,
    /// Weigh absolute rather than squared errors.
    use_mad: bool,
}

/// ggml's `make_qkx2_quants`: quants `l` in `0..=nmax` with `x ≈ scale * l - min`, for a
/// group of `x.len()` values. Returns `(scale, min)`, `min` being the positive offset ggml stores.
fn make_qkx2_quants(
    nmax: i32,
    x: &[f32],
    weights: &[f32],
    l: &mut [u8],
    laux: &mut [u8],
    s: Search,
) -> (f32, f32) {
    let n = x.len();
    let (mut min, mut max) = (x[0], x[0]);
    let mut sum_w = weights[0];
    let mut sum_x = sum_w * x[0];
    for i in 1..n {
        if x[i] < min {
            min = x[i];
        }
        if x[i] > max {
            max = x[i];
        }
        let w = weights[i];
        sum_w += w;
        sum_x += w * x[i];
    }
    if min > 0.0 {
        min = 0.0;
    }
    if max == min {
        l.fill(0);
        return (0.0, -min);
    }
    let nmax_f = nmax as f32;
    let err = |diff: f32| if s.use_mad { diff.abs() } else { diff * diff };
    let mut iscale = nmax_f / (max - min);
    let mut scale = 1.0 / iscale;
    let mut best_error = 0.0f32;
    for i in 0..n {
        let q = nearest_int(iscale * (x[i] - min)).clamp(0, nmax);
        l[i] = q as u8;
        let diff = scale * q as f32 + min - x[i];
        best_error += weights[i] * err(diff);
    }
    if s.nstep < 1 {
        return (scale, -min);
    }
    for is in 0..=s.nstep {
        iscale = (s.rmin + s.rdelta * is as f32 + nmax_f) / (max - min);
        let (mut sum_l, mut sum_l2, mut sum_xl) = (0.0f32, 0.0f32, 0.0f32);
        for i in 0..n {
            let q = nearest_int(iscale * (x[i] - min)).clamp(0, nmax);
            laux[i] = q as u8;
            let (w, q) = (weights[i], q as f32);
            sum_l += w * q;
            sum_l2 += w * q * q;
            sum_xl += w * q * x[i];
        }
        let det = sum_w * sum_l2 - sum_l * sum_l;
        if det > 0.0 {
            let mut this_scale = (sum_w * sum_xl - sum_x * sum_l) / det;
            let mut this_min = (sum_l2 * sum_x - sum_l * sum_xl) / det;
            if this_min > 0.0 {
                this_min = 0.0;
                this_scale = sum_xl / sum_l2;
            }
            let mut cur_error = 0.0f32;
            for i in 0..n {
                let diff = this_scale * laux[i] as f32 + this_min - x[i];
                cur_error += weights[i] * err(diff);
            }
            if cur_error < best_error {
                l[..n].copy_from_slice(&laux[..n]);
                best_error = cur_error;
                scale = this_scale;
                min = this_min;
            }
        }
    }
    (scale, -min)
}

/// ggml's `make_qx_quants` as Q6_K calls it (`rmse_type` 1, no importance weights): signed
/// quants stored as `l + nmax` in `0..2*nmax`, weights `x²`, and a search over 18 scales near
/// `nmax / max` for the least weighted squared error. Returns the scale.
fn make_qx_quants(nmax: i32, x: &[f32], l: &mut [i8]) -> f32 {
    let (mut max, mut amax) = (0.0f32, 0.0f32);
    for &v in x {
        if v.abs() > amax {
            amax = v.abs();
            max = v;
        }
    }
    if amax < GROUP_MAX_EPS {
        l.fill(0);
        return 0.0;
    }
    let quant = |iscale: f32, v: f32| nearest_int(iscale * v).clamp(-nmax, nmax - 1);
    // Σ w·x·l and Σ w·l² with w = x², in ggml's order.
    let sums = |iscale: f32| {
        let (mut sumlx, mut suml2) = (0.0f32, 0.0f32);
        for &v in x {
            let q = quant(iscale, v) as f32;
            let w = v * v;
            sumlx += w * v * q;
            suml2 += w * q * q;
        }
        (sumlx, suml2)
    };
    let store = |iscale: f32, l: &mut [i8]| {
        for (li, &v) in l.iter_mut().zip(x) {
            *li = (quant(iscale, v) + nmax) as i8;
        }
    };
    let iscale = -(nmax as f32) / max;
    store(iscale, l);
    let (sumlx, suml2) = sums(iscale);
    let mut scale = if suml2 != 0.0 { sumlx / suml2 } else { 0.0 };
    let mut best = scale * sumlx;
    for is in (-9..=9).filter(|&is| is != 0) {
        let iscale = -(nmax as f32 + 0.1 * is as f32) / max;
        let (sumlx, suml2) = sums(iscale);
        if suml2 > 0.0 && sumlx * sumlx > best * suml2 {
            store(iscale, l);
            scale = sumlx / suml2;
            best = scale * sumlx;
        }
    }
    scale
}

/// ggml's `make_q3_quants` with `do_rmse`: signed quants in `-nmax..nmax` from the scale
/// `nmax / max`, then up to five passes moving single quants while that lowers the `x²`-weighted
/// squared error. Quants are stored as `l + nmax`. Returns the scale.
fn make_q3_quants(nmax: i32, x: &[f32], l: &mut [i8]) -> f32 {
    let (mut max, mut amax) = (0.0f32, 0.0f32);
    for &v in x {
        if v.abs() > amax {
            amax = v.abs();
            max = v;
        }
    }
    if amax < GROUP_MAX_EPS {
        l.fill(0);
        return 0.0;
    }
    let iscale = -(nmax as f32) / max;
    let (mut sumlx, mut suml2) = (0.0f32, 0.0f32);
    for (li, &v) in l.iter_mut().zip(x) {
        let q = nearest_int(iscale * v).clamp(-nmax, nmax - 1);
        *li = q as i8;
        let (w, q) = (v * v, q as f32);
        sumlx += w * v * q;
        suml2 += w * q * q;
    }
    for _ in 0..5 {
        let mut n_changed = 0;
        for (li, &v) in l.iter_mut().zip(x) {
            let w = v * v;
            let cur = *li as f32;
            let mut slx = sumlx - w * v * cur;
            if slx > 0.0 {
                let mut sl2 = suml2 - w * cur * cur;
                let new_l = nearest_int(v * sl2 / slx).clamp(-nmax, nmax - 1);
                if new_l != *li as i32 {
                    let q = new_l as f32;
                    slx += w * v * q;
                    sl2 += w * q * q;
                    if sl2 > 0.0 && slx * slx * suml2 > sumlx * sumlx * sl2 {
                        *li = new_l as i8;
                        sumlx = slx;
                        suml2 = sl2;
                        n_changed += 1;
                    }
                }
            }
        }
        if n_changed == 0 {
            break;
        }
    }
    for li in l.iter_mut() {
        *li += nmax as i8;
    }
    if suml2 > 0.0 { sumlx / suml2 } else { 0.0 }
}

/// Packs 2-bit values (already reduced to `0..4`) of 256 quants into 64 bytes, ggml's layout for
/// Q2_K and the low bits of Q3_K: byte `l` of each 128-half holds quants `l`, `l+32`, `l+64`,
/// `l+96` at shifts 0, 2, 4, 6.
fn pack_2bit(l: &[u8; QK_K], qs: &mut [u8; 64]) {
    for half in 0..2 {
        let l = &l[128 * half..128 * half + 128];
        for i in 0..32 {
            qs[32 * half + i] = l[i] | (l[i + 32] << 2) | (l[i + 64] << 4) | (l[i + 96] << 6);
        }
    }
}

/// ggml's `quantize_row_q2_K_ref`: 16 groups of 16, each fitted as `scale * l - min` with
/// `l` in `0..=3` (absolute-error search), the scales and mins then quantized to 4 bits against
/// their maxima, and the quants recomputed from the stored scales.
pub fn quantize_q2_k(src: &[f32], dst: &mut [u8]) {
    const SEARCH: Search = Search {
        rmin: -0.5,
        rdelta: 0.1,
        nstep: 15,
        use_mad: true,
    };
    // The 4-bit grid the group scales and mins are quantized to.
    const Q4SCALE: f32 = 15.0;
    let dst: &mut [BlockQ2K] = bytemuck::cast_slice_mut(dst);
    for (x, y) in src.chunks_exact(QK_K).zip(dst) {
        let mut l = [0u8; QK_K];
        let mut laux = [0u8; 16];
        let mut weights = [0f32; 16];
        let (mut scales, mut mins) = ([0f32; 16], [0f32; 16]);
        let (mut max_scale, mut max_min) = (0.0f32, 0.0f32);
        for j in 0..16 {
            let xg = &x[16 * j..16 * j + 16];
            for (w, v) in weights.iter_mut().zip(xg) {
                *w = v.abs();
            }
            let lg = &mut l[16 * j..16 * j + 16];
            (scales[j], mins[j]) = make_qkx2_quants(3, xg, &weights, lg, &mut laux, SEARCH);
            if scales[j] > max_scale {
                max_scale = scales[j];
            }
            if mins[j] > max_min {
                max_min = mins[j];
            }
        }
        if max_scale > 0.0 {
            let iscale = Q4SCALE / max_scale;
            for (sc, &s) in y.scales.iter_mut().zip(&scales) {
                *sc = nearest_int(iscale * s) as u8;
            }
            y.d = f16_to_bytes(max_scale / Q4SCALE);
        } else {
            y.scales = [0; 16];
            y.d = f16_to_bytes(0.0);
        }
        if max_min > 0.0 {
            let iscale = Q4SCALE / max_min;
            for (sc, &m) in y.scales.iter_mut().zip(&mins) {
                *sc |= (nearest_int(iscale * m) << 4) as u8;
            }
            y.dmin = f16_to_bytes(max_min / Q4SCALE);
        } else {
            y.dmin = f16_to_bytes(0.0);
        }
        let (d_all, dmin_all) = (f16_bytes(y.d), f16_bytes(y.dmin));
        for j in 0..16 {
            let d = d_all * (y.scales[j] & 0xF) as f32;
            if d == 0.0 {
                continue;
            }
            let dm = dmin_all * (y.scales[j] >> 4) as f32;
            for i in 16 * j..16 * j + 16 {
                l[i] = nearest_int((x[i] + dm) / d).clamp(0, 3) as u8;
            }
        }
        pack_2bit(&l, &mut y.qs);
    }
}

/// ggml's `quantize_row_q3_K_ref`: 16 groups of 16 signed quants in `-4..4` (`make_q3_quants`),
/// 6-bit signed group scales relative to the scale of largest magnitude, quants recomputed from
/// the stored scales, high bits in `hmask`.
pub fn quantize_q3_k(src: &[f32], dst: &mut [u8]) {
    let dst: &mut [BlockQ3K] = bytemuck::cast_slice_mut(dst);
    for (x, y) in src.chunks_exact(QK_K).zip(dst) {
        let mut l = [0i8; QK_K];
        let mut scales = [0f32; 16];
        let (mut max_scale, mut amax) = (0.0f32, 0.0f32);
        for j in 0..16 {
            scales[j] = make_q3_quants(4, &x[16 * j..16 * j + 16], &mut l[16 * j..16 * j + 16]);
            if scales[j].abs() > amax {
                amax = scales[j].abs();
                max_scale = scales[j];
            }
        }
        y.scales = [0; 12];
        if max_scale != 0.0 {
            let iscale = -32.0 / max_scale;
            for (j, &s) in scales.iter().enumerate() {
                // ggml stores nearest_int into an int8_t before clamping.
                let q = ((nearest_int(iscale * s) as i8).clamp(-32, 31) + 32) as u8;
                if j < 8 {
                    y.scales[j] = q & 0xF;
                } else {
                    y.scales[j - 8] |= (q & 0xF) << 4;
                }
                y.scales[j % 4 + 8] |= (q >> 4) << (2 * (j / 4));
            }
            y.d = f16_to_bytes(1.0 / iscale);
        } else {
            y.d = f16_to_bytes(0.0);
        }
        let d_all = f16_bytes(y.d);
        for j in 0..16 {
            let lo = if j < 8 {
                y.scales[j] & 0xF
            } else {
                y.scales[j - 8] >> 4
            };
            let hi = (y.scales[8 + j % 4] >> (2 * (j / 4))) & 3;
            let sc = (lo | (hi << 4)) as i32 - 32;
            let d = d_all * sc as f32;
            if d == 0.0 {
                continue;
            }
            for i in 16 * j..16 * j + 16 {
                l[i] = (nearest_int(x[i] / d).clamp(-4, 3) + 4) as i8;
            }
        }
        // High bit of quant i goes to bit i/32 of hmask[i%32]; the rest keeps its low two bits.
        let mut low = [0u8; QK_K];
        y.hmask = [0; 32];
        for (i, (&q, lo)) in l.iter().zip(&mut low).enumerate() {
            let q = q as u8;
            if q > 3 {
                y.hmask[i % 32] |= 1 << (i / 32);
            }
            *lo = q & 3;
        }
        pack_2bit(&low, &mut y.qs);
    }
}

/// What Q4_K and Q5_K share: per group of 32, an asymmetric fit with weights `rms + |x|`,
/// 6-bit scales and mins packed as `get_scale_min_k4` reads them, then quants in `0..=nmax`
/// recomputed from the stored values. Returns the quants; fills `d`, `dmin` and `scales`.
fn quantize_k4_groups(
    x: &[f32],
    nmax: i32,
    search: Search,
    d: &mut [u8; 2],
    dmin: &mut [u8; 2],
    packed: &mut [u8; 12],
) -> [u8; QK_K] {
    let mut l = [0u8; QK_K];
    let mut laux = [0u8; 32];
    let mut weights = [0f32; 32];
    let (mut scales, mut mins) = ([0f32; 8], [0f32; 8]);
    let (mut max_scale, mut max_min) = (0.0f32, 0.0f32);
    for j in 0..8 {
        let xg = &x[32 * j..32 * j + 32];
        let mut sum_x2 = 0.0f32;
        for &v in xg {
            sum_x2 += v * v;
        }
        let av_x = (sum_x2 / 32.0).sqrt();
        for (w, v) in weights.iter_mut().zip(xg) {
            *w = av_x + v.abs();
        }
        let lg = &mut l[32 * j..32 * j + 32];
        (scales[j], mins[j]) = make_qkx2_quants(nmax, xg, &weights, lg, &mut laux, search);
        if scales[j] > max_scale {
            max_scale = scales[j];
        }
        if mins[j] > max_min {
            max_min = mins[j];
        }
    }
    // 63: the largest 6-bit value.
    let inv_scale = if max_scale > 0.0 {
        63.0 / max_scale
    } else {
        0.0
    };
    let inv_min = if max_min > 0.0 { 63.0 / max_min } else { 0.0 };
    for j in 0..8 {
        // ggml stores nearest_int into a uint8_t before clamping.
        let ls = (nearest_int(inv_scale * scales[j]) as u8).min(63);
        let lm = (nearest_int(inv_min * mins[j]) as u8).min(63);
        if j < 4 {
            packed[j] = ls;
            packed[j + 4] = lm;
        } else {
            packed[j + 4] = (ls & 0xF) | ((lm & 0xF) << 4);
            packed[j - 4] |= (ls >> 4) << 6;
            packed[j] |= (lm >> 4) << 6;
        }
    }
    *d = f16_to_bytes(max_scale / 63.0);
    *dmin = f16_to_bytes(max_min / 63.0);
    let (d_all, dmin_all) = (f16_bytes(*d), f16_bytes(*dmin));
    for j in 0..8 {
        let (sc, m) = scale_min_k4(j, packed);
        let d = d_all * sc as f32;
        if d == 0.0 {
            continue;
        }
        let dm = dmin_all * m as f32;
        for i in 32 * j..32 * j + 32 {
            l[i] = nearest_int((x[i] + dm) / d).clamp(0, nmax) as u8;
        }
    }
    l
}

/// ggml's `quantize_row_q4_K_ref`: 8 groups of 32 quants in `0..16` with 6-bit scales and mins.
pub fn quantize_q4_k(src: &[f32], dst: &mut [u8]) {
    const SEARCH: Search = Search {
        rmin: -1.0,
        rdelta: 0.1,
        nstep: 20,
        use_mad: false,
    };
    let dst: &mut [BlockQ4K] = bytemuck::cast_slice_mut(dst);
    for (x, y) in src.chunks_exact(QK_K).zip(dst) {
        y.scales = [0; 12];
        let l = quantize_k4_groups(x, 15, SEARCH, &mut y.d, &mut y.dmin, &mut y.scales);
        // Each 64 quants fill 32 bytes: the first 32 in low nibbles, the next 32 in high ones.
        for g in 0..4 {
            for i in 0..32 {
                y.qs[32 * g + i] = l[64 * g + i] | (l[64 * g + i + 32] << 4);
            }
        }
    }
}

/// ggml's `quantize_row_q5_K_ref`: as Q4_K with quants in `0..32`, fifth bits in `qh`.
pub fn quantize_q5_k(src: &[f32], dst: &mut [u8]) {
    const SEARCH: Search = Search {
        rmin: -0.5,
        rdelta: 0.1,
        nstep: 15,
        use_mad: false,
    };
    let dst: &mut [BlockQ5K] = bytemuck::cast_slice_mut(dst);
    for (x, y) in src.chunks_exact(QK_K).zip(dst) {
        y.scales = [0; 12];
        let l = quantize_k4_groups(x, 31, SEARCH, &mut y.d, &mut y.dmin, &mut y.scales);
        y.qh = [0; 32];
        for g in 0..4 {
            let (m1, m2) = (1u8 << (2 * g), 2u8 << (2 * g));
            for i in 0..32 {
                let (l1, l2) = (l[64 * g + i], l[64 * g + i + 32]);
                if l1 > 15 {
                    y.qh[i] |= m1;
                }
                if l2 > 15 {
                    y.qh[i] |= m2;
                }
                y.qs[32 * g + i] = (l1 & 0xF) | ((l2 & 0xF) << 4);
            }
        }
    }
}

/// ggml's `quantize_row_q6_K_ref`: 16 groups of 16 signed quants in `-32..32`
/// (`make_qx_quants`), 8-bit signed group scales, quants recomputed from the stored scales.
pub fn quantize_q6_k(src: &[f32], dst: &mut [u8]) {
    let dst: &mut [BlockQ6K] = bytemuck::cast_slice_mut(dst);
    for (x, y) in src.chunks_exact(QK_K).zip(dst) {
        let mut l = [0i8; QK_K];
        let mut scales = [0f32; 16];
        let (mut max_scale, mut max_abs_scale) = (0.0f32, 0.0f32);
        for j in 0..16 {
            scales[j] = make_qx_quants(32, &x[16 * j..16 * j + 16], &mut l[16 * j..16 * j + 16]);
            if scales[j].abs() > max_abs_scale {
                max_abs_scale = scales[j].abs();
                max_scale = scales[j];
            }
        }
        if max_abs_scale < GROUP_MAX_EPS {
            *y = bytemuck::Zeroable::zeroed();
            continue;
        }
        let iscale = -128.0 / max_scale;
        y.d = f16_to_bytes(1.0 / iscale);
        for (sc, &s) in y.scales.iter_mut().zip(&scales) {
            *sc = nearest_int(iscale * s).min(127) as i8;
        }
        let d_all = f16_bytes(y.d);
        for j in 0..16 {
            let d = d_all * y.scales[j] as f32;
            if d == 0.0 {
                continue;
            }
            for i in 16 * j..16 * j + 16 {
                l[i] = (nearest_int(x[i] / d).clamp(-32, 31) + 32) as i8;
            }
        }
        // Per 128-half: low nibbles of quants l and l+64 share ql[l], of l+32 and l+96 share
        // ql[l+32]; the four high bit pairs of l, l+32, l+64, l+96 go to qh[l].
        for half in 0..2 {
            let l = &l[128 * half..128 * half + 128];
            let ql = &mut y.ql[64 * half..64 * half + 64];
            let qh = &mut y.qh[32 * half..32 * half + 32];
            for i in 0..32 {
                let q = [l[i], l[i + 32], l[i + 64], l[i + 96]].map(|v| v as u8);
                ql[i] = (q[0] & 0xF) | ((q[2] & 0xF) << 4);
                ql[i + 32] = (q[1] & 0xF) | ((q[3] & 0xF) << 4);
                qh[i] = (q[0] >> 4) | ((q[1] >> 4) << 2) | ((q[2] >> 4) << 4) | ((q[3] >> 4) << 6);
            }
        }
    }
}
