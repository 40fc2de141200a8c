//! Links over real sockets on 127.0.0.1: the Noise handshake with a shared key, sealed frames
//! of every size (one record, many records), refusal of a wrong key without the peer learning
//! anything, detection of an altered record, and liveness: heartbeats keep a quiet link up, a
//! silent peer is declared dead within the peer timeout.

use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::time::{Duration, Instant};

use cluster::wire::{
    self, AuthMode, ClusterKey, Connection, ConnectionReader, Frame, Hello, Kind, LinkConfig, Role,
    Welcome, WireError,
};

fn key(byte: u8) -> LinkConfig {
    LinkConfig::new(AuthMode::Key(ClusterKey::new(vec![byte; 32]).unwrap()))
}

fn hello() -> Hello {
    Hello::new(Role::Hop, "model", 64, None)
}

type Link = (Connection, ConnectionReader);

/// A server link and a client link over loopback (through `relay` when given: it sees and may
/// alter every byte from client to server).
fn pair(
    server: LinkConfig,
    client: LinkConfig,
) -> (Result<Link, WireError>, Result<(Link, Welcome), WireError>) {
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = listener.local_addr().unwrap();
    let accepting = std::thread::spawn(move || {
        let (s, _) = listener.accept().unwrap();
        wire::accept(s, &server, |_| {
            Ok(Welcome {
                message: "welcome".into(),
                ..Default::default()
            })
        })
        .map(|(c, r, _)| (c, r))
    });
    let client = wire::connect(TcpStream::connect(addr).unwrap(), &client, hello())
        .map(|(c, r, w)| ((c, r), w));
    (accepting.join().unwrap(), client)
}

#[test]
fn keyed_links_carry_frames_of_every_size_both_ways() {
    let (server, client) = pair(key(1), key(1));
    let (s, mut sr) = server.unwrap();
    let ((c, mut cr), welcome) = client.unwrap();
    assert_eq!(welcome.message, "welcome");
    for len in [0usize, 1, 65518, 65519, 65520, 3 * 65519 + 7, 4 << 20] {
        let payload: Vec<u8> = (0..len).map(|i| (i * 31 + len) as u8).collect();
        let f = Frame::new(Kind::Work, len as u64, payload);
        c.send(&f).unwrap();
        assert_eq!(sr.recv().unwrap(), f, "client → server, {len} bytes");
        s.send(&f).unwrap();
        assert_eq!(cr.recv().unwrap(), f, "server → client, {len} bytes");
    }
}

#[test]
fn a_wrong_key_is_refused_by_name_on_both_sides() {
    let (server, client) = pair(key(1), key(2));
    let s = server.err().expect("the server must refuse");
    let c = client.err().expect("the client must be refused");
    assert!(s.to_string().contains("different cluster key"), "{s}");
    assert!(c.to_string().contains("different cluster key"), "{c}");
    let (server, client) = pair(key(1), LinkConfig::new(AuthMode::Insecure));
    assert!(server.is_err());
    assert!(client.err().unwrap().to_string().contains("requires a key"));
}

#[test]
fn an_altered_record_ends_the_link() {
    // A relay that flips one byte of the first frame after the handshake.
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let relay = TcpListener::bind("127.0.0.1:0").unwrap();
    let (addr, relay_addr) = (listener.local_addr().unwrap(), relay.local_addr().unwrap());
    std::thread::spawn(move || {
        let (mut from, _) = relay.accept().unwrap();
        let mut to = TcpStream::connect(addr).unwrap();
        let mut back = to.try_clone().unwrap();
        let mut from2 = from.try_clone().unwrap();
        std::thread::spawn(move || std::io::copy(&mut back, &mut from2));
        let mut buf = [0u8; 4096];
        let mut seen = 0usize;
        loop {
            let n = match from.read(&mut buf) {
                Ok(0) | Err(_) => return,
                Ok(n) => n,
            };
            // The hello frame is the first 28 + len bytes; flip a byte well after it.
            for (i, b) in buf[..n].iter_mut().enumerate() {
                if seen + i == 400 {
                    *b ^= 0x40;
                }
            }
            seen += n;
            if to.write_all(&buf[..n]).is_err() {
                return;
            }
        }
    });
    let server = std::thread::spawn(move || {
        let (s, _) = listener.accept().unwrap();
        wire::accept(s, &key(3), |_| Ok(Welcome::default())).map(|(c, r, _)| (c, r))
    });
    let (c, _cr, _) =
        wire::connect(TcpStream::connect(relay_addr).unwrap(), &key(3), hello()).unwrap();
    let (_s, mut sr) = server.join().unwrap().unwrap();
    c.send(&Frame::new(Kind::Work, 1, vec![5u8; 2000])).unwrap();
    let e = sr
        .recv()
        .expect_err("an altered record must not be delivered");
    assert!(e.to_string().contains("failed authentication"), "{e}");
}

#[test]
fn heartbeats_keep_a_quiet_link_and_a_silent_peer_is_declared_dead() {
    let t = Duration::from_millis(800);
    let (server, client) = pair(key(4).with_peer_timeout(t), key(4).with_peer_timeout(t));
    let (s, mut sr) = server.unwrap();
    let ((c, mut cr), _) = client.unwrap();
    // Quiet for three timeouts, then a frame: heartbeats kept the link alive meanwhile.
    let waiter = std::thread::spawn(move || {
        let f = sr.recv();
        (sr, f)
    });
    std::thread::sleep(3 * t);
    c.send(&Frame::new(Kind::Work, 7, vec![1])).unwrap();
    let (_sr, f) = waiter.join().unwrap();
    assert_eq!(f.unwrap().request_id, 7);
    // The server stops sending (its writer and heartbeats gone, its socket still open, as a
    // stopped process's would be): the client declares it dead within the timeout.
    drop(s);
    let t0 = Instant::now();
    let e = cr.recv().expect_err("a silent peer");
    assert!(matches!(e, WireError::Silent { .. }), "{e}");
    assert!(t0.elapsed() < 2 * t, "declared after {:?}", t0.elapsed());
}

#[test]
fn a_connection_that_never_finishes_its_handshake_is_dropped_at_the_deadline() {
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = listener.local_addr().unwrap();
    let server = std::thread::spawn(move || {
        let (s, _) = listener.accept().unwrap();
        let t0 = Instant::now();
        let r = wire::accept(s, &key(5), |_| Ok(Welcome::default()));
        (r.is_err(), t0.elapsed())
    });
    // A header's first bytes, one every second: each read makes progress, the deadline stays.
    let mut s = TcpStream::connect(addr).unwrap();
    let started = Instant::now();
    for b in b"MSHD\x02\x00\x01\x00" {
        if started.elapsed() > Duration::from_secs(14) || s.write_all(&[*b]).is_err() {
            break;
        }
        std::thread::sleep(Duration::from_secs(1));
    }
    let (refused, took) = server.join().unwrap();
    assert!(refused);
    assert!(
        took <= wire::handshake::HANDSHAKE_TIMEOUT + Duration::from_secs(1),
        "{took:?}"
    );
}

#[test]
fn heartbeats_follow_the_shorter_peer_timeout_of_the_two_sides() {
    // The server would wait 10 s, the client only 0.8 s: the server must beat for the client.
    let t = Duration::from_millis(800);
    let (server, client) = pair(key(6), key(6).with_peer_timeout(t));
    let (s, _sr) = server.unwrap();
    let ((_c, mut cr), _) = client.unwrap();
    let waiter = std::thread::spawn(move || cr.recv());
    std::thread::sleep(3 * t);
    s.send(&Frame::new(Kind::Work, 9, vec![2])).unwrap();
    let f = waiter.join().unwrap();
    assert_eq!(f.expect("a quiet but live server").request_id, 9);
}
