//! What a step sends the device first, written into the page-locked input buffer: every
//! layer's matmul tables and the head's, the dense layers' activation tables, the embedded
//! rows, the RoPE tables and the per-row arrays (positions, cache addresses, head rows, the
//! weighted sum's slot offsets). The launches that read them are step.rs's.

use cudarc::driver::DevicePtr;
use kernels::ActKind;
use model::SeqInput;
use model::blocks::rope::RopeTable;

use super::{DevFfn, DevMat, InputLayout, Mirror, Offsets, ResidentModel};
use crate::matmul_table::{GLU_FIELDS, Grids, JOB_FIELDS, MatRecord, write_matmul_table};

pub(super) fn put<T: Copy>(buf: &mut [u8], at: usize, values: &[T]) {
    // SAFETY: T is a plain number type (u32, u64, f32); the bytes are copied as they are.
    let bytes = unsafe {
        std::slice::from_raw_parts(values.as_ptr() as *const u8, std::mem::size_of_val(values))
    };
    buf[at..at + bytes.len()].copy_from_slice(bytes);
}

/// One layer's tables: offsets in the input and the grids their launches take.
pub(super) struct LayerTables {
    pub(super) qkv: (usize, Grids),
    pub(super) o: (usize, Grids),
    /// The router's, or the dense gate and up projections'.
    pub(super) first: (usize, Grids),
    pub(super) down: (usize, Grids),
    /// The dense activation's table.
    pub(super) glu: usize,
}

pub(super) struct StepInput {
    pub(super) layers: Vec<LayerTables>,
    pub(super) head: (usize, Grids),
    /// The residual stream's device address: where the embedded rows are copied in (every
    /// layer adds into it in place).
    pub(super) x_dev: u64,
}

/// The sequences of a step and where their caches are mirrored.
pub(super) struct StepRows<'a, 'k> {
    pub(super) x: &'a [f32],
    pub(super) seqs: &'a [SeqInput<'k>],
    pub(super) pos0: &'a [usize],
    pub(super) rope: &'a RopeTable,
    pub(super) logit_rows: &'a [usize],
    pub(super) mirrors: &'a [Mirror],
    /// Each sequence's mirror in `mirrors`.
    pub(super) mirror_of: &'a [usize],
}

impl ResidentModel {
    /// Writes the input of a step of `rows` into `host_in` as `il` lays it out, its tables
    /// naming the arena at `base` (laid out as `o`) and built for tensor cores from `mma_min`
    /// tokens a job.
    pub(super) fn write_step_input(
        &self,
        host_in: &mut [u8],
        il: &InputLayout,
        o: &Offsets,
        base: u64,
        rows: &StepRows,
        mma_min: usize,
    ) -> model::Result<StepInput> {
        let StepRows {
            x,
            seqs,
            pos0,
            rope,
            logit_rows,
            mirrors,
            mirror_of,
        } = *rows;
        let n = x.len() / self.d;
        let n_layers = self.layers.len();
        let m_rows = logit_rows.len();
        let at = |off: usize| base + off as u64;
        let half = self.n_rot / 2;
        put(host_in, il.x, x);
        let x_dev = at(o.input) + il.x as u64;
        let (_, cos, sin) = rope.tables();
        put(host_in, il.cos, &cos[..n * half]);
        put(host_in, il.sin, &sin[..n * half]);
        let (mut row_pos, mut row_k, mut row_v, mut row_stride) =
            (Vec::with_capacity(n), Vec::new(), Vec::new(), Vec::new());
        for ((s, &p0), &mi) in seqs.iter().zip(pos0).zip(mirror_of) {
            let m = &mirrors[mi];
            let (kp, vp) = (
                m.k.device_ptr(&self.stream).0,
                m.v.device_ptr(&self.stream).0,
            );
            for i in 0..s.n_tokens {
                row_pos.push((p0 + i) as u32);
                row_k.push(kp);
                row_v.push(vp);
                row_stride.push(m.capacity as u64);
            }
        }
        put(host_in, il.pos, &row_pos);
        put(host_in, il.row_k, &row_k);
        put(host_in, il.row_v, &row_v);
        put(host_in, il.row_stride, &row_stride);
        let head_rows: Vec<u32> = logit_rows.iter().map(|&r| r as u32).collect();
        put(host_in, il.head_rows, &head_rows);
        // The weighted sum's slot offsets: row t's k slots start at t·k.
        let slot_offsets: Vec<u32> = (0..=n).map(|t| (t * self.max_k) as u32).collect();
        put(host_in, il.slot_offsets, &slot_offsets);

        // The quantized forms of a normed row a matrix reads.
        let acts_of = |m: &DevMat, f32_at: usize, q8k_at: usize, q80_at: usize| match m.act {
            ActKind::F32 => at(f32_at),
            ActKind::Q8K => at(q8k_at),
            ActKind::Q8_0 => at(q80_at),
        };
        let record = |m: &DevMat, acts: u64, out: u64, rows_n: usize, accumulate: bool| MatRecord {
            w: m.addr,
            acts,
            out,
            weights: m.key,
            act_stride: m.act_bytes,
            n: rows_n,
            accumulate,
        };
        let mut layers = Vec::with_capacity(n_layers);
        let mut cursor = 0usize;
        let mut write =
            |host_in: &mut [u8], records: &[MatRecord]| -> model::Result<(usize, Grids)> {
                let here = cursor;
                let grid = write_matmul_table(&mut host_in[here..], records, mma_min)
                    .ok_or_else(|| self.error("resident step", "too many blocks for one launch"))?;
                cursor += records.len() * JOB_FIELDS * 8;
                Ok((here, grid))
            };
        for l in &self.layers {
            let hn = |m: &DevMat| acts_of(m, o.hn, o.hq8k, o.hq80);
            let qkv = write(
                host_in,
                &[
                    record(&l.q, hn(&l.q), at(o.q), n, false),
                    record(&l.k, hn(&l.k), at(o.k), n, false),
                    record(&l.v, hn(&l.v), at(o.v), n, false),
                ],
            )?;
            let oo = write(
                host_in,
                &[record(
                    &l.o,
                    acts_of(&l.o, o.att, o.att_q8k, o.att_q80),
                    x_dev,
                    n,
                    true,
                )],
            )?;
            let (first, down) = match &l.ffn {
                DevFfn::Moe { router, .. } => (
                    write(
                        host_in,
                        &[record(router, hn(router), at(o.router_logits), n, false)],
                    )?,
                    (0, Grids::default()),
                ),
                DevFfn::Dense { gate, up, down } => (
                    write(
                        host_in,
                        &[
                            record(gate, hn(gate), at(o.gate_out), n, false),
                            record(up, hn(up), at(o.up_out), n, false),
                        ],
                    )?,
                    write(host_in, &[record(down, at(o.hidden), x_dev, n, true)])?,
                ),
            };
            layers.push(LayerTables {
                qkv,
                o: oo,
                first,
                down,
                glu: 0,
            });
        }
        let head = write(
            host_in,
            &[record(
                &self.output,
                acts_of(&self.output, o.hn, o.hq8k, o.hq80),
                at(o.logits),
                m_rows,
                false,
            )],
        )?;
        // The dense layers' activation tables.
        let mut glu_cursor = n_layers * 7 * JOB_FIELDS * 8 + JOB_FIELDS * 8;
        debug_assert!(cursor <= glu_cursor);
        for (l, t) in self.layers.iter().zip(layers.iter_mut()) {
            if let DevFfn::Dense { gate, down, .. } = &l.ffn {
                let fields: [u64; GLU_FIELDS] = [
                    at(o.gate_out),
                    at(o.up_out),
                    at(o.hidden),
                    gate.rows as u64,
                    down.act.ggml_type() as u64,
                    0,
                    n as u64,
                ];
                put(host_in, glu_cursor, &fields);
                t.glu = glu_cursor;
                glu_cursor += GLU_FIELDS * 8;
            }
        }
        Ok(StepInput {
            layers,
            head,
            x_dev,
        })
    }
}
