//! What the fuzz targets share: an engine over the committed tiny qwen3moe fixture (a forward
//! pass costs little even instrumented), the committed demo model's tokenizer and chat template,
//! and a scratch directory cleared for every input.

use std::cell::RefCell;
use std::path::{Path, PathBuf};
use std::sync::{Arc, OnceLock};

use engine::chat_template::ChatTemplate;
use engine::generate::{GenerateOptions, generate};
use engine::tokenizer::Tokenizer;
use engine::{Engine, LocalExecutor, Sampler, SamplerConfig, Snapshot};
use gguf::GgufFile;
use model::{Compute, KvType, Model};

/// Context of the fuzzing engine: real snapshots of a few tokens fit, a longer one is refused.
pub const N_CTX: usize = 64;

fn repo_path(rel: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("..").join(rel)
}

/// The model the engine runs: 4 layers, 2 kv heads of 32, 336 tokens.
pub fn engine_model_path() -> PathBuf {
    repo_path("crates/model/tests/fixtures/qwen3moe/model-q8_0.gguf")
}

/// `models/shakespeare-moe.gguf`, the model every fresh clone has (its tokenizer and template
/// serve the request bodies).
pub fn demo_model_path() -> PathBuf {
    repo_path("models/shakespeare-moe.gguf")
}

pub struct Tiny {
    pub model: Arc<Model>,
    pub tokenizer: Arc<Tokenizer>,
    pub fingerprint: String,
}

/// The engine's model, loaded once.
pub fn tiny() -> &'static Tiny {
    static TINY: OnceLock<Tiny> = OnceLock::new();
    TINY.get_or_init(|| {
        let path = engine_model_path();
        let model = Model::load(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
        let tokenizer =
            Tokenizer::from_metadata(model.files().metadata()).expect("the fixture's tokenizer");
        Tiny {
            fingerprint: model.files().fingerprint().to_string(),
            model: Arc::new(model),
            tokenizer: Arc::new(tokenizer),
        }
    })
}

fn demo_file() -> &'static GgufFile {
    static DEMO: OnceLock<GgufFile> = OnceLock::new();
    DEMO.get_or_init(|| {
        let path = demo_model_path();
        GgufFile::open(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
    })
}

/// The demo model's tokenizer, built once.
pub fn demo_tokenizer() -> Arc<Tokenizer> {
    static TOK: OnceLock<Arc<Tokenizer>> = OnceLock::new();
    let tok = TOK.get_or_init(|| {
        Arc::new(Tokenizer::from_metadata(demo_file().metadata()).expect("the demo tokenizer"))
    });
    Arc::clone(tok)
}

/// The demo model's chat template, or ChatML as `moeshard serve` falls back to.
pub fn chat_template() -> ChatTemplate {
    let meta = demo_file().metadata();
    match ChatTemplate::from_metadata(meta).expect("the demo model's template") {
        Some(t) => t,
        None => {
            let tokenizer = demo_tokenizer();
            let text = |id: Option<u32>| {
                id.and_then(|i| tokenizer.token_text(i))
                    .unwrap_or_default()
                    .to_string()
            };
            ChatTemplate::chatml(text(tokenizer.bos()), text(tokenizer.eos()))
        }
    }
}

thread_local! {
    static ENGINE: RefCell<Option<Engine>> = const { RefCell::new(None) };
}

/// Runs `f` with this thread's engine over the tiny model (one thread, F16 KV, [`N_CTX`]
/// positions). Sessions `f` opens must be closed by it, so that no input sees another's state.
pub fn with_engine<R>(f: impl FnOnce(&mut Engine, &Tiny) -> R) -> R {
    let tiny = tiny();
    ENGINE.with(|cell| {
        let mut slot = cell.borrow_mut();
        let engine = slot.get_or_insert_with(|| {
            let exec =
                LocalExecutor::new(Arc::clone(&tiny.model), Compute::new(1), KvType::F16, N_CTX);
            Engine::new(Box::new(exec))
        });
        f(engine, tiny)
    })
}

/// A snapshot the engine writes after evaluating `tokens` (what `--save-snapshot` and the disk
/// KV cache save).
pub fn real_snapshot(tokens: &[u32]) -> Snapshot {
    with_engine(|engine, _| {
        let mut session = engine.new_session();
        engine
            .append(&mut session, tokens)
            .expect("evaluating the seed tokens");
        let snap = engine.snapshot(&session).expect("snapshot");
        engine.close(session);
        snap
    })
}

/// What `moeshard run --load-snapshot` does with a snapshot it read (and the server with one
/// from its disk cache): restore it into the engine (refused unless its layout fits), then
/// continue the conversation for one greedy token.
pub fn restore_and_continue(snap: &Snapshot) {
    with_engine(|engine, tiny| {
        let Ok(mut session) = engine.restore(snap) else {
            return;
        };
        assert_eq!(session.tokens, snap.tokens);
        let prompt = snap.tokens.clone();
        if !prompt.is_empty() {
            let mut sampler = Sampler::new(SamplerConfig::greedy());
            let opts = GenerateOptions {
                max_tokens: 1,
                stop: Vec::new(),
                ignore_eos: true,
            };
            let tokenizer: &Tokenizer = &tiny.tokenizer;
            let mut text = |_: &str| true;
            let _ = generate(
                engine,
                &mut session,
                tokenizer,
                &mut sampler,
                &prompt,
                &opts,
                &mut text,
            );
        }
        engine.close(session);
    })
}

/// An empty directory private to this process (under /dev/shm when there is one: the disk
/// target writes files for every input), emptied on each call.
pub fn scratch_dir() -> &'static Path {
    static DIR: OnceLock<tempfile::TempDir> = OnceLock::new();
    let dir = DIR
        .get_or_init(|| {
            let shm = Path::new("/dev/shm");
            let builder = tempfile::Builder::new()
                .prefix("moeshard-fuzz-")
                .tempdir_in(shm);
            builder
                .or_else(|_| tempfile::tempdir())
                .expect("a scratch directory")
        })
        .path();
    for entry in std::fs::read_dir(dir).expect("reading the scratch directory") {
        let path = entry.expect("a scratch entry").path();
        let _ = if path.is_dir() {
            std::fs::remove_dir_all(&path)
        } else {
            std::fs::remove_file(&path)
        };
    }
    dir
}

/// The disk KV cache's files as the real cache writes them (see the `disk_kv_reader` target).
pub mod disk {
    use std::path::PathBuf;
    use std::sync::OnceLock;

    use server::disk_cache::DiskCache;

    /// The tokens of the saved session (short: the fuzzing engine's context is small).
    pub const TOKENS: [u32; 6] = [1, 17, 42, 300, 7, 99];

    pub struct Template {
        pub fingerprint: String,
        /// The model's subdirectory, relative to the cache root.
        pub subdir: PathBuf,
        /// (name, contents), smallest first.
        pub files: Vec<(String, Vec<u8>)>,
    }

    /// What the cache writes for a session of `tokens` of the tiny model.
    pub fn files_of(tokens: &[u32]) -> Template {
        let tiny = super::tiny();
        let root = tempfile::tempdir().expect("a temporary directory");
        let snap = super::real_snapshot(tokens);
        let mut cache = DiskCache::open(root.path(), &tiny.fingerprint, u64::MAX).expect("open");
        assert!(cache.save(snap), "the cache takes the session");
        cache.flush();
        let dir = cache.dir().to_path_buf();
        let mut files: Vec<(String, Vec<u8>)> = std::fs::read_dir(&dir)
            .expect("the cache directory")
            .map(|e| {
                let path = e.expect("an entry").path();
                let name = path.file_name().unwrap().to_string_lossy().into_owned();
                (name, std::fs::read(&path).expect("a cache file"))
            })
            .collect();
        assert!(!files.is_empty(), "the cache wrote nothing");
        files.sort_by(|a, b| (a.1.len(), &a.0).cmp(&(b.1.len(), &b.0)));
        Template {
            fingerprint: tiny.fingerprint.clone(),
            subdir: dir.strip_prefix(root.path()).unwrap().to_path_buf(),
            files,
        }
    }

    /// The files of [`TOKENS`], made once.
    pub fn template() -> &'static Template {
        static T: OnceLock<Template> = OnceLock::new();
        T.get_or_init(|| files_of(&TOKENS))
    }
}

/// Snapshots built by `arbitrary`, written by the real writer (so their checksums are right):
/// what reaches the layout check and the restore, which a mutated file's checksum stops.
pub mod snapshots {
    use arbitrary::{Arbitrary, Result, Unstructured};
    use engine::{Snapshot, SnapshotLayout};
    use model::KvType;

    /// Mostly inside the tiny model's vocabulary.
    #[derive(Arbitrary, Debug)]
    enum Tok {
        Small(u8),
        Vocab(u16),
        Any(u32),
    }

    impl Tok {
        fn id(&self) -> u32 {
            match *self {
                Tok::Small(t) => t.into(),
                Tok::Vocab(t) => u32::from(t) % 400,
                Tok::Any(t) => t,
            }
        }
    }

    #[derive(Arbitrary, Debug)]
    enum Shape {
        /// The tiny model's KV layout.
        Demo,
        Any {
            heads: u8,
            dim_k: u8,
            dim_v: u8,
        },
    }

    #[derive(Arbitrary, Debug)]
    enum Layers {
        /// The right count and sizes for the shape and the tokens.
        Exact,
        /// The right count, each layer's sizes off by a few bytes or right.
        Off(Vec<(i8, i8)>),
        Any(Vec<(u16, u16)>),
    }

    #[derive(Arbitrary, Debug)]
    enum Logits {
        None,
        Vocab,
        Any(Vec<f32>),
    }

    #[derive(Arbitrary, Debug)]
    struct SnapIn {
        engine_model: bool,
        tokens: Vec<Tok>,
        f16: bool,
        shape: Shape,
        layers: Layers,
        logits: Logits,
        /// KV bytes are this pattern (NaN and infinities included when it says so).
        fill: u8,
    }

    /// The engine's layout ([`super::N_CTX`] positions, F16).
    pub fn engine_layout() -> SnapshotLayout {
        SnapshotLayout::of(&super::tiny().model, KvType::F16, super::N_CTX)
    }

    /// A snapshot of the engine's model or another, sized right or not; at most 8 tokens more than
    /// the context and small layers (checksumming instrumented code is slow).
    pub fn arbitrary_snapshot(u: &mut Unstructured) -> Result<Snapshot> {
        let s = SnapIn::arbitrary(u)?;
        let demo = engine_layout();
        let n_vocab = super::tiny().tokenizer.vocab_size();
        let tokens: Vec<u32> = s
            .tokens
            .iter()
            .take(super::N_CTX + 8)
            .map(Tok::id)
            .collect();
        let kv_type = if s.f16 { KvType::F16 } else { KvType::F32 };
        let (heads, dim_k, dim_v) = match s.shape {
            Shape::Demo => (demo.n_kv_head, demo.head_dim_k, demo.head_dim_v),
            Shape::Any {
                heads,
                dim_k,
                dim_v,
            } => (heads.into(), dim_k.into(), dim_v.into()),
        };
        let e = kv_type.bytes();
        let (kr, vr) = (heads * dim_k * e, heads * dim_v * e);
        let n = tokens.len();
        let sizes: Vec<(usize, usize)> = match s.layers {
            Layers::Exact => vec![(n * kr, n * vr); demo.n_layer],
            Layers::Off(off) => (0..demo.n_layer)
                .map(|i| {
                    let (dk, dv) = off.get(i).copied().unwrap_or((0, 0));
                    let f = |len: usize, d: i8| len.saturating_add_signed(d.into());
                    (f(n * kr, dk), f(n * vr, dv))
                })
                .collect(),
            Layers::Any(v) => v
                .iter()
                .take(8)
                .map(|&(k, v)| (k.into(), v.into()))
                .collect(),
        };
        let layers = sizes
            .into_iter()
            .map(|(k, v)| (vec![s.fill; k.min(1 << 12)], vec![s.fill; v.min(1 << 12)]))
            .collect();
        let last_logits = match s.logits {
            Logits::None => Vec::new(),
            Logits::Vocab => (0..n_vocab).map(|i| (i % 13) as f32).collect(),
            Logits::Any(v) => v.into_iter().take(1024).collect(),
        };
        Ok(Snapshot {
            fingerprint: if s.engine_model {
                demo.fingerprint
            } else {
                "other".into()
            },
            tokens,
            kv_type,
            n_kv_head: heads,
            head_dim_k: dim_k,
            head_dim_v: dim_v,
            layers,
            last_logits,
        })
    }

    /// The bytes the writer makes of `snap`.
    pub fn bytes(snap: &Snapshot) -> Vec<u8> {
        let mut out = Vec::new();
        snap.write_to(&mut out).expect("writing to memory");
        out
    }
}

/// What the cluster targets share: every frame kind, and the decoders the receiving ends of a
/// link run on each kind's payload.
pub mod frames {
    use cluster::activation::ActFormat;
    use cluster::pipeline::protocol::{
        Control, ControlReply, ResultHeader, SessionOp, SnapshotPart, StageFailure, WorkHeader,
    };
    use cluster::tp::protocol::{TpCommand, TpReply};
    use cluster::wire::{self, Frame, Hello, Kind, Welcome, decode, unpack};

    pub const KINDS: [Kind; 15] = [
        Kind::Hello,
        Kind::Welcome,
        Kind::Reject,
        Kind::Error,
        Kind::Ping,
        Kind::Pong,
        Kind::Route,
        Kind::Work,
        Kind::WorkResult,
        Kind::SessionOp,
        Kind::SessionOpDone,
        Kind::SnapshotPart,
        Kind::TpExchange,
        Kind::TpOp,
        Kind::TpDone,
    ];

    /// Hidden size the work decoder assumes (a stage refuses any other).
    const N_EMBD: usize = 64;

    /// Runs the decoders the receiving side would run on `f`; none may panic.
    pub fn decode_payload(f: &Frame) {
        let p = &f.payload;
        match f.kind {
            Kind::Hello => drop(decode::<Hello>("hello", p)),
            Kind::Welcome => drop(decode::<Result<Welcome, String>>("welcome", p)),
            Kind::Reject => drop(decode::<wire::messages::Reject>("reject", p)),
            Kind::Error => drop(decode::<String>("error", p)),
            Kind::Ping | Kind::Pong | Kind::SessionOpDone => {}
            Kind::Route => {
                let _ = decode::<Control>("control", p);
                let _ = decode::<ControlReply>("control reply", p);
            }
            Kind::Work => {
                if let Ok((h, raw)) = unpack::<WorkHeader>("work", p)
                    && h.n_embd as usize == N_EMBD
                {
                    let _ = h.act.decode(raw, h.tokens.len(), N_EMBD);
                    let _ = ActFormat::from_bits(h.act.bits());
                }
            }
            Kind::WorkResult => {
                let _ = unpack::<ResultHeader>("result", p);
                let _ = unpack::<StageFailure>("stage failure", p);
            }
            Kind::SessionOp => drop(unpack::<SessionOp>("session op", p)),
            Kind::SnapshotPart => drop(unpack::<SnapshotPart>("snapshot part", p)),
            Kind::TpExchange => drop(wire::f32_values(p)),
            Kind::TpOp => drop(unpack::<TpCommand>("tp command", p)),
            Kind::TpDone => drop(unpack::<TpReply>("tp reply", p)),
        }
    }
}
