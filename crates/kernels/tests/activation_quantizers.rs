//! The activation quantizers every matmul input passes through (Q8_K and Q8_0 blocks) give the
//! bits of their scalar references on whatever SIMD path this CPU takes: random rows at many
//! scales, and the cases a vector form can get wrong — ties for the largest magnitude with
//! either sign first, products that land on .5, zeros, NaNs, infinities, subnormals.

mod common;

use common::Rng;
use kernels::formats::{kquants, legacy};

type Quantizer = fn(&[f32], &mut [u8]);

/// (name, quantizer, its scalar reference, block length, block bytes)
const QUANTIZERS: [(&str, Quantizer, Quantizer, usize, usize); 2] = [
    (
        "q8_K",
        kquants::quantize_q8_k,
        kquants::quantize_q8_k_reference,
        256,
        292,
    ),
    (
        "q8_0",
        legacy::quantize_q8_0_activations,
        legacy::quantize_q8_0_activations_reference,
        32,
        34,
    ),
];

/// One block's worth of edge patterns, cycled to the block length.
fn edge_rows(block: usize) -> Vec<(String, Vec<f32>)> {
    let mut rows = Vec::new();
    let mut add = |name: &str, f: &dyn Fn(usize) -> f32| {
        rows.push((name.to_string(), (0..block).map(f).collect::<Vec<f32>>()));
    };
    add("zeros", &|_| 0.0);
    add("negative zeros", &|_| -0.0);
    add("largest magnitude positive first", &|i| match i {
        3 => 2.0,
        9 => -2.0,
        _ => (i as f32 * 0.37).sin(),
    });
    add("largest magnitude negative first", &|i| match i {
        3 => -2.0,
        9 => 2.0,
        _ => (i as f32 * 0.37).sin(),
    });
    add("largest magnitude last", &|i| {
        if i == block - 1 {
            -5.0
        } else {
            (i as f32 * 0.11).cos()
        }
    });
    // The scale maps 127 to ±127 exactly, so these land on halves: ties to even.
    add("halves", &|i| {
        if i == 0 {
            127.0
        } else {
            (i % 254) as f32 - 126.5
        }
    });
    add("a NaN", &|i| if i == 5 { f32::NAN } else { i as f32 - 7.0 });
    add("all NaN", &|_| f32::NAN);
    add("NaN payloads", &|i| match i % 3 {
        0 => f32::from_bits(0x7fc1_2345),
        1 => f32::from_bits(0xffa0_00ff),
        _ => i as f32,
    });
    add("an infinity", &|i| {
        if i == 2 { f32::NEG_INFINITY } else { i as f32 }
    });
    add("subnormals", &|i| (i as f32 + 1.0) * 1e-40);
    add("huge", &|i| (i as f32 - 3.0) * 1e37);
    add("one nonzero", &|i| if i == block / 2 { -1e-3 } else { 0.0 });
    rows
}

#[test]
fn simd_activation_quantizers_give_the_scalar_bits() {
    let mut rng = Rng::new(41);
    for (name, quantize, reference, block, block_bytes) in QUANTIZERS {
        let mut rows = edge_rows(block);
        let n_edges = rows.len();
        for (i, scale) in [1e-6f32, 1e-2, 1.0, 3.0, 1e3, 1e6].into_iter().enumerate() {
            let n = block * (1 + i % 3) * 8;
            let x: Vec<f32> = rng.normals(n).iter().map(|v| v * scale).collect();
            rows.push((format!("normal × {scale}"), x));
        }
        // Every edge block beside random ones, so a block's position in the row varies.
        let edges: Vec<f32> = rows[..n_edges]
            .iter()
            .flat_map(|(_, r)| r.clone())
            .collect();
        rows.push(("all edge blocks in one row".to_string(), edges));
        for (what, x) in &rows {
            let n_blocks = x.len() / block;
            // Different fills: a quantizer must write every byte it owns.
            let mut got = vec![0xA5u8; n_blocks * block_bytes];
            let mut want = vec![0x5Au8; n_blocks * block_bytes];
            quantize(x, &mut got);
            reference(x, &mut want);
            for b in 0..n_blocks {
                let r = b * block_bytes..(b + 1) * block_bytes;
                assert_eq!(got[r.clone()], want[r], "{name}, {what}, block {b}");
            }
        }
    }
}
