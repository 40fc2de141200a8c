//! The one forward path: `forward(layer range, ExpertSource, input, kv, positions)`. A single
//! node calls it with every layer and the head; a pipeline stage with its range; a
//! tensor-parallel rank with an expert source that owns a shard and hooks that all-reduce the
//! partial sums. Streaming only swaps the expert source.

use std::ops::RangeInclusive;

use kernels::Input;

use crate::Model;
use crate::blocks::Compute;
use crate::blocks::attention::SeqSpan;
use crate::blocks::ffn::glu_ffn;
use crate::blocks::indexer::{self, Selection};
use crate::blocks::moe::{ExpertFfn, moe_ffn, route, route_tokens};
use crate::blocks::rope::RopeTable;
use crate::error::{ModelError, Result};
use crate::experts::ExpertSource;
use crate::profile::{Phase, span, timed};
use crate::weights::Ffn;

use crate::pass::{
    Hooks, Logits, LogitsWanted, ReducePoint, SeqInput, StageInput, StageOutput, keep_rows,
};

pub(crate) fn add_rows(x: &mut [f32], bias: &[f32]) {
    for row in x.chunks_exact_mut(bias.len()) {
        for (v, b) in row.iter_mut().zip(bias) {
            *v += b;
        }
    }
}

fn add_into(x: &mut [f64], y: &[f64]) {
    for (a, b) in x.iter_mut().zip(y) {
        *a += b;
    }
}

/// Adds a block's output (an exact, split-independent f64 sum) to the residual stream in f32,
/// as llama.cpp does.
pub(crate) fn add_residual(cx: &Compute, x: &mut [f32], y: &[f64], row_len: usize) {
    cx.par_rows(x, row_len, |first, rows| {
        for (a, b) in rows.iter_mut().zip(&y[first * row_len..]) {
            *a += *b as f32;
        }
    });
}

/// Splits stage-input rows of `stream + carried` values into the stream and the carried
/// sparse-attention selection (`None` when no layer before this stage made one).
fn split_carried(h: &[f32], stream: usize, carried: usize) -> (Vec<f32>, Option<Selection>) {
    let n = h.len() / (stream + carried);
    let mut x = Vec::with_capacity(n * stream);
    let mut rows = Vec::with_capacity(n * carried);
    for row in h.chunks_exact(stream + carried) {
        x.extend_from_slice(&row[..stream]);
        rows.extend(row[stream..].iter().map(|v| v.to_bits()));
    }
    let made = rows.first().is_some_and(|&p| p != indexer::NO_POSITION);
    (x, made.then_some(Selection { k: carried, rows }))
}

/// Stage-output rows: the stream, then the selection (bit patterns; unused slots when none).
fn join_carried(
    x: &[f32],
    stream: usize,
    carried: usize,
    selection: Option<&Selection>,
) -> Vec<f32> {
    let n = x.len() / stream;
    let mut out = Vec::with_capacity(n * (stream + carried));
    for (i, row) in x.chunks_exact(stream).enumerate() {
        out.extend_from_slice(row);
        match selection {
            Some(s) => out.extend(
                s.rows[i * carried..(i + 1) * carried]
                    .iter()
                    .map(|&p| f32::from_bits(p)),
            ),
            None => out.extend(std::iter::repeat_n(
                f32::from_bits(indexer::NO_POSITION),
                carried,
            )),
        }
    }
    out
}

/// The batch rows that need logits.
fn logit_rows(seqs: &[SeqInput]) -> Vec<usize> {
    let mut rows = Vec::new();
    let mut row0 = 0;
    for s in seqs {
        match s.logits {
            LogitsWanted::None => {}
            LogitsWanted::Last if s.n_tokens > 0 => rows.push(row0 + s.n_tokens - 1),
            LogitsWanted::Last => {}
            LogitsWanted::All => rows.extend(row0..row0 + s.n_tokens),
        }
        row0 += s.n_tokens;
    }
    rows
}

/// The model's final layer, when the batch rows after its attention can be cut down to those
/// that need logits: only when this stage computes the head and some row needs none. The
/// attention still runs on every row (each row's keys and values enter the cache), but the rest
/// of that layer feeds nothing but the head, so a prefill chunk skips the final layer's FFN for
/// every row but its last (llama.cpp does the same with its output ids).
pub(crate) fn final_rows<'r>(
    head: bool,
    layers: &RangeInclusive<usize>,
    n_layer: usize,
    n_rows: usize,
    rows: &'r [usize],
) -> Option<(usize, &'r [usize])> {
    let runs_final = *layers.end() == n_layer - 1;
    (head && runs_final && rows.len() < n_rows).then_some((n_layer - 1, rows))
}

/// Each sequence's rows of the batch and its cache.
pub(crate) fn seq_spans<'a>(seqs: &'a [SeqInput], pos0: &[usize]) -> Vec<SeqSpan<'a>> {
    let mut spans = Vec::with_capacity(seqs.len());
    let mut row0 = 0;
    for (s, &p0) in seqs.iter().zip(pos0) {
        spans.push(SeqSpan {
            kv: &*s.kv,
            row0,
            n_tokens: s.n_tokens,
            pos0: p0,
        });
        row0 += s.n_tokens;
    }
    spans
}

impl Model {
    /// Runs `layers` (and the output head when `head`) over a batch of sequences.
    #[allow(clippy::too_many_arguments)]
    pub fn forward(
        &self,
        cx: &Compute,
        experts: &dyn ExpertSource,
        layers: RangeInclusive<usize>,
        head: bool,
        input: StageInput,
        seqs: &mut [SeqInput],
        hooks: &mut dyn Hooks,
    ) -> Result<StageOutput> {
        let n: usize = seqs.iter().map(|s| s.n_tokens).sum();
        let d = self.hp.n_embd;
        let wide = self.hp.stream_width();
        if *layers.end() >= self.hp.n_layer || layers.start() > layers.end() {
            return Err(ModelError::Input(format!(
                "layer range {layers:?} is outside 0..{}",
                self.hp.n_layer
            )));
        }
        if self.layer(*layers.start()).is_none() || self.layer(*layers.end()).is_none() {
            return Err(self.not_held(&format!("layers {}:{}", layers.start(), layers.end())));
        }
        let mut selection = None;
        let mut x = match input {
            StageInput::Tokens(t) => {
                if *layers.start() != 0 {
                    return Err(ModelError::Input(
                        "token input needs a range that starts at layer 0".into(),
                    ));
                }
                if t.len() != n {
                    return Err(ModelError::Input(format!(
                        "{} tokens for {n} batch rows",
                        t.len()
                    )));
                }
                let mut x = vec![0f32; n * d];
                timed(Phase::Embed, || self.embed(t, &mut x))?;
                hooks.observe(None, "inp_embd", &x);
                if wide != d {
                    // Every hyper-connection stream starts as the embedding.
                    let mut streams = vec![0f32; n * wide];
                    for (row, e) in streams.chunks_exact_mut(wide).zip(x.chunks_exact(d)) {
                        for s in row.chunks_exact_mut(d) {
                            s.copy_from_slice(e);
                        }
                    }
                    x = streams;
                }
                x
            }
            StageInput::Hidden(h) | StageInput::HiddenWithTokens(h, _) => {
                let row = self.hp.hidden_width();
                if h.len() != n * row {
                    return Err(ModelError::Input(format!(
                        "{} hidden values for {n} rows of {row}",
                        h.len()
                    )));
                }
                if row == wide {
                    h.to_vec()
                } else {
                    let (x, carried) = split_carried(h, wide, row - wide);
                    selection = carried;
                    x
                }
            }
        };
        let tokens = match input {
            StageInput::Tokens(t) => Some(t),
            StageInput::HiddenWithTokens(_, t) if t.len() == n => Some(t),
            StageInput::Hidden(_) | StageInput::HiddenWithTokens(..) => None,
        };
        let mut pos0 = Vec::with_capacity(seqs.len());
        timed(Phase::KvReserve, || -> Result<()> {
            for s in seqs.iter_mut() {
                let p = s.kv.len();
                s.kv.reserve(p, s.n_tokens)?;
                pos0.push(p);
            }
            Ok(())
        })?;
        let whole = *layers.start() == 0 && *layers.end() == self.hp.n_layer - 1 && head;
        let on_device = match cx.layer_device() {
            Some(device)
                if whole
                    && matches!(input, StageInput::Tokens(_))
                    && !hooks.observes()
                    && self.all_experts_owned(experts) =>
            {
                self.forward_on_device(cx, device.as_ref(), &x, seqs, &pos0)
            }
            _ => Ok(None),
        };
        let result = match on_device {
            Ok(Some(out)) => Ok(out),
            Ok(None) => self.run_layers(
                cx, experts, layers, head, &mut x, tokens, seqs, &pos0, selection, hooks,
            ),
            Err(e) => Err(e),
        };
        if result.is_err() {
            for (s, &p) in seqs.iter_mut().zip(&pos0) {
                // `reserve(p, ..)` kept what position `p` attends to, so this rewind holds.
                let rewound = s.kv.truncate(p);
                debug_assert!(rewound.is_ok(), "{rewound:?}");
            }
        }
        result
    }

    /// Whether `experts` computes every expert of every MoE layer (a whole-model device runs
    /// them all itself).
    fn all_experts_owned(&self, experts: &dyn ExpertSource) -> bool {
        (0..self.hp.n_layer).all(|il| match self.layer(il).map(|l| &l.ffn) {
            Some(Ffn::Moe { experts: t, .. }) => (0..t.gate.n_expert).all(|e| experts.owns(il, e)),
            _ => true,
        })
    }

    /// The step on a whole-model device: `Ok(None)` when it declines.
    fn forward_on_device(
        &self,
        cx: &Compute,
        device: &dyn crate::layer_device::LayerDevice,
        x: &[f32],
        seqs: &mut [SeqInput],
        pos0: &[usize],
    ) -> Result<Option<StageOutput>> {
        let positions: Vec<usize> = seqs
            .iter()
            .zip(pos0)
            .flat_map(|(s, &p)| p..p + s.n_tokens)
            .collect();
        let rows = logit_rows(seqs);
        let rope = RopeTable::new(&self.hp.rope, self.rope_freqs.as_deref(), &positions);
        let step = crate::layer_device::DeviceStep {
            x,
            seqs,
            pos0,
            rope: &rope,
            logit_rows: &rows,
            cx,
        };
        let _span = span(Phase::Device);
        Ok(device.forward(self, step)?.map(|data| {
            StageOutput::Logits(Logits {
                rows,
                n_vocab: self.hp.n_vocab,
                vocab_offset: 0,
                data,
            })
        }))
    }

    #[allow(clippy::too_many_arguments)]
    fn run_layers(
        &self,
        cx: &Compute,
        experts: &dyn ExpertSource,
        layers: RangeInclusive<usize>,
        head: bool,
        x: &mut Vec<f32>,
        tokens: Option<&[u32]>,
        seqs: &mut [SeqInput],
        pos0: &[usize],
        mut selection: Option<Selection>,
        hooks: &mut dyn Hooks,
    ) -> Result<StageOutput> {
        let positions: Vec<usize> = seqs
            .iter()
            .zip(pos0)
            .flat_map(|(s, &p)| p..p + s.n_tokens)
            .collect();
        let wide = self.hp.stream_width();
        let rows = logit_rows(seqs);
        let trim = final_rows(head, &layers, self.hp.n_layer, positions.len(), &rows);
        if self.hp.glm5next.is_some() {
            let carried = selection.take().map(|s| s.to_lists());
            let handed_on =
                self.glm5next_layers(cx, layers, x, seqs, pos0, experts, carried, trim, hooks)?;
            selection = handed_on
                .map(|l| Selection::from_lists(&l, self.hp.carried_width()))
                .transpose()?;
        } else if self.hp.dsv4.is_some() {
            let ropes = crate::dsv4::Dsv4Ropes::new(&self.hp, &positions);
            for il in layers {
                let keep = trim.filter(|&(last, _)| il == last).map(|(_, kept)| kept);
                self.dsv4_layer(cx, il, x, tokens, keep, seqs, pos0, &ropes, experts, hooks)?;
                hooks.observe(Some(il), "l_out", x);
            }
        } else {
            let rope = RopeTable::new(&self.hp.rope, self.rope_freqs.as_deref(), &positions);
            for il in layers {
                self.attention_layer(cx, il, x, seqs, pos0, &rope, &mut selection, hooks)?;
                if let Some((last, kept)) = trim
                    && il == last
                {
                    keep_rows(x, kept, wide);
                }
                if !x.is_empty() {
                    self.ffn_layer(cx, il, x, experts, hooks)?;
                }
                hooks.observe(Some(il), "l_out", x);
            }
        }
        if !head {
            let carried = self.hp.carried_width();
            if carried == 0 {
                return Ok(StageOutput::Hidden(std::mem::take(x)));
            }
            return Ok(StageOutput::Hidden(join_carried(
                x,
                self.hp.stream_width(),
                carried,
                selection.as_ref(),
            )));
        }
        let d = self.hp.n_embd;
        let mut h = if trim.is_some() {
            std::mem::take(x)
        } else {
            let mut h = Vec::with_capacity(rows.len() * wide);
            for &r in &rows {
                h.extend_from_slice(&x[r * wide..(r + 1) * wide]);
            }
            h
        };
        let head_span = span(Phase::Head);
        if let Some(p) = &self.hp.glm5next {
            h = crate::glm5next::mean_of_streams(&h, p.hc, d);
        } else if wide != d {
            h = self.dsv4_head_collapse(cx, &h)?;
        }
        let (Some(output_norm), Some(output)) = (&self.output_norm, &self.output) else {
            return Err(self.not_held("the output norm and head"));
        };
        cx.rms_norm_rows_inplace(&mut h, output_norm, self.hp.rms_eps);
        hooks.observe(None, "result_norm", &h);
        let input = Input::new(&h, rows.len(), d)?;
        // A tensor-parallel rank computes its slice of the vocabulary.
        let vocab = self.shard.vocab.clone();
        let out_w = output.weights(self.files()).rows_slice(vocab.clone());
        let data = cx.project(&input, &[out_w])?.pop().expect("one output");
        drop(head_span);
        hooks.observe(None, "result_output", &data);
        Ok(StageOutput::Logits(Logits {
            rows,
            n_vocab: vocab.len(),
            vocab_offset: vocab.start,
            data,
        }))
    }

    /// A SwiGLU FFN, split by columns across tensor-parallel ranks (partial sums); when the
    /// split does not align, rank 0 computes it whole and the others contribute zeros.
    fn split_swiglu(
        &self,
        cx: &Compute,
        x: &Input,
        gate: &crate::weights::Matrix,
        up: &crate::weights::Matrix,
        down: &crate::weights::Matrix,
    ) -> Result<Vec<f64>> {
        self.split_glu(cx, x, gate, up, down, crate::arch::Glu::Silu)
    }

    /// [`Model::split_swiglu`] with another gated activation.
    pub(crate) fn split_glu(
        &self,
        cx: &Compute,
        x: &Input,
        gate: &crate::weights::Matrix,
        up: &crate::weights::Matrix,
        down: &crate::weights::Matrix,
        glu: crate::arch::Glu,
    ) -> Result<Vec<f64>> {
        let files = self.files();
        let (g, u, dn) = (gate.weights(files), up.weights(files), down.weights(files));
        let chunk = crate::shard::ffn_chunk(down.dtype, gate.rows);
        match self.shard.ffn_cols(gate.rows, chunk) {
            Some(cols) if cols.len() == gate.rows => glu_ffn(cx, x, g, u, dn, chunk, glu),
            Some(cols) if cols.is_empty() => Ok(vec![0f64; x.n() * down.rows]),
            Some(cols) => {
                let dn = dn
                    .cols_slice(cols.clone())
                    .expect("aligned by Shard::ffn_cols");
                glu_ffn(
                    cx,
                    x,
                    g.rows_slice(cols.clone()),
                    u.rows_slice(cols),
                    dn,
                    chunk,
                    glu,
                )
            }
            None if self.shard.rank == 0 => glu_ffn(cx, x, g, u, dn, chunk, glu),
            None => Ok(vec![0f64; x.n() * down.rows]),
        }
    }

    /// Runs layer `il + 1`'s router on the current residual stream and asks the expert source to
    /// prefetch what it picks, so reads overlap this layer's experts and the next attention.
    pub(crate) fn prefetch_next_layer(
        &self,
        cx: &Compute,
        il: usize,
        x: &[f32],
        experts: &dyn ExpertSource,
    ) -> Result<()> {
        let next = il + 1;
        let Some(Ffn::Moe {
            selection_bias,
            experts: tensors,
            ..
        }) = self.layer(next).map(|l| &l.ffn)
        else {
            return Ok(());
        };
        let (d, moe) = (
            self.hp.n_embd,
            self.hp.moe.as_ref().expect("MoE layers have MoE params"),
        );
        let n = x.len() / d;
        let mut h = vec![0f32; n * d];
        cx.rms_norm_rows(x, &self.held_layer(next)?.ffn_norm, self.hp.rms_eps, &mut h);
        let hin = Input::new(&h, n, d)?;
        let logits = self.router_logits(cx, next, &hin)?;
        let routing = route(
            &logits,
            tensors.gate.n_expert,
            moe,
            selection_bias.as_deref(),
        );
        let mut wanted: Vec<usize> = routing
            .experts
            .iter()
            .copied()
            .filter(|&e| experts.owns(next, e))
            .collect();
        wanted.sort_unstable();
        wanted.dedup();
        experts.prefetch(next, &wanted);
        Ok(())
    }

    /// Router logits of MoE layer `il` for the normed rows `x` (its bias added, if any).
    fn router_logits(&self, cx: &Compute, il: usize, x: &Input) -> Result<Vec<f32>> {
        let Ffn::Moe {
            router,
            router_bias,
            ..
        } = &self.held_layer(il)?.ffn
        else {
            return Err(ModelError::Input(format!("layer {il} has no router")));
        };
        let mut logits = timed(Phase::Router, || {
            cx.project(x, &[router.weights(self.files())])
        })?
        .pop()
        .expect("router");
        if let Some(b) = router_bias {
            add_rows(&mut logits, b);
        }
        Ok(logits)
    }

    /// The feed-forward block: dense SwiGLU, or routed experts (this rank's) plus the shared
    /// expert; one all-reduce of the combined partial sum when tensor-parallel.
    fn ffn_layer(
        &self,
        cx: &Compute,
        il: usize,
        x: &mut [f32],
        experts: &dyn ExpertSource,
        hooks: &mut dyn Hooks,
    ) -> Result<()> {
        let hp = &self.hp;
        let l = self.held_layer(il)?;
        let d = hp.n_embd;
        let n = x.len() / d;
        let mut h = vec![0f32; n * d];
        timed(Phase::Norm, || {
            cx.rms_norm_rows(x, &l.ffn_norm, hp.rms_eps, &mut h)
        });
        hooks.observe(Some(il), "ffn_norm", &h);
        let hin = Input::new(&h, n, d)?;
        let mut out = match &l.ffn {
            Ffn::Dense { gate, up, down } => timed(Phase::DenseFfn, || {
                self.split_swiglu(cx, &hin, gate, up, down)
            })?,
            Ffn::Moe {
                selection_bias,
                experts: tensors,
                expert_biases,
                shared,
                ..
            } => {
                let moe = hp.moe.as_ref().expect("MoE layers have MoE params");
                let logits = self.router_logits(cx, il, &hin)?;
                hooks.observe(Some(il), "ffn_moe_logits", &logits);
                let routing = timed(Phase::Route, || {
                    route_tokens(
                        cx,
                        &logits,
                        tensors.gate.n_expert,
                        moe,
                        selection_bias.as_deref(),
                    )
                });
                if experts.lookahead() {
                    self.prefetch_next_layer(cx, il, x, experts)?;
                }
                let kind = ExpertFfn {
                    glu: self.spec.glu,
                    biases: expert_biases.as_ref(),
                };
                let mut out = moe_ffn(
                    cx,
                    il,
                    &hin,
                    &routing,
                    tensors.gate.n_expert,
                    d,
                    &kind,
                    experts,
                )
                .map_err(|e| match e {
                    ModelError::Matmul(source) => ModelError::Kernel { layer: il, source },
                    other => other,
                })?;

                if let Some(sh) = shared {
                    let _shared_span = span(Phase::DenseFfn);
                    let mut s = self.split_swiglu(cx, &hin, &sh.gate, &sh.up, &sh.down)?;
                    if let Some(g) = &sh.gate_inp {
                        // The gate scales each token's whole output, so it distributes over
                        // the ranks' partial sums.
                        for (t, row) in s.chunks_exact_mut(d).enumerate() {
                            let z: f32 = h[t * d..(t + 1) * d]
                                .iter()
                                .zip(g)
                                .map(|(a, b)| a * b)
                                .sum();
                            let gate = (1.0 / (1.0 + (-z).exp())) as f64;
                            row.iter_mut().for_each(|v| *v *= gate);
                        }
                    }

                    add_into(&mut out, &s);
                }
                out
            }
        };
        if self.shard.is_split() {
            timed(Phase::AllReduce, || {
                hooks.all_reduce(il, ReducePoint::FfnOutput, &mut out)
            })?;
        }
        timed(Phase::Residual, || add_residual(cx, x, &out, d));
        Ok(())
    }
}
