//! `deepseek4` (DeepSeek V4 Flash / Pro): `hc_mult` residual streams mixed by
//! manifold-constrained hyper-connections, one shared key/value head with rope on its trailing
//! dims and learned sinks, a sliding window on every layer plus compressed rows (ratio 4 with a
//! lightning indexer choosing the rows each query sees, or ratio 128 seen whole), a grouped
//! low-rank output projection, and sqrt-softplus routing (hash-routed leading layers) with a
//! shared expert and the clamped SwiGLU. Its forward path is `crate::dsv4`; this declares the
//! parts the shared blocks read.

use super::{ArchSpec, FfnLayout, Gating, Glu, RopeKind};

pub const SPEC: ArchSpec = ArchSpec {
    name: "deepseek4",
    rope: RopeKind::Norm,
    ffn: FfnLayout::Moe,
    norm_topk: true,
    shared_expert: true,
    gating: Gating::SqrtSoftplus,
    // The file's `swiglu_clamp_exp` replaces this limit (see `Hparams::dsv4`).
    glu: Glu::ClampedSilu { limit: 10.0 },
    ..super::BASE
};
