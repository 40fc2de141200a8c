//! An inclusive range of a model's layers, and whether the output head comes with it: what a
//! pipeline stage runs (`--layers 0:19`, `20:output`) and what a runner's KV cache covers.

use std::fmt;
use std::ops::RangeInclusive;

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct LayerRange {
    pub first: usize,
    pub last: usize,
    /// The output norm and head run after `last` (then `last` is the model's last layer).
    pub head: bool,
}

impl LayerRange {
    /// Every layer of a model of `n_layer` layers, and the head.
    pub fn whole(n_layer: usize) -> LayerRange {
        LayerRange {
            first: 0,
            last: n_layer.saturating_sub(1),
            head: true,
        }
    }

    pub fn layers(&self) -> RangeInclusive<usize> {
        self.first..=self.last
    }

    /// Number of layers (at least one).
    pub fn n_layers(&self) -> usize {
        self.last + 1 - self.first
    }

    pub fn contains(&self, layer: usize) -> bool {
        self.layers().contains(&layer)
    }

    /// Parses `A:B` or `A:output` against a model of `n_layer` layers.
    pub fn parse(s: &str, n_layer: usize) -> Result<LayerRange, String> {
        s.parse::<RangeSpec>()?.resolve(n_layer)
    }
}

/// A layer range as written on the command line, before the model says how many layers there
/// are (`A:B` or `A:output`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RangeSpec {
    pub first: usize,
    /// `None`: up to the last layer, with the head (`A:output`).
    pub last: Option<usize>,
}

impl std::str::FromStr for RangeSpec {
    type Err = String;

    fn from_str(s: &str) -> Result<RangeSpec, String> {
        let (a, b) = s
            .split_once(':')
            .ok_or_else(|| format!("layer range {s:?}: expected A:B or A:output"))?;
        let first = a
            .trim()
            .parse()
            .map_err(|_| format!("layer range {s:?}: {a:?} is not a layer number"))?;
        let last = match b.trim() {
            "output" => None,
            x => Some(x.parse::<usize>().map_err(|_| {
                format!("layer range {s:?}: {x:?} is not a layer number or `output`")
            })?),
        };
        if last.is_some_and(|l| l < first) {
            return Err(format!(
                "layer range {s:?}: the last layer comes before the first"
            ));
        }
        Ok(RangeSpec { first, last })
    }
}

impl RangeSpec {
    /// The range in a model of `n_layer` layers.
    pub fn resolve(&self, n_layer: usize) -> Result<LayerRange, String> {
        let (last, head) = match self.last {
            None => (
                n_layer.checked_sub(1).ok_or("the model has no layers")?,
                true,
            ),
            Some(l) => (l, false),
        };
        let r = LayerRange {
            first: self.first,
            last,
            head,
        };
        if r.first > r.last || r.last >= n_layer {
            return Err(format!(
                "layer range {r} is invalid for a model of {n_layer} layers (0..={})",
                n_layer.saturating_sub(1)
            ));
        }
        Ok(r)
    }
}

/// `first:last`, or `first:output` when the range holds the head.
impl fmt::Display for LayerRange {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.head {
            write!(f, "{}:output", self.first)
        } else {
            write!(f, "{}:{}", self.first, self.last)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::LayerRange;

    #[test]
    fn parses_and_prints_ranges() {
        let r = LayerRange::parse("4:output", 16).unwrap();
        assert_eq!((r.first, r.last, r.head, r.n_layers()), (4, 15, true, 12));
        assert_eq!(r.to_string(), "4:output");
        assert_eq!(LayerRange::parse(" 0 : 7", 16).unwrap().to_string(), "0:7");
        for bad in ["7", "a:3", "3:b", "5:4", "0:16", "x:output"] {
            assert!(LayerRange::parse(bad, 16).is_err(), "{bad}");
        }
        assert!(LayerRange::parse("0:output", 0).is_err());
    }
}
