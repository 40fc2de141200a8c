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
        self.penalize(logits);
        // Masked after the penalties: a zero repeat penalty would turn a masked −∞ into NaN.
        if let Some(grammar) = &mut self.grammar {
            grammar.mask(logits)?;
        }
        let token = self.choose(logits);
        if let Some(grammar) = &mut self.grammar {
            grammar.commit(token)?;
        }
        Ok(token)
    }

    /// Greedy or the top-k → top-p → min-p → temperature chain over `logits`.
    fn choose(&mut self, logits: &[f32]) -> u32 {
        if self.cfg.is_greedy() {
            return argmax(logits);
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
            return argmax(logits);
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
        let weights: Vec<f64> = cand
            .iter()
            .map(|&(_, l)| (((l - max) / c.temperature) as f64).exp())
            .collect();
        let total: f64 = weights.iter().sum();
        let mut r = self.rng.random::<f64>() * total;
        for (i, w) in weights.iter().enumerate() {
            if r < *w {
                return cand[i].0;
            }
            r -= w;
        }
        cand[cand.len() - 1].0
    }
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
