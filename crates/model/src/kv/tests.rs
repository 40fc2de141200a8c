//! The cache's own tests: sliding windows, rewinds, snapshots, encoded rows.

use super::*;

/// gpt-oss-20b's shape: 24 layers alternating sliding (window 128, layer 0 slides) and
/// full, 8 kv heads of 64 dims.
fn gpt_oss_20b(kv_type: KvType, n_ctx: usize, bounded: bool) -> KvLayout {
    let n_layer = 24;
    KvLayout {
        kv_type,
        layers: 0..=n_layer - 1,
        n_kv_head: 8,
        head_dim_k: 64,
        head_dim_v: 64,
        n_ctx,
        sliding: bounded.then(|| SlidingLayers {
            window: 128,
            layers: (0..n_layer).map(|il| il % 2 == 0).collect(),
        }),
        compression: None,
        index_keys: None,
        hybrid: None,
    }
}

/// Reserves a 512-token prompt, then decodes to `n` positions, one at a time.
fn fill(kv: &mut KvCache, n: usize) {
    kv.reserve(0, 512).unwrap();
    for pos in 512..n {
        kv.reserve(pos, 1).unwrap();
    }
}

#[test]
fn a_gpt_oss_20b_shaped_cache_holds_the_window_of_its_sliding_layers() {
    let n = 8192;
    let mut full = KvCache::new(gpt_oss_20b(KvType::F16, n, false));
    let mut bounded = KvCache::new(gpt_oss_20b(KvType::F16, n, true));
    fill(&mut full, n);
    fill(&mut bounded, n);
    let per_layer = 8 * (64 + 64) * 2;
    assert_eq!(full.bytes_used(), n * 24 * per_layer);
    let sliding_held = bounded.len() - bounded.first;
    assert!(
        sliding_held <= sliding_positions_held(128, 1),
        "{sliding_held}"
    );
    assert_eq!(
        bounded.bytes_used(),
        (n * 12 + sliding_held * 12) * per_layer
    );
    assert!(bounded.bytes_used() <= bounded.layout().bytes_at_most(n, 1));
    assert_eq!(full.layout().bytes_at_most(n, 1), full.bytes_used());
    eprintln!(
        "gpt-oss-20b shape, f16 KV, {n} positions (512 prefilled, then decoded): full cache {} bytes used / {} allocated ({} per position); bounded {} used / {} allocated (sliding layers hold {sliding_held} positions)",
        full.bytes_used(),
        full.bytes_allocated(),
        full.bytes_per_position(),
        bounded.bytes_used(),
        bounded.bytes_allocated()
    );
    // The sliding layers' buffers stop growing: the prompt chunk plus the bound.
    let sliding_alloc = bounded.k[0].len() + bounded.v[0].len();
    assert!(sliding_alloc <= (512 + sliding_positions_held(128, 1)) * per_layer);
}

/// Rows written as their position number survive drops, rewinds, exports and imports in
/// the right places: a bounded cache reads what a full one reads, from `held_from` on.
#[test]
fn bounded_rows_match_a_full_cache_through_drops_rewinds_and_restores() {
    let layout = |bounded: bool| KvLayout {
        kv_type: KvType::F32,
        layers: 3..=5,
        n_kv_head: 1,
        head_dim_k: 2,
        head_dim_v: 1,
        n_ctx: 400,
        sliding: bounded.then(|| SlidingLayers {
            window: 4,
            layers: vec![true, false, true],
        }),
        compression: None,
        index_keys: None,
        hybrid: None,
    };
    let (mut b, mut f) = (KvCache::new(layout(true)), KvCache::new(layout(false)));
    let write = |kv: &mut KvCache, pos0: usize, n: usize| {
        kv.reserve(pos0, n).unwrap();
        for pos in pos0..pos0 + n {
            for il in 3..=5 {
                let x = (pos * 10 + il) as f32;
                kv.store(il, pos, &[x, -x], &[x + 0.5]).unwrap();
            }
        }
    };
    let check = |b: &KvCache, f: &KvCache| {
        assert_eq!(b.len(), f.len());
        for il in 3..=5 {
            let from = b.held_from(il).unwrap();
            let kr = 8;
            assert_eq!(b.keys(il).unwrap(), &f.keys(il).unwrap()[from * kr..]);
            assert_eq!(b.values(il).unwrap(), &f.values(il).unwrap()[from * 4..]);
        }
    };
    // Chunks of every size from 1 to 9 (crossing drops), with rewinds by up to a window.
    let mut step = 0usize;
    while b.len() < 300 {
        step += 1;
        let back = step % 5;
        let len = b.len();
        if back > 0 && back <= len {
            assert!(b.can_rewind(len - back), "rewind by {back} at {len}");
            b.truncate(len - back).unwrap();
            f.truncate(len - back).unwrap();
        }
        let (pos0, n) = (b.len(), step % 9 + 1);
        write(&mut b, pos0, n);
        write(&mut f, pos0, n);
        check(&b, &f);
        assert!(b.len() - b.first <= sliding_positions_held(4, n));
    }
    assert!(b.first > 0);
    assert!(b.truncate(1).is_err() && b.len() == f.len());
    // A snapshot of the bounded cache (sliding layers: the latest window - 1) restores into
    // a bounded cache, a full one's too; the full cache refuses the window only.
    let n = b.len();
    for source in [&b, &f] {
        let mut r = KvCache::new(layout(true));
        r.begin_import(n).unwrap();
        for il in 3..=5 {
            let (k, v) = source.export(il, n).unwrap();
            r.import(il, n, &k, &v).unwrap();
        }
        for il in [3, 5] {
            assert_eq!(r.keys(il).unwrap(), &f.keys(il).unwrap()[(n - 3) * 8..]);
        }
        assert_eq!(r.keys(4).unwrap(), f.keys(4).unwrap());
        assert!(!r.can_rewind(n - 1) && r.can_rewind(0));
    }
    let mut r = KvCache::new(layout(false));
    r.begin_import(n).unwrap();
    let (k, v) = b.export(3, n).unwrap();
    assert_eq!(k.len(), 3 * 8);
    assert!(r.import(3, n, &k, &v).is_err());
    // After the furthest rewind it accepts, a bounded cache still exports every layer.
    let m = (1..n).find(|&m| b.can_rewind(m)).unwrap();
    assert!(m > 1 && !b.can_rewind(m - 1));
    b.truncate(m).unwrap();
    for il in 3..=5 {
        b.export(il, m).unwrap();
    }
}

/// Rows handed over already encoded land where `store` puts the same values, in both
/// element types; short, ragged or unreserved rows are refused and change nothing.
#[test]
fn encoded_rows_land_where_stored_rows_do() {
    for kv_type in [KvType::F32, KvType::F16] {
        let layout = KvLayout {
            kv_type,
            layers: 2..=3,
            n_kv_head: 2,
            head_dim_k: 4,
            head_dim_v: 3,
            n_ctx: 64,
            sliding: None,
            compression: None,
            index_keys: None,
            hybrid: None,
        };
        let (mut one_by_one, mut encoded) = (KvCache::new(layout.clone()), KvCache::new(layout));
        let value =
            |il: usize, pos: usize, i: usize| (il * 1000 + pos * 10 + i) as f32 * 0.37 - 20.0;
        for kv in [&mut one_by_one, &mut encoded] {
            kv.reserve(0, 5).unwrap();
        }
        let encode = |xs: &[f32]| -> Vec<u8> {
            match kv_type {
                KvType::F32 => xs.iter().flat_map(|x| x.to_le_bytes()).collect(),
                KvType::F16 => xs
                    .iter()
                    .flat_map(|&x| f16::from_f32(x).to_bits().to_le_bytes())
                    .collect(),
            }
        };
        for il in 2..=3 {
            let (mut ks, mut vs) = (Vec::new(), Vec::new());
            for pos in 1..5 {
                let k: Vec<f32> = (0..8).map(|i| value(il, pos, i)).collect();
                let v: Vec<f32> = (0..6).map(|i| -value(il, pos, i)).collect();
                one_by_one.store(il, pos, &k, &v).unwrap();
                ks.extend(k);
                vs.extend(v);
            }
            let (k, v) = (encode(&ks), encode(&vs));
            let before = encoded.keys(il).unwrap().to_vec();
            assert!(encoded.store_encoded_rows(il, 1, &k[1..], &v).is_err());
            assert!(encoded.store_encoded_rows(il, 2, &k, &v).is_err());
            let half = k.len() / 2;
            assert!(encoded.store_encoded_rows(il, 1, &k[..half], &v).is_err());
            assert_eq!(encoded.keys(il).unwrap(), &before[..]);
            encoded.store_encoded_rows(il, 1, &k, &v).unwrap();
            assert_eq!(encoded.keys(il).unwrap(), one_by_one.keys(il).unwrap());
            assert_eq!(encoded.values(il).unwrap(), one_by_one.values(il).unwrap());
        }
        assert!(encoded.store_encoded_rows(4, 0, &[], &[]).is_err());
    }
}

/// Several layers stored at once land where storing them one by one puts them, both below and
/// above the size copied on several threads; a repeated layer, or one bad layer among good
/// ones, is refused and changes nothing.
#[test]
fn encoded_layers_land_where_single_layers_do() {
    // 8 layers × 2 × 1024 rows × 512 bytes: 8 MB, above PARALLEL_STORE_BYTES; 2 rows: below.
    for rows in [2usize, 1024] {
        let layout = KvLayout {
            kv_type: KvType::F32,
            layers: 0..=7,
            n_kv_head: 4,
            head_dim_k: 32,
            head_dim_v: 32,
            n_ctx: 2048,
            sliding: None,
            compression: None,
            index_keys: None,
            hybrid: None,
        };
        let (mut single, mut together) = (KvCache::new(layout.clone()), KvCache::new(layout));
        for kv in [&mut single, &mut together] {
            kv.reserve(0, 1 + rows).unwrap();
        }
        let row = 4 * 32 * 4;
        let bytes = |il: usize, salt: u8| -> Vec<u8> {
            (0..rows * row)
                .map(|i| (i as u8).wrapping_mul(31).wrapping_add(il as u8 * 7 + salt))
                .collect()
        };
        let data: Vec<(Vec<u8>, Vec<u8>)> = (0..8).map(|il| (bytes(il, 1), bytes(il, 2))).collect();
        for (il, (k, v)) in data.iter().enumerate() {
            single.store_encoded_rows(il, 1, k, v).unwrap();
        }
        let mut layers: Vec<(usize, &[u8], &[u8])> = data
            .iter()
            .enumerate()
            .map(|(il, (k, v))| (il, k.as_slice(), v.as_slice()))
            .collect();
        let before = together.keys(0).unwrap().to_vec();
        let (k0, v0) = (&data[0].0, &data[0].1);
        let repeated = [
            (0, k0.as_slice(), v0.as_slice()),
            (0, k0.as_slice(), v0.as_slice()),
        ];
        assert!(together.store_encoded_layers(1, &repeated).is_err());
        layers[5].1 = &data[5].0[1..];
        assert!(together.store_encoded_layers(1, &layers).is_err());
        assert_eq!(together.keys(0).unwrap(), &before[..]);
        layers[5].1 = &data[5].0;
        together.store_encoded_layers(1, &layers).unwrap();
        for il in 0..8 {
            assert_eq!(together.keys(il).unwrap(), single.keys(il).unwrap());
            assert_eq!(together.values(il).unwrap(), single.values(il).unwrap());
        }
    }
}

/// Growing a cache by more than the size grown on several threads keeps every stored row and
/// zero-fills the new positions (the growth runs threaded where the machine has two cores or
/// more; the sliding layers keep every position here, as `first` stays 0).
#[test]
fn a_large_growth_keeps_the_rows_and_zeroes_the_rest() {
    let mut kv = KvCache::new(gpt_oss_20b(KvType::F16, 4096, true));
    kv.reserve(0, 100).unwrap();
    let row = 8 * 64 * 2;
    let rows = |il: usize, salt: u8| -> Vec<u8> {
        (0..100 * row)
            .map(|i| (i as u8).wrapping_mul(13).wrapping_add(il as u8 * 5 + salt) | 1)
            .collect()
    };
    let data: Vec<(Vec<u8>, Vec<u8>)> = (0..24).map(|il| (rows(il, 3), rows(il, 4))).collect();
    let layers: Vec<(usize, &[u8], &[u8])> = data
        .iter()
        .enumerate()
        .map(|(il, (k, v))| (il, k.as_slice(), v.as_slice()))
        .collect();
    kv.store_encoded_layers(0, &layers).unwrap();
    // The buffers grow from 256 to 1024 positions: 48 × 768 rows × 1 KiB, 37.7 MB, above
    // PARALLEL_STORE_BYTES.
    kv.reserve(100, 900).unwrap();
    assert_eq!(kv.len(), 1000);
    for (il, (k, v)) in data.iter().enumerate() {
        let (keys, values) = (kv.keys(il).unwrap(), kv.values(il).unwrap());
        assert_eq!(&keys[..k.len()], &k[..], "layer {il} keys");
        assert_eq!(&values[..v.len()], &v[..], "layer {il} values");
        assert!(
            keys[k.len()..1000 * row].iter().all(|&b| b == 0),
            "layer {il}"
        );
        assert!(
            values[v.len()..1000 * row].iter().all(|&b| b == 0),
            "layer {il}"
        );
    }
}
