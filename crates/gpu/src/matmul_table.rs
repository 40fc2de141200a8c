//! The job tables the matmul kernels read (matmul.cu's layout: one record of JOB_FIELDS u64s
//! per matrix product) and the grids that cover them: which jobs take the tensor-core path and
//! how many blocks each is cut into.

/// As in matmul.cu.
pub(crate) const JOB_FIELDS: usize = 12;
pub(crate) const GLU_FIELDS: usize = 7;
pub(crate) const ROWS_PER_BLOCK: usize = 4;
pub(crate) const TOKENS_PER_TILE: usize = 8;
pub(crate) const THREADS_PER_BLOCK: u32 = 32 * ROWS_PER_BLOCK as u32;
/// The tensor-core path's block tile (matmul.cu `MMA_*`): K-quant jobs of `mma_min` or more
/// tokens run as blocks of MMA_ROWS weight rows × MMA_TOKENS tokens.
pub(crate) const MMA_ROWS: usize = 64;
pub(crate) const MMA_TOKENS: usize = 32;
/// The fewest tokens of a job on the tensor cores, in steps of MMA_STEP_MIN_ROWS or more rows.
/// A 512-row step of qwen3-30b-a3b took 65.1 ms on an H100 with 4, 67.5 with 8 and 72.5–73.1
/// with 16 (docs/perf.md).
const MMA_MIN_TOKENS: usize = 4;
/// Steps of fewer rows (decode, batched decode) keep every job on the dp4a kernels: their
/// expert tables are built on the device, so a tensor-core grid would be launched for jobs
/// that may not exist, and an idle grid costs about as much as a small matmul (launched in
/// every decode layer, tg64 went 236 -> 197 t/s on an H100).
const MMA_STEP_MIN_ROWS: usize = 16;
/// A threshold no job reaches.
pub(crate) const MMA_NEVER: usize = i32::MAX as usize;
/// The most blocks a matmul launch asks for: its blocks stride over a table's, so more only
/// queue behind the resident ones (16 per SM on current parts) and cost their start.
pub(crate) const MATMUL_GRID_CAP: u32 = 4096;

/// The fewest tokens a job runs on the tensor cores with: MMA_MIN_TOKENS, `MOESHARD_GPU_MMA=N`
/// for another threshold (N ≥ 1), or never with `MOESHARD_GPU_MMA=0` (to compare against the
/// dp4a path).
fn mma_min_tokens() -> usize {
    static MIN: std::sync::OnceLock<usize> = std::sync::OnceLock::new();
    *MIN.get_or_init(
        || match std::env::var("MOESHARD_GPU_MMA").map(|v| v.parse::<usize>()) {
            Ok(Ok(0)) => MMA_NEVER,
            Ok(Ok(n)) => n.min(MMA_NEVER),
            _ => MMA_MIN_TOKENS,
        },
    )
}

/// The tensor-core threshold of a step (or batch) of `rows` rows: every launch reading its
/// tables, and every table's numbering, take the same (the kernels' `mma_min` argument).
pub(crate) fn step_mma_min(rows: usize) -> usize {
    if rows >= MMA_STEP_MIN_ROWS {
        mma_min_tokens()
    } else {
        MMA_NEVER
    }
}

/// Positions of a sequence that one block of the decode attention kernels takes (resident.cu
/// `SPLIT_POSITIONS`): 64, or `MOESHARD_GPU_SPLIT_POSITIONS` at 32 or 128 (256 overflows
/// `attention_grouped`'s shared memory). 64 was the fastest on an H100 at every depth measured
/// (tg64 at 0 / 2048 / 4096 positions: 267.64 / 213.47 / 202.67 t/s, against 266.84 / 209.70 /
/// 198.44 at 128 and 261.89 / 209.57 / 177.09 at 32). Read once: the kernels are compiled with
/// it and the splits' buffers sized by it.
pub(crate) fn attention_split_positions() -> usize {
    static SPLIT: std::sync::OnceLock<usize> = std::sync::OnceLock::new();
    *SPLIT.get_or_init(|| {
        std::env::var("MOESHARD_GPU_SPLIT_POSITIONS")
            .ok()
            .and_then(|v| v.parse::<usize>().ok())
            .filter(|v| [32, 64, 128].contains(v))
            .unwrap_or(64)
    })
}

/// The kernels' compile-time choices, as NVRTC options, for measuring them on other devices:
/// the blocks an SM must hold of the tensor-core kernel (`MOESHARD_GPU_MMA_BLOCKS`, 1–8,
/// default 4), of `matmul_one` (`MOESHARD_GPU_ONE_BLOCKS`, 1–16, default 9) and of
/// `matmul_grouped` (`MOESHARD_GPU_GROUPED_BLOCKS`, 1–16, default 6), which set their register
/// budgets; the decode attention's positions a block (`attention_split_positions`), whether
/// float rows of one token take a block each (`float_row_blocks`), and whether the split
/// attention batches its key and value loads and fences once a block
/// (`MOESHARD_GPU_ATTN_BATCHED`, default 1).
pub(crate) fn kernel_compile_options() -> Vec<String> {
    let number = |var: &str, range: std::ops::RangeInclusive<usize>, default: usize| {
        std::env::var(var)
            .ok()
            .and_then(|v| v.parse::<usize>().ok())
            .filter(|v| range.contains(v))
            .unwrap_or(default)
    };
    vec![
        format!(
            "-DMMA_MIN_BLOCKS={}",
            number("MOESHARD_GPU_MMA_BLOCKS", 1..=8, 4)
        ),
        format!(
            "-DONE_MIN_BLOCKS={}",
            number("MOESHARD_GPU_ONE_BLOCKS", 1..=16, 9)
        ),
        format!(
            "-DGROUPED_MIN_BLOCKS={}",
            number("MOESHARD_GPU_GROUPED_BLOCKS", 1..=16, 6)
        ),
        format!("-DSPLIT_POSITIONS={}", attention_split_positions()),
        format!("-DFLOAT_ROW_BLOCKS={}", u8::from(float_row_blocks())),
        format!(
            "-DATTN_BATCHED={}",
            u8::from(std::env::var("MOESHARD_GPU_ATTN_BATCHED").map_or(true, |v| v != "0"))
        ),
    ]
}

/// Whether a job of `n` tokens over `dtype` (a ggml type id) runs on the tensor cores.
pub(crate) fn mma_path(dtype: u64, n: usize, mma_min: usize) -> bool {
    use gguf::GgmlType;
    n >= mma_min
        && [GgmlType::Q4K, GgmlType::Q5K, GgmlType::Q6K]
            .iter()
            .any(|&t| t as u64 == dtype)
}

/// Whether one-token jobs against float weights (F32, F16, BF16: routers) take a block per
/// row (matmul.cu `float_row_block`), unless `MOESHARD_GPU_FLOAT_ROW_BLOCKS=0` (a warp per row,
/// four rows a block, as the quantized formats). Read once: the kernels are compiled with it.
pub(crate) fn float_row_blocks() -> bool {
    static ON: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *ON.get_or_init(|| std::env::var("MOESHARD_GPU_FLOAT_ROW_BLOCKS").map_or(true, |v| v != "0"))
}

/// Whether `dtype` (a ggml type id) is F32, F16 or BF16 (matmul.cu `float_row_job`'s types).
fn is_float(dtype: u64) -> bool {
    use gguf::GgmlType;
    [GgmlType::F32, GgmlType::F16, GgmlType::Bf16]
        .iter()
        .any(|&t| t as u64 == dtype)
}

/// A job's blocks, as matmul.cu's `job_blocks` numbers them.
pub(crate) fn job_blocks(rows: usize, n: usize, dtype: u64, mma_min: usize) -> usize {
    if mma_path(dtype, n, mma_min) {
        rows.div_ceil(MMA_ROWS) * n.div_ceil(MMA_TOKENS)
    } else if n == 1 && is_float(dtype) && float_row_blocks() {
        rows
    } else {
        rows.div_ceil(ROWS_PER_BLOCK) * n.div_ceil(TOKENS_PER_TILE)
    }
}

/// The launches of one matmul table: the grid of the dp4a kernel (`matmul_grouped`) and of
/// the tensor-core one (`matmul_mma`), 0 where no job takes that path.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub(crate) struct Grids {
    pub(crate) dp4a: u32,
    pub(crate) mma: u32,
}

impl Grids {
    /// For a table whose jobs' blocks number at most `blocks`, with tensor-core jobs possible
    /// or not (tables the device builds itself, whose token counts the host does not know).
    pub(crate) fn bound(blocks: usize, mma: bool) -> Grids {
        let grid = blocks.min(MATMUL_GRID_CAP as usize) as u32;
        Grids {
            dp4a: grid,
            mma: if mma { grid } else { 0 },
        }
    }

    pub(crate) fn is_empty(&self) -> bool {
        self.dp4a == 0 && self.mma == 0
    }
}

/// One matrix product as `matmul_grouped` reads it (device addresses).
pub(crate) struct MatRecord {
    pub(crate) w: u64,
    pub(crate) acts: u64,
    pub(crate) out: u64,
    pub(crate) weights: (usize, usize, usize, u64), // row stride, rows, cols, ggml type
    pub(crate) act_stride: usize,
    pub(crate) n: usize,
    /// Adds to the output instead of writing it.
    pub(crate) accumulate: bool,
}

/// Writes `records` as a matmul table at `table` and returns the grids that run it (None when
/// its jobs have more blocks than a u32 counts); the launches must pass the same `mma_min`.
pub(crate) fn write_matmul_table(
    table: &mut [u8],
    records: &[MatRecord],
    mma_min: usize,
) -> Option<Grids> {
    let mut first_block = 0u64;
    let (mut any_dp4a, mut any_mma) = (false, false);
    for (i, r) in records.iter().enumerate() {
        let (stride, rows, cols, dtype) = r.weights;
        let fields: [u64; JOB_FIELDS] = [
            r.w,
            r.acts,
            r.out,
            stride as u64,
            r.act_stride as u64,
            rows as u64,
            cols as u64,
            r.n as u64,
            dtype,
            first_block,
            0,
            r.accumulate as u64,
        ];
        for (k, v) in fields.iter().enumerate() {
            let at = (i * JOB_FIELDS + k) * 8;
            table[at..at + 8].copy_from_slice(&v.to_le_bytes());
        }
        let blocks = job_blocks(rows, r.n, dtype, mma_min);
        if blocks > 0 {
            if mma_path(dtype, r.n, mma_min) {
                any_mma = true;
            } else {
                any_dp4a = true;
            }
        }
        first_block += blocks as u64;
    }
    let total = u32::try_from(first_block).ok()?;
    let grid = total.min(MATMUL_GRID_CAP);
    Some(Grids {
        dp4a: if any_dp4a { grid } else { 0 },
        mma: if any_mma { grid } else { 0 },
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use gguf::GgmlType;

    #[test]
    fn one_token_float_jobs_take_a_block_per_row_and_the_rest_four_rows() {
        let f32 = GgmlType::F32 as u64;
        let q4k = GgmlType::Q4K as u64;
        // A decode router: 128 f32 rows of one token.
        let router = job_blocks(128, 1, f32, 16);
        assert_eq!(
            router,
            if float_row_blocks() { 128 } else { 32 },
            "MOESHARD_GPU_FLOAT_ROW_BLOCKS decides"
        );
        // Two tokens, or a quantized matrix: a warp a row, four rows a block, tiles of eight.
        assert_eq!(job_blocks(128, 2, f32, 16), 32);
        assert_eq!(job_blocks(130, 9, q4k, 16), 33 * 2);
        // The tensor-core path from mma_min tokens.
        assert_eq!(job_blocks(128, 16, q4k, 16), 2);
    }
}
