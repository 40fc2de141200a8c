//! Log-probabilities of tokens: a log-softmax over the model's raw logits, before any sampling
//! transform (penalties, temperature, top-k/p, min-p), which is what OpenAI and vLLM report by
//! default. They describe the model, not the sampler: the same at any temperature.

/// The chosen token's log-probability and the `top` most likely tokens with theirs.
#[derive(Clone, Debug, PartialEq)]
pub struct TokenLogprobs {
    pub token: u32,
    pub logprob: f32,
    /// Most likely first; ties by lower id.
    pub top: Vec<(u32, f32)>,
}

/// Log-softmax of `logits` at `chosen`, and the `top` best entries. Non-finite logits count as
/// impossible (−∞).
pub fn token_logprobs(logits: &[f32], chosen: u32, top: usize) -> TokenLogprobs {
    let max = logits
        .iter()
        .copied()
        .filter(|l| l.is_finite())
        .fold(f32::NEG_INFINITY, f32::max);
    // Summed in f64: 150 k terms in f32 lose digits the top entries' logprobs would show.
    let sum: f64 = logits
        .iter()
        .filter(|l| l.is_finite())
        .map(|&l| f64::from(l - max).exp())
        .sum();
    let log_z = f64::from(max) + sum.ln();
    let logprob_of = |l: f32| {
        if l.is_finite() {
            (f64::from(l) - log_z) as f32
        } else {
            f32::NEG_INFINITY
        }
    };
    let logprob = logits
        .get(chosen as usize)
        .map_or(f32::NEG_INFINITY, |&l| logprob_of(l));
    let mut ranked: Vec<(u32, f32)> = logits
        .iter()
        .enumerate()
        .map(|(i, &l)| (i as u32, if l.is_finite() { l } else { f32::NEG_INFINITY }))
        .collect();
    let better = |a: &(u32, f32), b: &(u32, f32)| b.1.total_cmp(&a.1).then(a.0.cmp(&b.0));
    let top = top.min(ranked.len());
    if top > 0 && top < ranked.len() {
        ranked.select_nth_unstable_by(top - 1, better);
    }
    ranked.truncate(top);
    ranked.sort_unstable_by(better);
    TokenLogprobs {
        token: chosen,
        logprob,
        top: ranked
            .into_iter()
            .map(|(t, l)| (t, logprob_of(l)))
            .collect(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn log_softmax_of_known_values() {
        // softmax([0, ln 3]) = [1/4, 3/4].
        let l = [0.0, 3f32.ln(), f32::NEG_INFINITY];
        let t = token_logprobs(&l, 0, 2);
        assert!((t.logprob - 0.25f32.ln()).abs() < 1e-6);
        assert_eq!(t.top[0].0, 1);
        assert!((t.top[0].1 - 0.75f32.ln()).abs() < 1e-6);
        assert_eq!(t.top[1].0, 0);
        assert_eq!(token_logprobs(&l, 2, 0).logprob, f32::NEG_INFINITY);
    }

    #[test]
    fn top_entries_are_ordered_and_probabilities_sum_to_one() {
        let l: Vec<f32> = (0..1000)
            .map(|i| ((i * 7919) % 1000) as f32 / 100.0)
            .collect();
        let t = token_logprobs(&l, 5, 20);
        assert_eq!(t.top.len(), 20);
        assert!(t.top.windows(2).all(|w| w[0].1 >= w[1].1));
        let best = l.iter().copied().fold(f32::MIN, f32::max);
        assert_eq!(l[t.top[0].0 as usize], best);
        let total: f64 = (0..1000)
            .map(|i| f64::from(token_logprobs(&l, i, 0).logprob).exp())
            .sum();
        assert!((total - 1.0).abs() < 1e-4, "{total}");
    }
}
