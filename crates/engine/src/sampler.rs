//! Token sampling: repetition/presence/frequency penalties, top-k, top-p, min-p, temperature,
//! then a draw from a seeded ChaCha generator (same seed → same tokens on every machine).
//! A temperature of zero (or below) is greedy. With a grammar ([`crate::grammar`]), tokens it
//! does not allow are masked out first, so every step of the chain sees only allowed tokens.

use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

use crate::grammar::{GrammarError, TokenConstraint};

#[derive(Clone, Debug, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct SamplerConfig {
    pub temperature: f32,
    /// 0 disables.
    pub top_k: usize,
    /// 1.0 disables.
    pub top_p: f32,
    /// 0.0 disables.
    pub min_p: f32,
    /// 1.0 disables (llama.cpp `--repeat-penalty`).
    pub repeat_penalty: f32,
    /// How many recent tokens the penalties look at.
    pub repeat_last_n: usize,
    /// OpenAI-style additive penalties.
    pub presence_penalty: f32,
    pub frequency_penalty: f32,
    pub seed: u64,
}

impl Default for SamplerConfig {
    fn default() -> Self {
        SamplerConfig {
            temperature: 0.8,
            top_k: 40,
            top_p: 0.95,
            min_p: 0.05,
            repeat_penalty: 1.0,
            repeat_last_n: 64,
            presence_penalty: 0.0,
            frequency_penalty: 0.0,
            seed: 0,
        }
    }
}

impl SamplerConfig {
    pub fn greedy() -> Self {
        SamplerConfig {
            temperature: 0.0,
            ..Default::default()
        }
    }

    pub fn is_greedy(&self) -> bool {
        self.temperature <= 0.0
    }
}

pub struct Sampler {
    cfg: SamplerConfig,
    rng: ChaCha8Rng,
    recent: std::collections::VecDeque<u32>,
    candidates: Vec<(u32, f32)>,
    grammar: Option<TokenConstraint>,
}

impl Sampler {
    pub fn new(cfg: SamplerConfig) -> Sampler {
        let rng = ChaCha8Rng::seed_from_u64(cfg.seed);
        Sampler {
            cfg,
            rng,
            recent: Default::default(),
            candidates: Vec::new(),
            grammar: None,
        }
    }

    /// Draws only what `grammar` allows from now on (structured output).
    pub fn with_grammar(mut self, grammar: Option<TokenConstraint>) -> Sampler {
        self.grammar = grammar;
        self
    }

    pub fn config(&self) -> &SamplerConfig {
        &self.cfg
    }

    /// Records tokens the penalties should see (the prompt, then each sampled token).
    pub fn accept(&mut self, token: u32) {
        if self.cfg.repeat_last_n == 0 {
            return;
        }
        if self.recent.len() == self.cfg.repeat_last_n {
            self.recent.pop_front();
        }
        self.recent.push_back(token);
    }

    fn penalize(&self, logits: &mut [f32]) {
        let c = &self.cfg;
        if self.recent.is_empty()
            || (c.repeat_penalty == 1.0 && c.presence_penalty == 0.0 && c.frequency_penalty == 0.0)
        {
            return;
        }
        let mut counts: std::collections::HashMap<u32, u32> = std::collections::HashMap::new();
        for &t in &self.recent {
            *counts.entry(t).or_default() += 1;
        }
        for (&t, &n) in &counts {
            let Some(l) = logits.get_mut(t as usize) else {
                continue;
            };
            // llama.cpp: divide positive logits, multiply negative ones.
            if *l > 0.0 {
                *l /= c.repeat_penalty;
            } else {
                *l *= c.repeat_penalty;
            }
            *l -= n as f32 * c.frequency_penalty + c.presence_penalty;
        }
    }

    /// Picks the next token from `logits` (modified in place by the grammar's mask and the
    /// penalties) and advances the grammar past it.
    pub fn sample(&mut self, logits: &mut [f32]) -> Result<u32, GrammarError> {
        self.constrain(logits)?;
        let token = match self.distribution(logits) {
            None => argmax(logits),
            Some(weights) => {
                let total: f64 = weights.iter().sum();
                let r = self.rng.random::<f64>() * total;
                self.candidates[pick(&weights, r)].0
            }
        };
        self.commit(token)?;
        Ok(token)
    }

    /// Decides a drafted token at the position `logits` belong to (speculative decoding; the
    /// draft came from a source that proposes one token with certainty, such as prompt lookup
    /// or a greedy draft model): `draft` itself, or the token to emit instead, past which the
    /// grammar is advanced. Greedy: the argmax, so the output is the non-speculative one.
    /// Sampling: the draft is kept with probability `p(draft)` and otherwise a token is drawn
    /// from `p` without the draft, renormalized — the standard acceptance rule (Leviathan et
    /// al., 2023, for a point-mass draft distribution), under which every emitted token has
    /// exactly the distribution `sample` draws from.
    pub fn verify(&mut self, logits: &mut [f32], draft: u32) -> Result<u32, GrammarError> {
        self.constrain(logits)?;
        let token = match self.distribution(logits) {
            None => argmax(logits),
            Some(weights) => self.keep_or_replace(weights, draft),
        };
        self.commit(token)?;
        Ok(token)
    }

    /// The penalties, then the grammar's mask (after them: a zero repeat penalty would turn a
    /// masked −∞ into NaN).
    fn constrain(&mut self, logits: &mut [f32]) -> Result<(), GrammarError> {
        self.penalize(logits);
        if let Some(grammar) = &mut self.grammar {
            grammar.mask(logits)?;
        }
        Ok(())
    }

    fn commit(&mut self, token: u32) -> Result<(), GrammarError> {
        if let Some(grammar) = &mut self.grammar {
            grammar.commit(token)?;
        }
        Ok(())
    }

    /// The acceptance rule of [`Sampler::verify`] over the candidates' `weights`.
    fn keep_or_replace(&mut self, mut weights: Vec<f64>, draft: u32) -> u32 {
        let total: f64 = weights.iter().sum();
        let Some(d) = self.candidates.iter().position(|&(t, _)| t == draft) else {
            // Outside the kept candidates: probability 0, always rejected.
            let r = self.rng.random::<f64>() * total;
            return self.candidates[pick(&weights, r)].0;
        };
        if self.rng.random::<f64>() * total < weights[d] {
            return draft;
        }
        let rest = total - weights[d];
        weights[d] = 0.0;
        if rest <= 0.0 {
            return draft;
        }
        let r = self.rng.random::<f64>() * rest;
        self.candidates[pick(&weights, r)].0
    }

    /// Leaves in `self.candidates` the tokens the top-k → top-p → min-p chain keeps, and returns
    /// their weights (unnormalized probabilities at the temperature). `None`: greedy, or
    /// nothing finite to sample from; the caller takes the argmax.
    fn distribution(&mut self, logits: &[f32]) -> Option<Vec<f64>> {
        if self.cfg.is_greedy() {
            return None;
        }
        let c = &self.cfg;
        let cand = &mut self.candidates;
        cand.clear();
        cand.extend(
            logits
                .iter()
                .enumerate()
                .filter(|(_, l)| l.is_finite())
                .map(|(i, &l)| (i as u32, l)),
        );
        if cand.is_empty() {
            return None;
        }
        cand.sort_unstable_by(|a, b| b.1.total_cmp(&a.1).then(a.0.cmp(&b.0)));
        if c.top_k > 0 && c.top_k < cand.len() {
            cand.truncate(c.top_k);
        }
        // Probabilities at temperature 1 decide top-p and min-p, as llama.cpp's chain does.
        let max = cand[0].1;
        let mut probs: Vec<f32> = cand.iter().map(|&(_, l)| (l - max).exp()).collect();
        let sum: f32 = probs.iter().sum();
        probs.iter_mut().for_each(|p| *p /= sum);
        if c.top_p < 1.0 {
            let mut acc = 0.0;
            let mut keep = cand.len();
            for (i, p) in probs.iter().enumerate() {
                acc += p;
                if acc >= c.top_p {
                    keep = i + 1;
                    break;
                }
            }
            cand.truncate(keep);
            probs.truncate(keep);
        }
        if c.min_p > 0.0 {
            let floor = probs[0] * c.min_p;
            let keep = probs.iter().take_while(|&&p| p >= floor).count().max(1);
            cand.truncate(keep);
        }
        Some(
            cand.iter()
                .map(|&(_, l)| (((l - max) / c.temperature) as f64).exp())
                .collect(),
        )
    }
}

/// The index whose weight interval holds `r` (`0 ≤ r < Σ weights`); the last one of nonzero
/// weight when rounding leaves `r` past the end.
fn pick(weights: &[f64], mut r: f64) -> usize {
    for (i, w) in weights.iter().enumerate() {
        if r < *w {
            return i;
        }
        r -= w;
    }
    weights
        .iter()
        .rposition(|&w| w > 0.0)
        .unwrap_or(weights.len() - 1)
}

/// Index of the largest logit (the first one on ties).
pub fn argmax(logits: &[f32]) -> u32 {
    let mut best = 0;
    for (i, &l) in logits.iter().enumerate() {
        if l > logits[best] {
            best = i;
        }
    }
    best as u32
}

#[cfg(test)]
mod tests {
    use super::*;

    fn logits() -> Vec<f32> {
        vec![1.0, 3.0, 2.5, -1.0, 0.0, 2.9]
    }

    /// The acceptance rule keeps the sampler's distribution: over many draws, the tokens
    /// `verify` emits for a fixed draft have the frequencies `sample` would give, whether the
    /// draft is likely, unlikely or outside the candidates.
    #[test]
    fn verify_emits_tokens_with_the_sampling_distribution() {
        let cfg = SamplerConfig {
            temperature: 1.0,
            top_k: 0,
            top_p: 1.0,
            min_p: 0.0,
            ..Default::default()
        };
        let l = [1.0f32, 3.0, 2.5, -1.0, 0.0, f32::NEG_INFINITY];
        let max = 3.0f32;
        let w: Vec<f64> = l.iter().map(|&x| ((x - max) as f64).exp()).collect();
        let total: f64 = w.iter().sum();
        let trials = 40_000;
        for draft in [1u32, 3, 5] {
            let mut s = Sampler::new(SamplerConfig {
                seed: 7,
                ..cfg.clone()
            });
            let mut counts = [0usize; 6];
            let mut kept = 0;
            for _ in 0..trials {
                let t = s.verify(&mut l.clone(), draft).unwrap();
                counts[t as usize] += 1;
                kept += usize::from(t == draft);
            }
            for (t, &n) in counts.iter().enumerate() {
                let freq = n as f64 / trials as f64;
                let p = w[t] / total;
                assert!(
                    (freq - p).abs() < 0.01,
                    "draft {draft}: token {t} emitted with frequency {freq}, probability {p}"
                );
            }
            let p_draft = w[draft as usize] / total;
            assert!((kept as f64 / trials as f64 - p_draft).abs() < 0.01);
        }
    }

    #[test]
    fn greedy_verify_is_the_argmax() {
        let mut s = Sampler::new(SamplerConfig::greedy());
        assert_eq!(s.verify(&mut logits(), 1).unwrap(), 1);
        assert_eq!(s.verify(&mut logits(), 2).unwrap(), 1);
    }

    #[test]
    fn greedy_takes_the_argmax() {
        let mut s = Sampler::new(SamplerConfig::greedy());
        assert_eq!(s.sample(&mut logits()).unwrap(), 1);
    }

    #[test]
    fn same_seed_same_tokens_different_seed_differs() {
        let cfg = SamplerConfig {
            temperature: 1.5,
            top_k: 0,
            top_p: 1.0,
            min_p: 0.0,
            ..Default::default()
        };
        let draw = |seed| {
            let mut s = Sampler::new(SamplerConfig {
                seed,
                ..cfg.clone()
            });
            (0..64)
                .map(|_| s.sample(&mut logits()).unwrap())
                .collect::<Vec<_>>()
        };
        assert_eq!(draw(7), draw(7));
        assert_ne!(draw(7), draw(8));
    }

    #[test]
    fn top_k_one_is_greedy() {
        let mut s = Sampler::new(SamplerConfig {
            temperature: 1.0,
            top_k: 1,
            ..Default::default()
        });
        for _ in 0..20 {
            assert_eq!(s.sample(&mut logits()).unwrap(), 1);
        }
    }

    #[test]
    fn top_p_and_min_p_cut_the_tail() {
        // Probabilities ~ [0.5, 0.3, 0.2, tiny]: top_p 0.7 keeps the first two.
        let base = [0.5f32.ln(), 0.3f32.ln(), 0.2f32.ln(), -20.0];
        let mut s = Sampler::new(SamplerConfig {
            temperature: 1.0,
            top_k: 0,
            top_p: 0.7,
            min_p: 0.0,
            ..Default::default()
        });
        for _ in 0..200 {
            assert!(s.sample(&mut base.to_vec()).unwrap() < 2);
        }
        let mut s = Sampler::new(SamplerConfig {
            temperature: 1.0,
            top_k: 0,
            top_p: 1.0,
            min_p: 0.5,
            ..Default::default()
        });
        for _ in 0..200 {
            assert!(
                s.sample(&mut base.to_vec()).unwrap() < 2,
                "min_p 0.5 keeps p >= 0.25"
            );
        }
    }

    #[test]
    fn repetition_penalty_discourages_recent_tokens() {
        let mut s = Sampler::new(SamplerConfig {
            repeat_penalty: 10.0,
            ..SamplerConfig::greedy()
        });
        s.accept(1);
        assert_eq!(
            s.sample(&mut logits()).unwrap(),
            5,
            "token 1 penalized, 2.9 wins"
        );
        let mut s = Sampler::new(SamplerConfig {
            presence_penalty: 1.0,
            ..SamplerConfig::greedy()
        });
        s.accept(1);
        s.accept(5);
        assert_eq!(s.sample(&mut logits()).unwrap(), 2);
    }
}
