//! The handshake's server side, `wire::accept`, over a real loopback TCP connection (the code a
//! coordinator and a worker run on every inbound link), with a keyed or a keyless server.
//!
//! The client's bytes come in three forms: raw bytes; a keyed hello built by the real client
//! code (`hello_frame`) from arbitrary fields, with the right key or another one, optionally
//! damaged; a keyless hello likewise. Properties: a server that accepted was sent an
//! undamaged hello with its own key (a keyless server: any well-formed keyless hello, of our
//! protocol when it came from the client code undamaged) and its answer opens, with
//! the client's state, as the welcome it chose; a damaged or wrongly keyed hello is refused; a
//! refusal the client can read names a reason; nothing panics or hangs.
#![no_main]

use std::io::{Read, Write};
use std::net::{Shutdown, TcpListener, TcpStream};
use std::sync::OnceLock;
use std::time::Duration;

use arbitrary::{Arbitrary, Unstructured};
use cluster::wire::conn::PRE_AUTH_MAX_PAYLOAD;
use cluster::wire::frame::{HEADER_LEN, read_frame};
use cluster::wire::{
    AuthMode, ClusterKey, Hello, LinkConfig, PROTOCOL_VERSION, Role, Welcome, accept, hello_frame,
    read_answer,
};
use libfuzzer_sys::fuzz_target;

#[derive(Arbitrary, Debug)]
enum FuzzRole {
    Stage { first: u32, last: u32, head: bool },
    Hop,
    Rank { rank: Option<u32>, expert_weight: f32 },
}

#[derive(Arbitrary, Debug)]
struct FuzzHello {
    protocol_offset: u8,
    build: String,
    role: FuzzRole,
    fingerprint: String,
    n_ctx: u32,
    listen: Option<String>,
    peer_timeout_ms: u64,
}

#[derive(Arbitrary, Debug)]
enum Client {
    Raw(Vec<u8>),
    Keyed {
        hello: FuzzHello,
        right_key: bool,
        damage: Vec<(u16, u8)>,
        tail: Vec<u8>,
    },
    Keyless {
        hello: FuzzHello,
        damage: Vec<(u16, u8)>,
    },
}

#[derive(Arbitrary, Debug)]
struct Input {
    keyed_server: bool,
    server_accepts: bool,
    client: Client,
}

const KEY: [u8; 32] = [0x42; 32];

fn listener() -> &'static TcpListener {
    static L: OnceLock<TcpListener> = OnceLock::new();
    L.get_or_init(|| TcpListener::bind("127.0.0.1:0").expect("a loopback port"))
}

fn hello_of(h: FuzzHello) -> Hello {
    let role = match h.role {
        FuzzRole::Stage { first, last, head } => Role::Stage { first, last, head },
        FuzzRole::Hop => Role::Hop,
        FuzzRole::Rank { rank, expert_weight } => Role::Rank {
            rank,
            expert_weight,
        },
    };
    let mut hello = Hello::new(role, &h.fingerprint, h.n_ctx, h.listen);
    // Mostly our protocol, sometimes another.
    if h.protocol_offset % 8 == 7 {
        hello.protocol = hello.protocol.wrapping_add(u16::from(h.protocol_offset));
    }
    hello.build = h.build;
    hello.peer_timeout_ms = h.peer_timeout_ms;
    hello
}

/// Flips bytes of the encoded frame's payload (the header's fields are checked by the frame
/// reader, which the raw form exercises); whether the bytes now differ (flips can cancel).
fn damage(bytes: &mut [u8], damage: &[(u16, u8)]) -> bool {
    let before = bytes.to_vec();
    let payload = HEADER_LEN..bytes.len();
    for &(at, x) in damage.iter().take(4) {
        if !payload.is_empty() {
            bytes[HEADER_LEN + at as usize % payload.len()] ^= x;
        }
    }
    *bytes != before[..]
}

fn linger0(s: &TcpStream) {
    // Connections end with a reset, not TIME_WAIT: millions of them must not use up the
    // loopback's ports.
    let _ = socket2::SockRef::from(s).set_linger(Some(Duration::ZERO));
}

fuzz_target!(|data: &[u8]| {
    let Ok(input) = Input::arbitrary(&mut Unstructured::new(data)) else {
        return;
    };
    let server_auth = if input.keyed_server {
        AuthMode::Key(ClusterKey::new(KEY.to_vec()).expect("a 32-byte key"))
    } else {
        AuthMode::Insecure
    };
    let link = LinkConfig::new(server_auth).with_peer_timeout(Duration::from_millis(200));
    // What the client sends, whether it should be accepted, and its handshake state.
    let (bytes, acceptable, mut state) = match input.client {
        // Raw bytes cannot make a Noise message of our key; a keyless server may take them.
        Client::Raw(b) => (b, input.keyed_server.then_some(false), None),
        Client::Keyed {
            hello,
            right_key,
            damage: d,
            tail,
        } => {
            let hello = hello_of(hello);
            let mut key = KEY;
            if !right_key {
                key[0] ^= 1;
            }
            let client = AuthMode::Key(ClusterKey::new(key.to_vec()).expect("a 32-byte key"));
            let (frame, hs) = hello_frame(&client, &hello).expect("a hello frame");
            let mut b = Vec::new();
            frame.write_to(&mut b).expect("into memory");
            let damaged = damage(&mut b, &d);
            let fits = input.keyed_server && right_key && !damaged;
            b.extend_from_slice(&tail);
            (b, Some(fits && hello.protocol == PROTOCOL_VERSION), hs)
        }
        Client::Keyless { hello, damage: d } => {
            let hello = hello_of(hello);
            let (frame, hs) = hello_frame(&AuthMode::Insecure, &hello).expect("a hello frame");
            let mut b = Vec::new();
            frame.write_to(&mut b).expect("into memory");
            let damaged = damage(&mut b, &d);
            let ours = hello.protocol == PROTOCOL_VERSION;
            let verdict = if input.keyed_server {
                Some(false)
            } else {
                (!damaged).then_some(ours)
            };
            (b, verdict, hs)
        }
    };
    let Ok(mut client) = TcpStream::connect(listener().local_addr().expect("bound")) else {
        return;
    };
    let Ok((server, _)) = listener().accept() else {
        return;
    };
    linger0(&client);
    linger0(&server);
    if client.write_all(&bytes).is_err() {
        return;
    }
    let _ = client.shutdown(Shutdown::Write);
    let server_accepts = input.server_accepts;
    let result = accept(server, &link, |_| {
        if server_accepts {
            Ok(Welcome {
                build: String::new(),
                peer_timeout_ms: 0,
                message: "welcome".into(),
                rank: Some(1),
                group_size: Some(2),
            })
        } else {
            Err("refused by the fuzzer".into())
        }
    });
    match &result {
        Ok(_) => assert!(
            acceptable != Some(false) && server_accepts,
            "accepted a hello that must be refused ({acceptable:?})"
        ),
        Err(_) => assert!(
            acceptable != Some(true) || !server_accepts,
            "refused a good hello: {:?}",
            result.as_ref().err()
        ),
    }
    // The client's view of the answer: everything the server wrote before it closed.
    if let Ok((conn, _, _)) = &result {
        conn.shutdown();
    }
    let _ = client.set_read_timeout(Some(Duration::from_secs(5)));
    let mut back = Vec::new();
    let _ = client.read_to_end(&mut back);
    if let Ok(Some(f)) = read_frame(&mut back.as_slice(), PRE_AUTH_MAX_PAYLOAD) {
        let answer = read_answer(&f, state.as_mut(), "server");
        if result.is_ok() {
            let welcome = answer.expect("the accepted client can open the answer");
            assert_eq!(
                welcome.map(|w| w.message),
                Ok("welcome".to_string()),
                "the answer is the welcome the server chose"
            );
        } else if acceptable == Some(true) {
            assert!(
                matches!(answer, Ok(Err(ref r)) if !r.is_empty()),
                "a refusal names its reason: {answer:?}"
            );
        }
    } else if result.is_ok() {
        panic!("the server accepted but its welcome never reached the client");
    }
});
