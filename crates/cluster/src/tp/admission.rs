//! Which ranks a tensor-parallel coordinator admits: ranks of the same model with at least its
//! context, each at a free rank number (the one asked for, or the lowest free one), whose
//! shard file (if it is one) holds the experts that rank computes.

use std::ops::Range;
use std::sync::Arc;

use crate::registry::{Admission, Member, check_peer};
use crate::wire::{Hello, Role, Welcome};

/// A registered rank; its claim is its rank number.
pub type RankLink = Member<usize>;

pub struct RankAdmission {
    pub fingerprint: String,
    pub n_ctx: usize,
    pub n_ranks: usize,
    /// The routed experts each rank computes (`--expert-weights`, `--tp-balance-experts`).
    pub needed: Vec<Range<usize>>,
    /// How the placement was chosen, for refusals (`--tp-size 3, --expert-weights 2,1,1`).
    pub placement: String,
}

impl RankAdmission {
    fn free(&self, r: usize, members: &[Arc<RankLink>]) -> bool {
        r >= 1 && r < self.n_ranks && !members.iter().any(|m| m.claim == r)
    }
}

impl Admission for RankAdmission {
    type Claim = usize;

    fn claim(&self, hello: &Hello, members: &[Arc<RankLink>]) -> Result<usize, String> {
        let Role::Rank { rank, ref held, .. } = hello.role else {
            return Err(
                "this coordinator runs a tensor-parallel group; the peer is not a rank".into(),
            );
        };
        check_peer(hello, &self.fingerprint, self.n_ctx)?;
        let rank = match rank {
            Some(r) if self.free(r as usize, members) => Ok(r as usize),
            Some(r) => Err(format!(
                "rank {r} is taken or outside 1..{} (--tp-size {})",
                self.n_ranks, self.n_ranks
            )),
            None => (1..self.n_ranks)
                .find(|&r| self.free(r, members))
                .ok_or_else(|| format!("the group already has its {} ranks", self.n_ranks)),
        }?;
        if let (Some(h), Some(need)) = (held, self.needed.get(rank)) {
            let holds = h.first as usize <= need.start && need.end <= h.end as usize;
            if !holds && !need.is_empty() {
                return Err(format!(
                    "wrong shard file for rank {rank}: {} holds experts {}..{}, rank {rank} of this \
                     group computes experts {}..{} ({})",
                    h.file, h.first, h.end, need.start, need.end, self.placement
                ));
            }
        }
        Ok(rank)
    }

    fn conflict(&self, rank: &usize, members: &[Arc<RankLink>]) -> Option<String> {
        (!self.free(*rank, members)).then(|| format!("rank {rank} was taken meanwhile"))
    }

    fn welcome(&self, rank: &usize) -> Welcome {
        Welcome {
            message: format!("rank {rank} of {}", self.n_ranks),
            rank: Some(*rank as u32),
            group_size: Some(self.n_ranks as u32),
            ..Welcome::default()
        }
    }

    fn describe(rank: &usize) -> String {
        format!("rank {rank}")
    }
}
