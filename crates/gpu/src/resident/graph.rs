//! How a step's launches reach the device: captured into a CUDA graph and replayed while steps
//! keep one shape (decode, hybrid decode included), or enqueued directly (a prompt's one-off
//! chunks, steps that copy host experts in).

use super::{GraphKey, ResidentModel, State, StepGraph};

impl ResidentModel {
    /// Runs `enqueue` (the step's copies and launches, in stream order) directly or through
    /// the graph of its shape `key` (when `graphable`); `enqueue` is told whether it is being
    /// captured (then nothing it enqueues runs before it returns). On an error, whatever it
    /// had enqueued has finished.
    pub(super) fn run_launches(
        &self,
        state: &mut State,
        key: GraphKey,
        graphable: bool,
        mut enqueue: impl FnMut(bool) -> model::Result<()>,
    ) -> model::Result<()> {
        // A shape seen in two steps in a row (decode) is captured; a prompt's one-off chunks run
        // their launches directly instead of paying for a capture they would not replay.
        let repeated = state.last_key.replace(key) == Some(key);
        let replay = state.graph.as_ref().is_some_and(|g| g.key == key);
        // Steps that copy host experts in are large (their launches are few for their time)
        // and span two streams: the caller runs them directly.
        let graphs = self.switches.graphs && graphable;
        if graphs && (replay || repeated) {
            if !replay {
                state.graph = None;
                self.stream
                    .begin_capture(cudarc::driver::sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL)
                    .map_err(|e| self.error("capturing a step", e))?;
                let captured = enqueue(true);
                // The capture ends whatever happened inside it, or the stream stays unusable.
                let graph = self
                    .stream
                    .end_capture(cudarc::driver::sys::CUgraphInstantiate_flags(0))
                    .map_err(|e| self.error("instantiating a step's graph", e))?;
                captured?;
                let graph =
                    graph.ok_or_else(|| self.error("capturing a step", "the capture was empty"))?;
                state.graph = Some(StepGraph { key, graph });
            }
            let g = state.graph.as_ref().expect("captured above");
            g.graph
                .launch()
                .map_err(|e| self.error("launching a step's graph", e))?;
        } else if let Err(e) = enqueue(false) {
            // Work already enqueued may still read the streaming buffer (or the copy stream
            // write it): both finish before the buffer's lock is let go.
            let _ = self.stream.synchronize();
            if let Some(h) = &self.host_experts {
                let _ = h.synchronize();
            }
            return Err(e);
        }
        Ok(())
    }
}
