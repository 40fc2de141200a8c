//! DeepSeek V4's compressors: every `ratio` positions pool into one row (a softmax over the
//! window's scores per value, RMSNorm, rope at the window's first position), from inputs the KV
//! cache keeps until their windows are complete.

use super::rope_tail;
use crate::Model;
use crate::blocks::norm;
use crate::blocks::rope::RopeTable;
use crate::error::Result;
use crate::kv::{KvCache, Pool};
use crate::pass::SeqInput;
use crate::weights::Compressor;

impl Model {
    /// Appends compressor `c`'s inputs (`kv` and `score` rows of the batch's new positions,
    /// the score before `ape`) and makes the rows of the windows they complete.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn dsv4_compress(
        &self,
        c: &Compressor,
        il: usize,
        pool: Pool,
        kv: Vec<f32>,
        mut score: Vec<f32>,
        seqs: &mut [SeqInput],
        pos0: &[usize],
    ) -> Result<()> {
        let p = self.hp.dsv4.as_ref().expect("deepseek4 hparams");
        let w_in = c.kv.rows;
        let mut row0 = 0;
        for (s, &p0) in seqs.iter_mut().zip(pos0) {
            for i in 0..s.n_tokens {
                let ape = &c.ape[((p0 + i) % c.ratio) * w_in..((p0 + i) % c.ratio + 1) * w_in];
                let r = &mut score[(row0 + i) * w_in..(row0 + i + 1) * w_in];
                for (v, &b) in r.iter_mut().zip(ape) {
                    *v += b;
                }
            }
            let rows = row0 * w_in..(row0 + s.n_tokens) * w_in;
            s.kv.push_pool_inputs(il, pool, p0, &kv[rows.clone()], &score[rows])?;
            // Windows complete at the end of this batch and not yet made.
            let end = p0 + s.n_tokens;
            let made = s.kv.pool_rows(il, pool)?.len() / c.width;
            for w in made..end / c.ratio {
                let row = self.dsv4_pool_row(c, s.kv, il, pool, w, &p.compress_rope)?;
                s.kv.push_pool_row(il, pool, &row)?;
            }
            row0 += s.n_tokens;
        }
        Ok(())
    }

    /// The compressed row of window `w`: per value a softmax over the window's scores (ratio
    /// 4: the previous window's first halves and this window's second halves), the weighted
    /// sum, RMSNorm, RoPE at the window's first position.
    fn dsv4_pool_row(
        &self,
        c: &Compressor,
        kv: &KvCache,
        il: usize,
        pool: Pool,
        w: usize,
        rope: &crate::hparams::RopeParams,
    ) -> Result<Vec<f32>> {
        let (ratio, width) = (c.ratio, c.width);
        let w_in = c.kv.rows;
        // (kv, score, offset into the input row) of every slot.
        let mut slots: Vec<(&[f32], &[f32])> = Vec::with_capacity(2 * ratio);
        let cur = kv.pool_inputs(il, pool, w * ratio..(w + 1) * ratio)?;
        let prev = if c.overlap && w > 0 {
            Some(kv.pool_inputs(il, pool, (w - 1) * ratio..w * ratio)?)
        } else {
            None
        };
        if let Some((pk, ps)) = prev {
            for j in 0..ratio {
                slots.push((
                    &pk[j * w_in..j * w_in + width],
                    &ps[j * w_in..j * w_in + width],
                ));
            }
        }
        let half = if c.overlap { width } else { 0 };
        for j in 0..ratio {
            slots.push((
                &cur.0[j * w_in + half..j * w_in + half + width],
                &cur.1[j * w_in + half..j * w_in + half + width],
            ));
        }
        let mut pooled = vec![0f32; width];
        for (i, o) in pooled.iter_mut().enumerate() {
            let max = slots
                .iter()
                .map(|(_, s)| s[i])
                .fold(f32::NEG_INFINITY, f32::max);
            let mut sum = 0f32;
            let mut acc = 0f32;
            for (k, s) in &slots {
                let e = (s[i] - max).exp();
                sum += e;
                acc += e * k[i];
            }
            *o = acc / sum;
        }
        let mut row = vec![0f32; width];
        norm::rms_norm(&pooled, &c.norm, self.hp.rms_eps, &mut row);
        let table = RopeTable::new(rope, None, &[w * ratio]);
        let n_rot = self.hp.rope.n_rot;
        rope_tail(&table, 0, &mut row, width, n_rot, false);
        Ok(row)
    }
}
