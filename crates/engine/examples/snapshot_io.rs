//! Saving and loading a ~100 MB snapshot (atomic write with fsync, checksum checked on load),
//! and the throughput of the checksum against SHA-256 on the same bytes — the numbers behind
//! the choice of XXH3-128 in `engine::file`.
//!
//! `cargo run --release -p engine --example snapshot_io [DIR] [MB]` (DIR: a temporary directory
//! by default, so the disk measured is the one of $TMPDIR).

use std::time::Instant;

use engine::Snapshot;
use engine::file::Checksum;
use model::KvType;
use sha2::Digest;

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let tmp = tempfile::tempdir().expect("a temporary directory");
    let dir = args.get(1).map_or(tmp.path().to_path_buf(), Into::into);
    let mb: usize = args.get(2).map_or(100, |s| s.parse().expect("MB"));
    let n_layer = 32;
    let per = (mb << 20) / (2 * n_layer);
    let fill = |seed: usize| -> Vec<u8> {
        (0..per)
            .map(|i| ((i * 2_654_435_761 + seed) >> 7) as u8)
            .collect()
    };
    let snap = Snapshot {
        fingerprint: "bench".into(),
        tokens: (0..4096).collect(),
        kv_type: KvType::F16,
        n_kv_head: 1,
        head_dim_k: 1,
        head_dim_v: 1,
        layers: (0..n_layer)
            .map(|l| (fill(2 * l), fill(2 * l + 1)))
            .collect(),
        last_logits: vec![0.0; 32_000],
    };
    let path = dir.join("bench.snap");
    let mut bytes = Vec::new();
    snap.write_to(&mut bytes).unwrap();
    let mbs = |secs: f64| bytes.len() as f64 / 1e6 / secs;
    println!(
        "snapshot of {:.1} MB in {}",
        bytes.len() as f64 / 1e6,
        dir.display()
    );
    for round in 1..=3 {
        let t = Instant::now();
        std::hint::black_box(Checksum::of(&bytes));
        let xxh3 = t.elapsed().as_secs_f64();
        let t = Instant::now();
        std::hint::black_box(sha2::Sha256::digest(&bytes));
        let sha256 = t.elapsed().as_secs_f64();
        let t = Instant::now();
        snap.save(&path).unwrap();
        let save = t.elapsed().as_secs_f64();
        let t = Instant::now();
        let back = Snapshot::load(&path).unwrap();
        let load = t.elapsed().as_secs_f64();
        assert!(back == snap);
        println!(
            "round {round}: xxh3-128 {:.0} ms ({:.0} MB/s), sha256 {:.0} ms ({:.0} MB/s); \
             save (fsync) {:.0} ms ({:.0} MB/s), load (page cache) {:.0} ms ({:.0} MB/s)",
            xxh3 * 1e3,
            mbs(xxh3),
            sha256 * 1e3,
            mbs(sha256),
            save * 1e3,
            mbs(save),
            load * 1e3,
            mbs(load),
        );
    }
    let _ = std::fs::remove_file(&path);
}
