//! Panel kernels (multi-row decode, register-tiled GEMM) against the single-row dot of the same
//! format and ISA: every value must be the same bits, whatever the tile shape, the number of rows
//! and tokens, or the position of a row or token in the panel. Also the extreme quants of
//! `simd_edge_cases.rs` (saturation, lost signs) through the panels.

mod common;

use common::{COMPUTE_TYPES, Rng, random_row};
use gguf::GgmlType;
use kernels::panel::run_checked;
use kernels::{Isa, RowKernel, format, row_kernel, simd_dot, simd_panel};

fn activations(rng: &mut Rng, t: GgmlType, k: usize, n: usize) -> Vec<u8> {
    let act = format(t).unwrap().act;
    let rb = act.row_bytes(k);
    let mut out = vec![0u8; n * rb];
    for i in 0..n {
        let mut x = rng.normals(k);
        x[(7 * i) % k] *= 25.0;
        act.quantize_row(&x, &mut out[i * rb..(i + 1) * rb]);
    }
    out
}

/// Every (row, token) of a panel call equals the single-row dot, bitwise.
fn check(isa: Isa, t: GgmlType, k: usize, rows: usize, n: usize, w: &[u8], a: &[u8]) {
    let panel = simd_panel(isa, t).expect("panel");
    let dot = simd_dot(isa, t).expect("dot");
    let wb = t.row_bytes(k as u64).unwrap() as usize;
    let ab = format(t).unwrap().act.row_bytes(k);
    // An output stride larger than `rows` checks that nothing is written outside the tile.
    let stride = rows + 3;
    let mut out = vec![f32::NAN; n * stride];
    run_checked(
        RowKernel::Panel(panel),
        t,
        k,
        w,
        wb,
        rows,
        a,
        n,
        &mut out,
        stride,
    );
    for tok in 0..n {
        for r in 0..rows {
            let want = dot(k, &w[r * wb..(r + 1) * wb], &a[tok * ab..(tok + 1) * ab]);
            let got = out[tok * stride + r];
            assert_eq!(
                got.to_bits(),
                want.to_bits(),
                "{isa:?} {t} k={k} rows={rows} n={n}: row {r} token {tok}: panel {got} vs dot {want}"
            );
        }
        for r in rows..stride {
            assert!(
                out[tok * stride + r].is_nan(),
                "{isa:?} {t}: wrote outside the panel"
            );
        }
    }
}

fn panel_types(isa: Isa) -> Vec<GgmlType> {
    COMPUTE_TYPES
        .into_iter()
        .filter(|&t| simd_panel(isa, t).is_some())
        .collect()
}

#[test]
fn panels_equal_the_single_row_dot_bitwise() {
    let mut rng = Rng::new(11);
    let mut checked = 0;
    for isa in Isa::supported() {
        for t in panel_types(isa) {
            // 96, 1440 and 2880 (gpt-oss) leave partial groups and odd block pairs (MXFP4);
            // 96 and 128 (latent attention's per-head rows) run four rows at a time in decode.
            for k in [256usize, 512, 1280, 2048, 96, 128, 1440, 2880] {
                if !k.is_multiple_of(t.block_size()) {
                    continue;
                }
                let wb = t.row_bytes(k as u64).unwrap() as usize;
                for rows in [1, 2, 3, 4, 5, 7, 8, 9] {
                    let w: Vec<u8> = (0..rows).flat_map(|_| random_row(&mut rng, t, k)).collect();
                    assert_eq!(w.len(), rows * wb);
                    for n in [1, 2, 3, 4, 5, 8, 9, 17] {
                        let a = activations(&mut rng, t, k, n);
                        check(isa, t, k, rows, n, &w, &a);
                    }
                }
            }
            checked += 1;
        }
    }
    eprintln!("checked {checked} panel kernels");
}

/// Panels that pack blocks of rows for large batches (the AMX tiles, the AVX-512 Q6_K row
/// lanes): several blocks, partial ones, and token counts around their thresholds.
#[test]
fn panels_of_many_rows_and_tokens_equal_the_single_row_dot() {
    let mut rng = Rng::new(29);
    for isa in Isa::supported() {
        for t in panel_types(isa) {
            for k in [256usize, 768] {
                if !k.is_multiple_of(t.block_size()) {
                    continue;
                }
                for rows in [16, 33] {
                    let w: Vec<u8> = (0..rows).flat_map(|_| random_row(&mut rng, t, k)).collect();
                    for n in [15, 16, 23, 40] {
                        let a = activations(&mut rng, t, k, n);
                        check(isa, t, k, rows, n, &w, &a);
                    }
                }
            }
        }
    }
}

/// Quant bytes at their extremes against activations at ±127: no i16 saturation, no lost sign.
#[test]
fn panels_survive_extreme_quants() {
    let mut rng = Rng::new(12);
    for isa in Isa::supported() {
        for t in panel_types(isa) {
            let k = 512;
            let act = format(t).unwrap().act;
            for fill in [0x00u8, 0xFF, 0x80, 0x7F, 0x55, 0xAA] {
                let mut w = Vec::new();
                for _ in 0..5 {
                    let mut row = random_row(&mut rng, t, k);
                    fill_quants(t, &mut row, fill);
                    w.extend(row);
                }
                // 3 tokens for the register tiles, 17 for the panels that pack rows for
                // batches (the AMX tiles, the row lanes of Q4_K and Q6_K).
                for (sign, n) in [(1.0f32, 3), (-1.0, 3), (1.0, 17), (-1.0, 17)] {
                    let x: Vec<f32> = (0..n * k)
                        .map(|i| {
                            if i % 3 == 0 {
                                sign
                            } else {
                                sign * ((i % 7) as f32 - 3.0) / 3.0
                            }
                        })
                        .collect();
                    let rb = act.row_bytes(k);
                    let mut a = vec![0u8; n * rb];
                    for i in 0..n {
                        act.quantize_row(&x[i * k..(i + 1) * k], &mut a[i * rb..(i + 1) * rb]);
                    }
                    check(isa, t, k, 5, n, &w, &a);
                }
            }
        }
    }
}

/// Overwrites the packed quants of every block (not the scale fields) with `fill`.
fn fill_quants(t: GgmlType, row: &mut [u8], fill: u8) {
    use GgmlType as T;
    // (start, end) of the bytes that are not f16 scales.
    let (start, end) = match t {
        T::Q4_0 => (2, 18),
        T::Q4_1 => (4, 20),
        T::Q5_0 => (2, 22),
        T::Q5_1 => (4, 24),
        T::Q8_0 => (2, 34),
        T::Mxfp4 => (1, 17),
        T::Q2K => (0, 80),
        T::Q3K => (0, 108),
        T::Q4K => (4, 144),
        T::Q5K => (4, 176),
        T::Q6K => (0, 192),
        T::Q8K => (4, 260),
        T::Iq1M => (0, 48),
        T::Tq1_0 => (0, 52),
        T::Tq2_0 => (0, 64),
        t if t.block_size() > 1 => (2, t.type_size()),
        _ => (0, 0),
    };
    for block in row.chunks_exact_mut(t.type_size()) {
        block[start..end].fill(fill);
    }
}

/// The kernel a matmul uses is a panel exactly where the dot it must agree with has one.
#[test]
fn row_kernel_picks_the_panel_of_the_dots_level() {
    for isa in Isa::supported() {
        for t in COMPUTE_TYPES {
            let k = row_kernel(isa, t).expect("every compute type has a kernel");
            // The level whose dot `row_kernel` uses: the highest one at or below `isa` with a
            // dot for `t` (the AMX level adds only Q4_K's).
            let level = Isa::ALL
                .into_iter()
                .rev()
                .filter(|&i| i <= isa)
                .find(|&i| simd_dot(i, t).is_some())
                .expect("scalar has every dot");
            match (k, simd_panel(level, t)) {
                (RowKernel::Panel(_), Some(_)) | (RowKernel::Dot(_), None) => {}
                _ => panic!("{isa:?} {t}: row kernel disagrees with the panel table"),
            }
        }
    }
}

/// No weight format prefills through per-row dots at either x86 level (Q8_K is the K-quants'
/// activation format; files do not ship it as weights).
#[test]
fn every_weight_format_has_an_x86_panel() {
    for isa in [Isa::Avx2, Isa::Avx512] {
        if !isa.is_supported() {
            eprintln!("skipped {isa:?}: this CPU lacks it");
            continue;
        }
        let missing: Vec<GgmlType> = COMPUTE_TYPES
            .into_iter()
            .filter(|&t| t != GgmlType::Q8K && simd_panel(isa, t).is_none())
            .collect();
        assert!(missing.is_empty(), "no {isa:?} panel for {missing:?}");
    }
}

/// Every chunk-dots kernel gives each chunk the bits of the single-row dot on that chunk: chunks
/// of one to three superblocks, counts on both sides of the eight-chunk reductions; for the
/// 32-element formats also chunks of 3 and 6 blocks (SmolLM2's 192-column GQA-group chunks).
#[test]
fn chunk_dots_are_the_dots_of_each_chunk() {
    let mut rng = Rng::new(31);
    for isa in Isa::supported() {
        for t in COMPUTE_TYPES {
            let Some(kernel) = kernels::isa::chunk_dots(isa, t) else {
                continue;
            };
            let dot = kernels::best_dot(isa, t).expect("a dot");
            let sizes = [256usize, 512, 768, 96, 192];
            for k in sizes
                .into_iter()
                .filter(|k| k.is_multiple_of(t.block_size()))
            {
                for chunks in [1usize, 7, 8, 9, 17] {
                    let w = random_row(&mut rng, t, k * chunks);
                    let a = activations(&mut rng, t, k * chunks, 1);
                    let (wb, ab) = (w.len() / chunks, a.len() / chunks);
                    let mut out = vec![f32::NAN; chunks];
                    let cd = kernels::panel::ChunkDots {
                        k,
                        chunks,
                        w: w.as_ptr(),
                        w_bytes: wb,
                        a: a.as_ptr(),
                        a_bytes: ab,
                        out: out.as_mut_ptr(),
                    };
                    // SAFETY: the kernel comes from `kernels::isa` for a supported level; the
                    // row and activations hold `chunks` contiguous chunks and `out` as many
                    // values.
                    unsafe { kernel(&cd) };
                    for (i, &got) in out.iter().enumerate() {
                        let want = dot(k, &w[i * wb..(i + 1) * wb], &a[i * ab..(i + 1) * ab]);
                        assert_eq!(
                            got.to_bits(),
                            want.to_bits(),
                            "{isa:?} {t} {k}×{chunks}, chunk {i}"
                        );
                    }
                }
            }
        }
    }
}

/// Every chunk-rows kernel gives each (row, chunk) the bits of the single-row dot on that chunk
/// of that row: row counts around its four-row steps, rows further apart than their bytes,
/// chunks of whole and partial eight-block groups.
#[test]
fn chunk_rows_are_the_dots_of_each_chunk_of_each_row() {
    let mut rng = Rng::new(41);
    let mut checked = 0;
    for isa in Isa::supported() {
        for t in COMPUTE_TYPES {
            let Some(kernel) = kernels::isa::chunk_rows(isa, t) else {
                continue;
            };
            let dot = kernels::best_dot(isa, t).expect("a dot");
            for k in [256usize, 96, 192] {
                for (rows, chunks) in [(1usize, 1usize), (3, 2), (4, 3), (5, 1), (9, 7)] {
                    let wb = t.row_bytes((k * chunks) as u64).unwrap() as usize;
                    let stride = wb + 40;
                    let mut w = vec![0u8; rows * stride];
                    for r in 0..rows {
                        w[r * stride..r * stride + wb].copy_from_slice(&random_row(
                            &mut rng,
                            t,
                            k * chunks,
                        ));
                    }
                    let a = activations(&mut rng, t, k * chunks, 1);
                    let (cb, ab) = (wb / chunks, a.len() / chunks);
                    let mut out = vec![f32::NAN; rows * chunks];
                    let cd = kernels::panel::ChunkDots {
                        k,
                        chunks,
                        w: w.as_ptr(),
                        w_bytes: cb,
                        a: a.as_ptr(),
                        a_bytes: ab,
                        out: out.as_mut_ptr(),
                    };
                    // SAFETY: the kernel comes from `kernels::isa` for a supported level; each
                    // of the `rows` rows, `stride` bytes apart, holds `chunks` contiguous chunks,
                    // as the activations do, and `out` holds rows · chunks values.
                    unsafe { kernel(&cd, rows, stride) };
                    for r in 0..rows {
                        for c in 0..chunks {
                            let at = r * stride + c * cb;
                            let want = dot(k, &w[at..at + cb], &a[c * ab..(c + 1) * ab]);
                            let got = out[r * chunks + c];
                            assert_eq!(
                                got.to_bits(),
                                want.to_bits(),
                                "{isa:?} {t} k={k} rows={rows} chunks={chunks}: row {r} chunk {c}"
                            );
                        }
                    }
                }
            }
            checked += 1;
        }
    }
    eprintln!("checked {checked} chunk-rows kernels");
}

/// A chunk panel's value for each (row, token) is the f64 sum, in chunk order, of the dot of
/// each chunk, bit for bit: whole chunks of one or two superblocks and a shorter last chunk,
/// token counts around the eight-token tiles, outputs outside the panel untouched.
#[test]
fn chunk_panels_are_the_f64_sums_of_each_chunks_dot() {
    let mut rng = Rng::new(37);
    let mut checked = 0;
    for isa in Isa::supported() {
        for t in COMPUTE_TYPES {
            let Some(kernel) = kernels::isa::chunk_panel(isa, t) else {
                continue;
            };
            let dot = kernels::best_dot(isa, t).expect("a dot");
            let act = format(t).unwrap().act;
            for (per_chunk, chunks, tail) in [(1, 1, 0), (1, 5, 0), (2, 3, 0), (2, 3, 1), (1, 0, 1)]
            {
                let (k, tail_k) = (per_chunk * 256, tail * 256);
                let cols = chunks * k + tail_k;
                for (rows, n) in [(1, 1), (3, 7), (2, 8), (5, 9), (2, 17), (19, 25)] {
                    let wb = t.row_bytes(cols as u64).unwrap() as usize;
                    let w: Vec<u8> = (0..rows)
                        .flat_map(|_| random_row(&mut rng, t, cols))
                        .collect();
                    let a = activations(&mut rng, t, cols, n);
                    let ab = act.row_bytes(cols);
                    let (w_chunk, a_chunk) =
                        (t.row_bytes(k as u64).unwrap() as usize, act.row_bytes(k));
                    let stride = rows + 2;
                    let mut out = vec![f64::NAN; n * stride];
                    let cp = kernels::panel::ChunkPanel {
                        k,
                        chunks,
                        tail_k,
                        w: w.as_ptr(),
                        w_stride: wb,
                        w_chunk,
                        rows,
                        a: a.as_ptr(),
                        a_stride: ab,
                        a_chunk,
                        n,
                        out: out.as_mut_ptr(),
                        out_stride: stride,
                    };
                    // SAFETY: the kernel comes from `kernels::isa` for a supported level; `w`
                    // holds `rows` rows and `a` `n` tokens of `cols` columns (whole chunks and
                    // the tail, contiguous), and `out` n × stride values with stride > rows.
                    unsafe { kernel(&cp) };
                    for tok in 0..n {
                        for r in 0..rows {
                            let (wr, ar) = (&w[r * wb..(r + 1) * wb], &a[tok * ab..(tok + 1) * ab]);
                            let mut want = 0f64;
                            for c in 0..chunks {
                                let (wc, ac) = (
                                    &wr[c * w_chunk..(c + 1) * w_chunk],
                                    &ar[c * a_chunk..(c + 1) * a_chunk],
                                );
                                want += dot(k, wc, ac) as f64;
                            }
                            if tail_k > 0 {
                                want +=
                                    dot(tail_k, &wr[chunks * w_chunk..], &ar[chunks * a_chunk..])
                                        as f64;
                            }
                            let got = out[tok * stride + r];
                            assert_eq!(
                                got.to_bits(),
                                want.to_bits(),
                                "{isa:?} {t} {per_chunk}×{chunks}+{tail} rows={rows} n={n}: row {r} token {tok}"
                            );
                        }
                        assert!(
                            out[tok * stride + rows..(tok + 1) * stride]
                                .iter()
                                .all(|v| v.is_nan()),
                            "{isa:?} {t}: wrote outside the panel"
                        );
                    }
                    checked += 1;
                }
            }
        }
    }
    let has_chunk_panels = Isa::supported()
        .iter()
        .any(|&i| kernels::isa::chunk_panel(i, GgmlType::Q4K).is_some());
    assert!(!has_chunk_panels || checked > 0);
}
