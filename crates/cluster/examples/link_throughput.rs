//! Throughput of one link on loopback, keyed (Noise, sealed records) and keyless (plaintext):
//! what encryption costs per byte, apart from any model.
//!
//! `cargo run --release -p cluster --example link_throughput -- [MiB per frame] [frames]`

use std::net::{TcpListener, TcpStream};
use std::time::Instant;

use cluster::wire::{self, AuthMode, ClusterKey, Frame, Hello, Kind, LinkConfig, Role, Welcome};

fn main() {
    let args: Vec<usize> = std::env::args()
        .skip(1)
        .filter_map(|a| a.parse().ok())
        .collect();
    let (mib, frames) = (
        args.first().copied().unwrap_or(4),
        args.get(1).copied().unwrap_or(64),
    );
    for (name, auth) in [
        ("keyless", AuthMode::Insecure),
        ("keyed", AuthMode::Key(ClusterKey::generate())),
    ] {
        let link = LinkConfig::new(auth);
        let listener = TcpListener::bind("127.0.0.1:0").expect("bind");
        let addr = listener.local_addr().expect("addr");
        let server_link = link.clone();
        let server = std::thread::spawn(move || {
            let (s, _) = listener.accept().expect("accept");
            let (_c, mut r, _) =
                wire::accept(s, &server_link, |_| Ok(Welcome::default())).expect("handshake");
            let t0 = Instant::now();
            let mut bytes = 0usize;
            for _ in 0..frames {
                bytes += r.recv().expect("frame").payload.len();
            }
            (bytes, t0.elapsed())
        });
        let stream = TcpStream::connect(addr).expect("connect");
        let (c, _r, _) =
            wire::connect(stream, &link, Hello::new(Role::Hop, "", 0, None)).expect("handshake");
        let payload = vec![7u8; mib << 20];
        for i in 0..frames {
            c.send(&Frame::new(Kind::Work, i as u64, payload.clone()))
                .expect("send");
        }
        let (bytes, took) = server.join().expect("server");
        println!(
            "{name:8} {frames} frames of {mib} MiB: {:.2} GB/s",
            bytes as f64 / took.as_secs_f64() / 1e9
        );
    }
}
