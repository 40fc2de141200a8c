//! The AMX panels against the level's dots and the scalar reference, bit for bit: on an emulated
//! tile unit everywhere with AVX-512, on the CPU's where it has AMX.

use super::formats::{Q4K, Q6K, TileFormat};
use super::panel::panel_on;
use super::unit::{Emulated, Hardware, TileUnit};
use crate::blocks::QK_K;
use crate::formats::kquants::{dot_q4_k, dot_q6_k};
use crate::panel::{Panel, PanelFn};
use crate::{ActKind, DotFn, Isa};

/// Random rows of `F`: raw random bytes (every scale, min and quant value) with small finite
/// f16 scales at `d_at` (and the byte after it: `dmin` for Q4_K).
fn weights(seed: u64, rows: usize, k: usize, block: usize, d_at: &[usize]) -> Vec<u8> {
    let mut s = seed | 1;
    let mut next = || {
        s ^= s << 13;
        s ^= s >> 7;
        s ^= s << 17;
        s
    };
    let mut w: Vec<u8> = (0..rows * k / QK_K * block).map(|_| next() as u8).collect();
    for blk in w.chunks_exact_mut(block) {
        for &at in d_at {
            let d = half::f16::from_f32((next() % 1000) as f32 * 1e-5);
            blk[at..at + 2].copy_from_slice(&d.to_le_bytes());
        }
    }
    w
}

fn activations(n: usize, k: usize) -> Vec<u8> {
    let rb = ActKind::Q8K.row_bytes(k);
    let mut out = vec![0u8; n * rb];
    for t in 0..n {
        let x: Vec<f32> = (0..k)
            .map(|i| {
                let v = ((i * 37 + t * 101) % 255) as f32 - 127.0;
                if i % 97 == t % 97 { 30.0 * v } else { v }
            })
            .collect();
        ActKind::Q8K.quantize_row(&x, &mut out[t * rb..(t + 1) * rb]);
    }
    out
}

/// Runs the panel of `F` over `unit` for (rows, n, k) and checks every value against the
/// level's dot and the scalar reference, bit for bit.
fn check<F: TileFormat, U: TileUnit>(
    unit: &mut U,
    (rows, n, k): (usize, usize, usize),
    d_at: &[usize],
    (small, dot, reference): (PanelFn, DotFn, DotFn),
) {
    let block = size_of::<F::Block>();
    let (wb, ab) = (k / QK_K * block, ActKind::Q8K.row_bytes(k));
    let w = weights((rows * 31 + n * 7 + k) as u64, rows, k, block, d_at);
    let a = activations(n, k);
    let stride = rows + 2;
    let mut out = vec![f32::NAN; n * stride];
    let p = Panel {
        k,
        w: w.as_ptr(),
        w_stride: wb,
        rows,
        a: a.as_ptr(),
        a_stride: ab,
        n,
        out: out.as_mut_ptr(),
        out_stride: stride,
    };
    // SAFETY: the panel covers exactly `w`, `a` and `out` (sizes above); the CPU has
    // AVX-512 (checked by the callers) and the unit runs here.
    unsafe { panel_on::<F, U>(unit, &p, small) };
    for t in 0..n {
        for r in 0..rows {
            let (wr, ar) = (&w[r * wb..(r + 1) * wb], &a[t * ab..(t + 1) * ab]);
            let got = out[t * stride + r];
            let want = dot(k, wr, ar);
            assert_eq!(
                got.to_bits(),
                want.to_bits(),
                "rows {rows} n {n} k {k}: ({r}, {t}) {got} vs {want}"
            );
            let reference = reference(k, wr, ar);
            assert_eq!(
                want.to_bits(),
                reference.to_bits(),
                "dot {want} vs reference {reference}"
            );
        }
        for r in rows..stride {
            assert!(out[t * stride + r].is_nan(), "wrote outside the panel");
        }
    }
}

/// Whole tiles, partial row blocks and token tiles, a panel below `MIN_TOKENS`, long rows.
const SHAPES: [(usize, usize, usize); 7] = [
    (16, 16, 256),
    (35, 37, 1024),
    (16, 48, 2048),
    (33, 16, 512),
    (7, 40, 256),
    (20, 5, 768),
    (18, 2, 256),
];

fn check_all<U: TileUnit>(unit: &mut U) {
    for shape in SHAPES {
        use crate::x86::avx512 as level;
        let q4k = (
            level::panel_q4_k_exact as PanelFn,
            level::dot_q4_k_exact as DotFn,
            dot_q4_k as DotFn,
        );
        check::<Q4K, U>(unit, shape, &[0, 2], q4k);
        let q6k = (
            level::panel_q6_k as PanelFn,
            level::dot_q6_k as DotFn,
            dot_q6_k as DotFn,
        );
        check::<Q6K, U>(unit, shape, &[208], q6k);
    }
}

#[test]
fn emulated_tiles_give_the_reference_bits() {
    if !Isa::Avx512.is_supported() {
        eprintln!("skipped: the AMX panels' vector steps need AVX-512");
        return;
    }
    check_all(&mut Emulated::default());
}

#[test]
fn hardware_tiles_give_the_reference_bits() {
    if !Isa::Amx.is_supported() {
        eprintln!("skipped (no AMX, or the OS did not grant the tile state)");
        return;
    }
    check_all(&mut Hardware);
    eprintln!("AMX tiles checked on this CPU");
}
