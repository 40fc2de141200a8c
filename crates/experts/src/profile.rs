//! Routing profiles: how often each (layer, expert) was routed over some run, saved as text
//! (`--save-expert-profile`) and read back to preload the hottest experts and seed the cache's
//! hotness. Tied to the model by its fingerprint.
//!
//! ```text
//! moeshard-expert-profile 1
//! model <fingerprint>
//! shape <n_layer> <n_expert>
//! steps <passes through the layers recorded>
//! <layer> <expert> <count>      (one line per routed expert, zero counts omitted)
//! ```

use std::fmt::Write as _;
use std::path::Path;

use crate::error::{Result, StreamError};

const MAGIC: &str = "moeshard-expert-profile 1";

#[derive(Clone, Debug, PartialEq)]
pub struct Profile {
    pub fingerprint: String,
    pub n_layer: usize,
    pub n_expert: usize,
    /// Passes through the layers the counts were gathered over.
    pub steps: u64,
    /// `counts[layer * n_expert + expert]`.
    pub counts: Vec<u64>,
}

impl Profile {
    pub fn new(fingerprint: &str, n_layer: usize, n_expert: usize) -> Profile {
        Profile {
            fingerprint: fingerprint.to_string(),
            n_layer,
            n_expert,
            steps: 0,
            counts: vec![0; n_layer * n_expert],
        }
    }

    pub fn count(&self, layer: usize, expert: usize) -> u64 {
        self.counts[layer * self.n_expert + expert]
    }

    /// (layer, expert) pairs with a count, hottest first (ties by layer, then expert).
    pub fn hottest(&self) -> Vec<(usize, usize)> {
        let mut v: Vec<(usize, usize)> = (0..self.counts.len())
            .filter(|&i| self.counts[i] > 0)
            .map(|i| (i / self.n_expert, i % self.n_expert))
            .collect();
        v.sort_by_key(|&(l, e)| (std::cmp::Reverse(self.count(l, e)), l, e));
        v
    }

    pub fn to_text(&self) -> String {
        let mut s = format!(
            "{MAGIC}\nmodel {}\nshape {} {}\nsteps {}\n",
            self.fingerprint, self.n_layer, self.n_expert, self.steps
        );
        for (i, &c) in self.counts.iter().enumerate() {
            if c > 0 {
                let _ = writeln!(s, "{} {} {c}", i / self.n_expert, i % self.n_expert);
            }
        }
        s
    }

    pub fn save(&self, path: &Path) -> Result<()> {
        let tmp = path.with_extension("tmp");
        std::fs::write(&tmp, self.to_text())
            .and_then(|_| std::fs::rename(&tmp, path))
            .map_err(|e| StreamError::Profile {
                path: path.to_path_buf(),
                detail: e.to_string(),
            })
    }

    /// Reads a profile and checks that it is of the model with `fingerprint`.
    pub fn load(path: &Path, fingerprint: &str) -> Result<Profile> {
        let bad = |detail: String| StreamError::Profile {
            path: path.to_path_buf(),
            detail,
        };
        let text = std::fs::read_to_string(path).map_err(|e| bad(e.to_string()))?;
        let p = Profile::parse(&text).map_err(bad)?;
        if p.fingerprint != fingerprint {
            return Err(bad(format!(
                "made for model {}, this is {fingerprint}",
                p.fingerprint
            )));
        }
        Ok(p)
    }

    pub fn parse(text: &str) -> std::result::Result<Profile, String> {
        let mut lines = text.lines().enumerate();
        let mut next = |what: &str| {
            lines
                .next()
                .map(|(_, l)| l.trim().to_string())
                .ok_or_else(|| format!("missing {what}"))
        };
        if next("header")? != MAGIC {
            return Err(format!("not a profile (first line is not {MAGIC:?})"));
        }
        let model = next("model line")?;
        let fingerprint = model
            .strip_prefix("model ")
            .ok_or("second line must be `model <fingerprint>`")?
            .to_string();
        let shape = next("shape line")?;
        let dims: Vec<usize> = shape
            .strip_prefix("shape ")
            .ok_or("third line must be `shape <n_layer> <n_expert>`")?
            .split_whitespace()
            .map(|x| x.parse().map_err(|_| format!("bad shape {shape:?}")))
            .collect::<std::result::Result<_, _>>()?;
        let [n_layer, n_expert] = dims[..] else {
            return Err(format!("bad shape {shape:?}"));
        };
        let steps_line = next("steps line")?;
        let steps = steps_line
            .strip_prefix("steps ")
            .and_then(|s| s.parse().ok())
            .ok_or_else(|| format!("bad steps line {steps_line:?}"))?;
        let mut p = Profile::new(&fingerprint, n_layer, n_expert);
        p.steps = steps;
        for (i, line) in lines {
            let line = line.trim();
            if line.is_empty() {
                continue;
            }
            let f: Vec<u64> = line
                .split_whitespace()
                .map(|x| x.parse().map_err(|_| format!("line {}: {line:?}", i + 1)))
                .collect::<std::result::Result<_, _>>()?;
            let [l, e, c] = f[..] else {
                return Err(format!("line {}: expected `layer expert count`", i + 1));
            };
            let (l, e) = (l as usize, e as usize);
            if l >= n_layer || e >= n_expert {
                return Err(format!(
                    "line {}: expert {e} of layer {l} is outside the shape",
                    i + 1
                ));
            }
            p.counts[l * n_expert + e] = c;
        }
        Ok(p)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn round_trips_and_orders_hottest_first() {
        let mut p = Profile::new("abc", 2, 3);
        p.steps = 7;
        p.counts = vec![0, 5, 1, 5, 0, 9];
        let q = Profile::parse(&p.to_text()).unwrap();
        assert_eq!(p, q);
        assert_eq!(q.hottest(), vec![(1, 2), (0, 1), (1, 0), (0, 2)]);
        assert!(Profile::parse("nope").is_err());
        assert!(Profile::parse(&p.to_text().replace("1 2 9", "4 2 9")).is_err());
    }
}
