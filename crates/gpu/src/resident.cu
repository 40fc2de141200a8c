// Whole layers on the GPU: the kernels between the matrix products of matmul.cu (compiled in
// the same NVRTC program, after it). The activations of a step and a mirror of each
// sequence's KV cache stay in device memory; the host sends the embeddings and the RoPE table
// in and reads the logits and the new KV rows out once per step.
//
// Per-row arrays (one entry per token row of the step): its position, and the device
// addresses of its sequence's K and V mirrors (layer 0, position 0) with their layer stride in
// floats. Mirrors are [layer][position][kv heads × head dim] f32.

#define MAX_DV 512
// No headers under NVRTC: math.h's INFINITY spelled out.
#define INFINITY __int_as_float(0x7f800000)

// Block-wide sum of one value per thread (blockDim a multiple of 32, at most 1024).
template <typename T>
__device__ T block_sum(T v, T* shared32) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    __syncthreads();
    if (lane == 0) shared32[warp] = v;
    __syncthreads();
    T total = 0;
    const int warps = blockDim.x >> 5;
    for (int i = 0; i < warps; i++) total += shared32[i];
    return total;
}

__device__ float block_max(float v, float* shared32) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
    __syncthreads();
    if (lane == 0) shared32[warp] = v;
    __syncthreads();
    float m = -INFINITY;
    const int warps = blockDim.x >> 5;
    for (int i = 0; i < warps; i++) m = fmaxf(m, shared32[i]);
    return m;
}

// A block's 256-column chunk of a normalized row, in the activation forms asked for (a null
// pointer skips a form): thread i holds column 256·blockIdx.y + i in `v` (0 past the row's
// end). Q8_K takes warp 0 (whole superblocks only: K-quant rows are multiples of 256), Q8_0 a
// warp per 32 columns. `chunk` is 256 floats of shared memory.
__device__ void quantize_chunk(float v, float* chunk, int width, long long r, u8* q8k, u8* q80) {
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int c0 = blockIdx.y * 256;
    if (q80 && c0 + 32 * warp < width)
        warp_quant_q8_0(v, q80 + (r * (width / 32) + c0 / 32 + warp) * 34, lane);
    if (q8k && c0 + 256 <= width) {
        chunk[threadIdx.x] = v;
        __syncthreads();
        if (warp == 0) {
            float s[8];
#pragma unroll
            for (int i = 0; i < 8; i++) s[i] = chunk[8 * lane + i];
            warp_quant_q8_k(s, q8k + (r * (width / 256) + blockIdx.y) * Q8K_BYTES, lane);
        }
    }
}

// RMSNorm of row `rows[r]` of x (row r when `rows` is null) times w, as the CPU computes it
// (sum of squares in f64), written as f32 row r of `out` and in the quantized forms asked for.
// Grid (output rows, 256-column chunks), 256 threads: every block sums the whole row's squares
// (a row is a few KiB, in L2) and writes its own chunk, so no block waits on another and the
// quantization is spread over the device. The loads are issued before any is used: a one-row
// step's norm is a chain of memory latencies (one block did it in 7.7 µs for 2048 columns).
extern "C" __global__ void rms_norm_quant(const float* __restrict__ x,
                                          const unsigned int* __restrict__ rows,
                                          const float* __restrict__ w, int d, float eps,
                                          float* __restrict__ out, u8* q8k, u8* q80) {
    pdl_wait_then_release();
    __shared__ double partial[32];
    __shared__ float chunk[256];
    const long long r = blockIdx.x;
    const int c = blockIdx.y * 256 + threadIdx.x;
    const float wc = c < d ? w[c] : 0.0f;
    const float* src = x + (long long)(rows ? rows[r] : (unsigned int)r) * d;
    double ss = 0.0;
#pragma unroll 8
    for (int i = threadIdx.x; i < d; i += 256) {
        const float v = src[i];
        ss += (double)v * (double)v;
    }
    ss = block_sum(ss, partial);
    const float scale = 1.0f / sqrtf((float)(ss / d) + eps);
    const float v = c < d ? wc * (src[c] * scale) : 0.0f;
    if (out && c < d) out[r * d + c] = v;
    quantize_chunk(v, chunk, d, r, q8k, q80);
}

// Rows of x (f32, `width` each) quantized. Grid (rows, 256-column chunks), 256 threads.
extern "C" __global__ void quantize_rows(const float* __restrict__ x, int width, u8* q8k,
                                         u8* q80) {
    pdl_wait_then_release();
    __shared__ float chunk[256];
    const long long r = blockIdx.x;
    const int c = blockIdx.y * 256 + threadIdx.x;
    const float v = c < width ? x[r * width + c] : 0.0f;
    quantize_chunk(v, chunk, width, r, q8k, q80);
}

// Element i of a row list in the host cache's type: f16 (rounded to nearest even, as the
// host's own conversion) or f32.
__device__ __forceinline__ void store_cache_value(u8* base, long long i, float x, int f16) {
    if (f16) ((u16*)base)[i] = f32_to_f16(x);
    else ((float*)base)[i] = x;
}

// Per head of row t: the per-head RMSNorm (when its weights are given), RoPE from the step's
// table (n_rot/2 cos and sin per row; `neox` pairs i with i + n_rot/2, else 2i with 2i + 1),
// and for key heads the store of the key and its value head into the row's mirror at its
// position (rounded to f16 first when the host cache keeps f16) and into the step's list of
// new rows that goes back to the host (`fresh`: per layer, the step's rows of keys, then of
// values, in the host cache's own element type, so the host copies them as they are).
// Grid (rows, query heads + kv heads); block: head_dim threads rounded up to a warp.
extern "C" __global__ void qk_rope_store(float* __restrict__ q, float* __restrict__ k,
                                         const float* __restrict__ v,
                                         const float* __restrict__ q_norm,
                                         const float* __restrict__ k_norm, float eps,
                                         const float* __restrict__ cos_t,
                                         const float* __restrict__ sin_t, int n_rot, int neox,
                                         int nh, int nkv, int dk, int dv,
                                         const u64* __restrict__ row_k,
                                         const u64* __restrict__ row_v,
                                         const u64* __restrict__ row_stride,
                                         const unsigned int* __restrict__ row_pos, int layer,
                                         int n_layers, int round_f16, u8* __restrict__ fresh) {
    __shared__ float head[1024];
    __shared__ float partial[32];
    const int t = blockIdx.x, h = blockIdx.y, i = threadIdx.x;
    const bool is_q = h < nh;
    const int kh = h - nh;
    // The rotation and the row's cache addresses came in with the step (no kernel writes
    // them): loaded before waiting on the kernel ahead, they are not one more memory latency
    // after its q and k.
    const int half = n_rot / 2;
    const int p_rot = i < n_rot ? (neox ? (i < half ? i : i - half) : i >> 1) : 0;
    const float rot_c = i < n_rot ? cos_t[(long long)t * half + p_rot] : 0.0f;
    const float rot_s = i < n_rot ? sin_t[(long long)t * half + p_rot] : 0.0f;
    const long long pos = is_q ? 0 : (long long)row_pos[t];
    const u64 k_mirror = is_q ? 0 : row_k[t], v_mirror = is_q ? 0 : row_v[t];
    const long long mirror_stride = is_q ? 0 : (long long)row_stride[t];
    pdl_wait_then_release();
    float* src = is_q ? q + ((long long)t * nh + h) * dk : k + ((long long)t * nkv + kh) * dk;
    const float* nw = is_q ? q_norm : k_norm;
    const float x = i < dk ? src[i] : 0.0f;
    float val = x;
    if (nw) {
        const float ss = block_sum(x * x, partial);
        const float scale = 1.0f / sqrtf(ss / dk + eps);
        if (i < dk) val = nw[i] * (x * scale);
    }
    if (i < dk) head[i] = val;
    __syncthreads();
    if (i < n_rot) {
        const int p = p_rot;
        if (neox) {
            const float x0 = head[p], x1 = head[p + half];
            val = i < half ? x0 * rot_c - x1 * rot_s : x0 * rot_s + x1 * rot_c;
        } else {
            const float x0 = head[2 * p], x1 = head[2 * p + 1];
            val = (i & 1) ? x0 * rot_s + x1 * rot_c : x0 * rot_c - x1 * rot_s;
        }
    }
    if (i >= dk) return;
    if (is_q) {
        src[i] = val;
        return;
    }
    const int kd = nkv * dk, vd = nkv * dv;
    float kv_val = val;
    if (round_f16) kv_val = f16_to_f32(f32_to_f16(kv_val));
    float* km = (float*)k_mirror + (long long)layer * mirror_stride * kd + pos * kd;
    km[kh * dk + i] = kv_val;
    const long long rows = gridDim.x, es = round_f16 ? 2 : 4;
    u8* fk = fresh + (long long)layer * rows * (kd + vd) * es;
    u8* fv = fk + rows * kd * es;
    store_cache_value(fk, (long long)t * kd + kh * dk + i, val, round_f16);
    for (int j = i; j < dv; j += blockDim.x) {
        float vv = v[(long long)t * vd + kh * dv + j];
        store_cache_value(fv, (long long)t * vd + kh * dv + j, vv, round_f16);
        if (round_f16) vv = f16_to_f32(f32_to_f16(vv));
        float* vm = (float*)v_mirror + (long long)layer * mirror_stride * vd + pos * vd;
        vm[kh * dv + j] = vv;
    }
}

// Positions of a row's sequence that one block of `attention` takes (matmul_table.rs
// `attention_split_positions` passes it).
#ifndef SPLIT_POSITIONS
#define SPLIT_POSITIONS 64
#endif
// The most query heads that share a kv head in `attention_grouped`.
#define MAX_GROUP 8

// Whether this block is the last of `active` split blocks to finish its share (after writing
// its partial sums, which every thread has done): a counter per row and head (or kv head),
// which the last block resets for the next step. Uniform across the block.
// With ATTN_BATCHED, one thread fences for the block (the barrier orders the others' writes
// before its fence, and a PTX fence is cumulative: the pattern of CUTLASS's semaphores), with
// release-acquire strength: every thread's sequentially consistent fence (`__threadfence`)
// sat on each split block's path, twice on the last one's.
#ifndef ATTN_BATCHED
#define ATTN_BATCHED 1
#endif
__device__ __forceinline__ bool last_split_done(unsigned int* count, int active, bool* last) {
#if ATTN_BATCHED
    __syncthreads();
    if (threadIdx.x == 0) {
        asm volatile("fence.acq_rel.gpu;" ::: "memory");
        const unsigned int before = atomicAdd(count, 1u);
        *last = before + 1 == (unsigned int)active;
        if (*last) {
            *count = 0;
            asm volatile("fence.acq_rel.gpu;" ::: "memory");
        }
    }
    __syncthreads();
#else
    // Every thread's writes are out before the block counts itself done.
    __threadfence();
    __syncthreads();
    if (threadIdx.x == 0) {
        const unsigned int before = atomicAdd(count, 1u);
        *last = before + 1 == (unsigned int)active;
        if (*last) *count = 0;
    }
    __syncthreads();
    if (*last) __threadfence();
#endif
    return *last;
}

// Four floats of a mirror's key or value row. With ATTN_BATCHED through L2 only
// (ld.global.cg): global loads, which the compiler need not order behind shared-memory stores
// as it must generic ones; the rows are read once.
__device__ __forceinline__ float4 ld_kv4(const float* p) {
#if ATTN_BATCHED
    return __ldcg((const float4*)p);
#else
    return *(const float4*)p;
#endif
}

// The outputs of `heads` consecutive heads (≤ 8, one warp each for the statistics) from their
// splits' partial sums (per head `active` records of 2 + dv floats from `first`, a head's
// records `splits` records after the previous head's: the split's score maximum m, the sum l
// of exp(score - m), dv weighted values), every split rescaled to the head's largest maximum.
// The splits' records are read in parallel (warp h: head h's maxima and sums, a lane per
// split; then every thread a (head, column), its loads unrolled): a serial loop over the splits
// made the last block a chain of L2 round trips, 78 µs a layer at 4096 positions on an H100
// (docs/perf.md). Read past L1 (other blocks wrote them). `stats` is 2 × 8 floats of shared
// memory.
__device__ __forceinline__ void combine_splits(const float* first, int heads, int splits,
                                               int active, int dv, float* out,
                                               float (*stats)[2]) {
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const long long rec = 2 + dv, head_stride = (long long)splits * rec;
    if (warp < heads) {
        const float* h = first + warp * head_stride;
        float mx = -INFINITY;
        for (int j = lane; j < active; j += 32) mx = fmaxf(mx, __ldcg(h + j * rec));
#pragma unroll
        for (int o = 16; o > 0; o >>= 1) mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, o));
        float denom = 0.0f;
        for (int j = lane; j < active; j += 32) {
            const float* pj = h + j * rec;
            denom += __ldcg(pj + 1) * expf(__ldcg(pj) - mx);
        }
#pragma unroll
        for (int o = 16; o > 0; o >>= 1) denom += __shfl_xor_sync(0xffffffffu, denom, o);
        if (lane == 0) {
            stats[warp][0] = mx;
            stats[warp][1] = denom;
        }
    }
    __syncthreads();
    for (int i = threadIdx.x; i < heads * dv; i += blockDim.x) {
        const int hh = i / dv, c = i - hh * dv;
        const float* h = first + hh * head_stride;
        const float mx = stats[hh][0];
        float total = 0.0f;
#pragma unroll 8
        for (int j = 0; j < active; j++) {
            const float* pj = h + j * rec;
            total += __ldcg(pj + 2 + c) * expf(__ldcg(pj) - mx);
        }
        out[hh * dv + c] = total / stats[hh][1];
    }
}

// Causal attention of row t's query head h over positions 0..=row_pos[t] of its mirror, split
// over the sequence (flash-decoding): block (h, split s) of row t takes positions
// [s·SPLIT_POSITIONS, (s+1)·SPLIT_POSITIONS), a warp per position, and writes its scores' max m,
// the sum l of exp(score − m) and the unnormalized weighted sum of values to `parts` (per row,
// head and split: 2 + dv floats); the last block of the row and head to finish (a counter per
// row and head, reset by that block) combines the splits. One block per head over the whole
// sequence made a decode step a chain of position after position: 22.4 ms for qwen3-30b-a3b at
// 2843 positions on an H100 against 3.7 ms at 16. Splits past the row's position do nothing.
// Grid (heads × splits, rows); block 256 threads.
extern "C" __global__ void __launch_bounds__(256) attention(
    const float* __restrict__ q, float* __restrict__ out, const u64* __restrict__ row_k,
    const u64* __restrict__ row_v, const u64* __restrict__ row_stride,
    const unsigned int* __restrict__ row_pos, int layer, int nh, int nkv, int dk, int dv,
    float scale, float* __restrict__ parts, unsigned int* __restrict__ counts, int splits) {
    __shared__ float partial[32];
    __shared__ float sc[SPLIT_POSITIONS];
    __shared__ float acc_w[8][MAX_DV];
    __shared__ float stats[MAX_GROUP][2];
    __shared__ bool last;
    const int h = blockIdx.x / splits, s = blockIdx.x % splits, t = blockIdx.y;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int kh = h / (nh / nkv);
    const int kd = nkv * dk, vd = nkv * dv;
    // The row's position and cache addresses came in with the step: read before the wait,
    // they are not one more memory latency before the first key.
    const long long n_pos = (long long)row_pos[t] + 1;
    const int active = (int)((n_pos + SPLIT_POSITIONS - 1) / SPLIT_POSITIONS);
    const float* kbase = (const float*)row_k[t] + (long long)layer * row_stride[t] * kd + kh * dk;
    const float* vbase = (const float*)row_v[t] + (long long)layer * row_stride[t] * vd + kh * dv;
    pdl_wait_then_release();
    if (s >= active) return;
    const long long p0 = (long long)s * SPLIT_POSITIONS;
    const int here = n_pos - p0 < SPLIT_POSITIONS ? (int)(n_pos - p0) : SPLIT_POSITIONS;
    const float* qh = q + ((long long)t * nh + h) * dk;
    float qv[MAX_DV / 32];
#pragma unroll
    for (int j = 0; j < MAX_DV / 32; j++) {
        const int c = lane + 32 * j;
        qv[j] = c < dk ? qh[c] : 0.0f;
    }
    // A warp's positions are independent: unrolled, their loads are in flight together.
    float m = -INFINITY;
#pragma unroll 4
    for (int i = warp; i < SPLIT_POSITIONS; i += 8) {
        if (i < here) {
            const float* kr = kbase + (p0 + i) * kd;
            float dot = 0.0f;
#pragma unroll
            for (int j = 0; j < MAX_DV / 32; j++) {
                const int c = lane + 32 * j;
                if (c < dk) dot += qv[j] * kr[c];
            }
#pragma unroll
            for (int o = 16; o > 0; o >>= 1) dot += __shfl_xor_sync(0xffffffffu, dot, o);
            dot *= scale;
            if (lane == 0) sc[i] = dot;
            m = fmaxf(m, dot);
        }
    }
    m = block_max(m, partial);
    float e_sum = 0.0f;
    for (int i = threadIdx.x; i < here; i += blockDim.x) {
        const float e = expf(sc[i] - m);
        sc[i] = e;
        e_sum += e;
    }
    const float l = block_sum(e_sum, partial);
    float acc[MAX_DV / 32];
#pragma unroll
    for (int j = 0; j < MAX_DV / 32; j++) acc[j] = 0.0f;
#pragma unroll 4
    for (int i = warp; i < SPLIT_POSITIONS; i += 8) {
        if (i < here) {
            const float e = sc[i];
            const float* vr = vbase + (p0 + i) * vd;
#pragma unroll
            for (int j = 0; j < MAX_DV / 32; j++) {
                const int c = lane + 32 * j;
                if (c < dv) acc[j] += e * vr[c];
            }
        }
    }
#pragma unroll
    for (int j = 0; j < MAX_DV / 32; j++) {
        const int c = lane + 32 * j;
        if (c < dv) acc_w[warp][c] = acc[j];
    }
    __syncthreads();
    const long long head = (long long)t * nh + h;
    // A row within the first split (every decode row near the start of a sequence) has one
    // block per head: it writes the head's output itself, with no partial sums, counter or
    // combine on the step's critical path.
    if (active == 1) {
        for (int c = threadIdx.x; c < dv; c += blockDim.x) {
            float total = 0.0f;
#pragma unroll
            for (int w = 0; w < 8; w++) total += acc_w[w][c];
            out[head * dv + c] = total / l;
        }
        return;
    }
    float* part = parts + (head * splits + s) * (2 + dv);
    for (int c = threadIdx.x; c < dv; c += blockDim.x) {
        float total = 0.0f;
#pragma unroll
        for (int w = 0; w < 8; w++) total += acc_w[w][c];
        part[2 + c] = total;
    }
    if (threadIdx.x == 0) {
        part[0] = m;
        part[1] = l;
    }
    if (last_split_done(counts + head, active, &last))
        combine_splits(parts + head * splits * (2 + dv), 1, splits, active, dv, out + head * dv,
                       stats);
}

// Exclusive prefix sums across a full warp of two per-lane counts, in place; returns the
// warp's two totals (to every lane).
__device__ __forceinline__ uint2 warp_exclusive_scan2(unsigned int& a, unsigned int& b, int lane) {
    unsigned int sum_a = a, sum_b = b;
#pragma unroll
    for (int o = 1; o < 32; o <<= 1) {
        const unsigned int up_a = __shfl_up_sync(0xffffffffu, sum_a, o);
        const unsigned int up_b = __shfl_up_sync(0xffffffffu, sum_b, o);
        if (lane >= o) {
            sum_a += up_a;
            sum_b += up_b;
        }
    }
    const uint2 totals = make_uint2(__shfl_sync(0xffffffffu, sum_a, 31),
                                    __shfl_sync(0xffffffffu, sum_b, 31));
    a = sum_a - a;
    b = sum_b - b;
    return totals;
}

#define GROUP_DK 256
// Positions of the key tile `attention_grouped` stages in shared memory, and its row stride
// (4 floats of padding: the lanes of a warp read rows 132 floats apart, conflict-free).
#define GROUP_TILE 32
#define GROUP_STRIDE (GROUP_DK + 4)
// The most 16-byte pieces of a key tile one thread loads (GROUP_TILE · GROUP_DK / 4 / 256).
#define GROUP_PIECES (GROUP_TILE * GROUP_DK / 4 / 256)

// Thread's share of the key tile of positions [tile0, tile0 + GROUP_TILE) of a split: of its
// rows, those at split positions [lo, hi), into registers (the others keep what they hold):
// the next tile's loads are in flight while the current one is multiplied.
__device__ __forceinline__ void load_key_tile(const float* kbase, long long p0, int tile0, int lo,
                                              int hi, int kd, int dk4, float4* pre) {
#pragma unroll
    for (int u = 0; u < GROUP_PIECES; u++) {
        const int i = threadIdx.x + 256 * u;
        const int r = i / dk4, c4 = i - r * dk4, p = tile0 + r;
        if (r < GROUP_TILE && p >= lo && p < hi) pre[u] = ld_kv4(kbase + (p0 + p) * kd + 4 * c4);
    }
}

// Positions of a split whose value rows a thread of `attention_grouped` loads at once.
#define V_BATCH 8

// Thread (position group g of `groups`, columns 4·c4..) of `attention_grouped`: its value
// rows of batch b, positions g + groups·(V_BATCH·b + i) of the split, those in [lo, hi), all
// loads issued before any is used (the others keep what they hold).
__device__ __forceinline__ void load_value_batch(const float* vbase, long long p0, int g,
                                                 int groups, int b, int lo, int hi, int vd,
                                                 int c4, float4* vb) {
#pragma unroll
    for (int i = 0; i < V_BATCH; i++) {
        const int p = g + groups * (V_BATCH * b + i);
        if (g < groups && p >= lo && p < hi) vb[i] = ld_kv4(vbase + (p0 + p) * vd + 4 * c4);
    }
}

// Value row v of split position p into the group's sums, weighted by each head's
// exp(score - max) in sc.
__device__ __forceinline__ void add_weighted_value(float4* acc,
                                                   const float (*sc)[SPLIT_POSITIONS], int p,
                                                   float4 v, int group) {
#pragma unroll
    for (int j = 0; j < MAX_GROUP; j++) {
        if (j < group) {
            const float e = sc[j][p];
            acc[j].x += e * v.x;
            acc[j].y += e * v.y;
            acc[j].z += e * v.z;
            acc[j].w += e * v.w;
        }
    }
}

// The attention of the query heads that share kv head kh (grouped-query attention: nh / nkv ≤
// MAX_GROUP of them, dk = dv ≤ GROUP_DK, a multiple of 4), split over the sequence as
// `attention` is: block (kv head, split s) of row t takes the positions of split s and reads
// each key and value row of them once for the whole group. Keys go through shared memory a
// tile of GROUP_TILE positions at a time; warp h scores head h against the tile, a lane per
// position (no shuffles); then a warp per head takes the split's softmax, and each thread sums
// four columns of the values over a share of the split's positions for every head. Partial
// sums go where `attention` puts them; the last block of the row and kv head to finish (its counter: that of the group's first
// head) combines them for every head of the group. One block per head read the kv head's keys
// and values once per head (eight times on qwen3-30b-a3b): 18 µs a layer per 1024 positions
// on an H100 (docs/perf.md, "Decode attention split over the sequence"). Grid (kv heads ×
// splits, rows); block 256 threads, two blocks an SM (128 registers: a decode step at depth
// 2048 has 128 blocks of it on the device's 132 SMs, at 4096 256).
extern "C" __global__ void __launch_bounds__(256, 2) attention_grouped(
    const float* __restrict__ q, float* __restrict__ out, const u64* __restrict__ row_k,
    const u64* __restrict__ row_v, const u64* __restrict__ row_stride,
    const unsigned int* __restrict__ row_pos, int layer, int nh, int nkv, int dk, int dv,
    float scale, float* __restrict__ parts, unsigned int* __restrict__ counts, int splits) {
    __shared__ __align__(16) float kt[GROUP_TILE * GROUP_STRIDE];
    __shared__ __align__(16) float qs[MAX_GROUP * GROUP_DK];
    __shared__ float sc[MAX_GROUP][SPLIT_POSITIONS];
    __shared__ float stats[MAX_GROUP][2];
    __shared__ bool last;
    const int kh = blockIdx.x / splits, s = blockIdx.x % splits, t = blockIdx.y;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int group = nh / nkv;
    const int kd = nkv * dk, vd = nkv * dv, dk4 = dk / 4;
    const long long n_pos = (long long)row_pos[t] + 1;
    const int active = (int)((n_pos + SPLIT_POSITIONS - 1) / SPLIT_POSITIONS);
    const float* kbase = (const float*)row_k[t] + (long long)layer * row_stride[t] * kd + kh * dk;
    const float* vbase = (const float*)row_v[t] + (long long)layer * row_stride[t] * vd + kh * dv;
    if (s >= active) return;
    const long long p0 = (long long)s * SPLIT_POSITIONS;
    const int here = n_pos - p0 < SPLIT_POSITIONS ? (int)(n_pos - p0) : SPLIT_POSITIONS;
    const long long h0 = (long long)t * nh + (long long)kh * group;
    // Values: thread (position group g, 4 columns c4) sums positions g, g + groups, ... of
    // columns 4·c4.. for every head of the group (16-byte loads, a warp reading whole rows).
    const int dv4 = dv / 4, groups = blockDim.x / dv4;
    const int g = threadIdx.x / dv4, c4 = threadIdx.x - g * dv4;
    float4 pre[GROUP_PIECES];
#pragma unroll
    for (int u = 0; u < GROUP_PIECES; u++) pre[u] = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
#if ATTN_BATCHED
    // A step of one row (decode) writes only that row's key and value rows (qk_rope_store, the
    // kernel ahead); the rows before it came from earlier steps, whose kernels have all
    // finished. So the split's first key tile and first batch of value rows, but for the new
    // row, are loaded before waiting on the kernel ahead, their latency behind it; a batch's
    // loads all go out before any is used (one at a time, a 64-position split was a chain of
    // eight memory latencies per thread).
    const int early = gridDim.y == 1 ? min(here, (int)(n_pos - 1 - p0)) : 0;
    float4 vb[V_BATCH];
#pragma unroll
    for (int i = 0; i < V_BATCH; i++) vb[i] = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
    load_key_tile(kbase, p0, 0, 0, early, kd, dk4, pre);
    load_value_batch(vbase, p0, g, groups, 0, 0, early, vd, c4, vb);
    pdl_wait_then_release();
    load_key_tile(kbase, p0, 0, early, here, kd, dk4, pre);
    load_value_batch(vbase, p0, g, groups, 0, early, here, vd, c4, vb);
#else
    pdl_wait_then_release();
    load_key_tile(kbase, p0, 0, 0, here, kd, dk4, pre);
#endif
    // The group's query rows are contiguous: group · dk floats from head h0.
    for (int i = threadIdx.x; i < group * dk4; i += blockDim.x)
        *(float4*)(qs + 4 * i) = *(const float4*)(q + h0 * dk + 4 * i);
    float m = -INFINITY;
    for (int tile0 = 0; tile0 < here; tile0 += GROUP_TILE) {
        __syncthreads();
#pragma unroll
        for (int u = 0; u < GROUP_PIECES; u++) {
            const int i = threadIdx.x + 256 * u;
            const int r = i / dk4, c4 = i - r * dk4;
            if (r < GROUP_TILE) *(float4*)(kt + r * GROUP_STRIDE + 4 * c4) = pre[u];
        }
        __syncthreads();
        if (tile0 + GROUP_TILE < here)
            load_key_tile(kbase, p0, tile0 + GROUP_TILE, 0, here, kd, dk4, pre);
        const int p = tile0 + lane;
        if (warp < group && p < here) {
            const float4* qh = (const float4*)(qs + warp * dk);
            const float4* kr = (const float4*)(kt + lane * GROUP_STRIDE);
            float dot = 0.0f;
            for (int c4 = 0; c4 < dk4; c4++) {
                const float4 a = qh[c4], b = kr[c4];
                dot += a.x * b.x + a.y * b.y + a.z * b.z + a.w * b.w;
            }
            dot *= scale;
            sc[warp][p] = dot;
            m = fmaxf(m, dot);
        }
    }
    // Warp h: head h's maximum over the split, exp(score - max) in place, and their sum.
    if (warp < group) {
#pragma unroll
        for (int o = 16; o > 0; o >>= 1) m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, o));
        float e_sum = 0.0f;
        for (int p = lane; p < here; p += 32) {
            const float e = expf(sc[warp][p] - m);
            sc[warp][p] = e;
            e_sum += e;
        }
#pragma unroll
        for (int o = 16; o > 0; o >>= 1) e_sum += __shfl_xor_sync(0xffffffffu, e_sum, o);
        if (lane == 0) {
            stats[warp][0] = m;
            stats[warp][1] = e_sum;
        }
    }
    __syncthreads();
    // The groups' sums meet in the key tile's shared memory (groups × heads × dv ≤ 8 × 1024
    // floats).
    float4 acc[MAX_GROUP];
#pragma unroll
    for (int j = 0; j < MAX_GROUP; j++) acc[j] = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
#if ATTN_BATCHED
    for (int b = 0; g < groups && g + groups * V_BATCH * b < here; b++) {
        if (b > 0) load_value_batch(vbase, p0, g, groups, b, 0, here, vd, c4, vb);
#pragma unroll
        for (int i = 0; i < V_BATCH; i++) {
            const int p = g + groups * (V_BATCH * b + i);
            if (p >= here) break;
            const float4 v = vb[i];
            add_weighted_value(acc, sc, p, v, group);
        }
    }
#else
    if (g < groups) {
#pragma unroll 4
        for (int p = g; p < here; p += groups) {
            const float4 v = *(const float4*)(vbase + (p0 + p) * vd + 4 * c4);
            add_weighted_value(acc, sc, p, v, group);
        }
    }
#endif
    __syncthreads();
    float* red = kt;
    if (g < groups) {
#pragma unroll
        for (int j = 0; j < MAX_GROUP; j++)
            if (j < group) *(float4*)(red + (g * group + j) * dv + 4 * c4) = acc[j];
    }
    __syncthreads();
    for (int i = threadIdx.x; i < group * dv; i += blockDim.x) {
        const int j = i / dv, c = i - j * dv;
        float total = 0.0f;
        for (int w = 0; w < groups; w++) total += red[(w * group + j) * dv + c];
        if (active == 1) {
            // One split (a row within its first SPLIT_POSITIONS positions): no partials, no combine.
            out[(h0 + j) * dv + c] = total / stats[j][1];
            continue;
        }
        float* part = parts + ((h0 + j) * splits + s) * (2 + dv);
        part[2 + c] = total;
        if (c == 0) {
            part[0] = stats[j][0];
            part[1] = stats[j][1];
        }
    }
    if (active > 1 && last_split_done(counts + h0, active, &last))
        combine_splits(parts + h0 * splits * (2 + dv), group, splits, active, dv, out + h0 * dv,
                       stats);
}

// Causal attention of a tile of rows of one sequence (the rows share the first row's mirror)
// for kv head `blockIdx.x` and the query heads of its group: up to AT_VEC query vectors (rows
// × heads of the group) against key and value tiles of AT_POS positions in shared memory, the
// softmax kept online (a running maximum and sum per vector, the value sums rescaled when the
// maximum moves), so each key and value row is read once per tile of rows instead of once per
// row and head. Thread 8a + c serves vector a: its scores at positions c, c + 8, ... of a tile
// and its value sums at dimensions 4c + 32i..+3. FP32 throughout, as the CPU.
// Grid (kv heads, row tiles of AT_VEC / group rows); block 256 threads; dk = dv ≤ AT_DK, a
// multiple of 4; group ≤ AT_VEC / 4.
#define AT_VEC 32
#define AT_POS 32
#define AT_DK 128
#define AT_STRIDE (AT_DK + 4)
extern "C" __global__ void __launch_bounds__(256) attention_tile(
    const float* __restrict__ q, float* __restrict__ out, const u64* __restrict__ row_k,
    const u64* __restrict__ row_v, const u64* __restrict__ row_stride,
    const unsigned int* __restrict__ row_pos, int n, int layer, int nh, int nkv, int dk,
    float scale) {
    pdl_wait_then_release();
    __shared__ __align__(16) float qs[AT_VEC * AT_STRIDE];
    // A tile of keys, then of values, in the same place.
    __shared__ __align__(16) float kv[AT_POS * AT_STRIDE];
    __shared__ float ps[AT_VEC * (AT_POS + 1)];
    __shared__ unsigned int last_pos;
    const int group = nh / nkv, tile_rows = AT_VEC / group, n_vec = tile_rows * group;
    const int kh = blockIdx.x, r0 = blockIdx.y * tile_rows;
    const int a = threadIdx.x >> 3, c = threadIdx.x & 7, d4s = dk / 4;
    const long long kd = (long long)nkv * dk;
    const long long layer_at = (long long)layer * row_stride[r0] * kd + kh * dk;
    const float* kbase = (const float*)row_k[r0] + layer_at;
    const float* vbase = (const float*)row_v[r0] + layer_at;
    const int ar = r0 + a / group;
    const bool a_valid = a < n_vec && ar < n;
    const long long a_pos = a_valid ? (long long)row_pos[ar] : -1;
    for (int i = threadIdx.x; i < AT_VEC * d4s; i += blockDim.x) {
        const int v = i / d4s, d4 = i % d4s, vr = r0 + v / group;
        float4 x = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
        if (v < n_vec && vr < n)
            x = *(const float4*)(q + ((long long)vr * nh + kh * group + v % group) * dk + 4 * d4);
        *(float4*)(qs + v * AT_STRIDE + 4 * d4) = x;
    }
    if (threadIdx.x == 0) {
        unsigned int m = 0;
        for (int r = r0; r < min(n, r0 + tile_rows); r++) m = max(m, row_pos[r]);
        last_pos = m;
    }
    __syncthreads();
    const long long n_pos = (long long)last_pos + 1;
    float m_run = -INFINITY, l_run = 0.0f;
    float4 o[AT_DK / 32];
#pragma unroll
    for (int i = 0; i < AT_DK / 32; i++) o[i] = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
    const float* qa = qs + a * AT_STRIDE;
    for (long long p0 = 0; p0 < n_pos; p0 += AT_POS) {
        const int np = (int)min((long long)AT_POS, n_pos - p0);
        for (int i = threadIdx.x; i < AT_POS * d4s; i += blockDim.x) {
            const int j = i / d4s, d4 = i % d4s;
            float4 x = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
            if (j < np) x = *(const float4*)(kbase + (p0 + j) * kd + 4 * d4);
            *(float4*)(kv + j * AT_STRIDE + 4 * d4) = x;
        }
        __syncthreads();
        float sc[AT_POS / 8];
#pragma unroll
        for (int m = 0; m < AT_POS / 8; m++) sc[m] = 0.0f;
        for (int d = 0; d < dk; d += 4) {
            const float4 x = *(const float4*)(qa + d);
#pragma unroll
            for (int m = 0; m < AT_POS / 8; m++) {
                const float4 y = *(const float4*)(kv + (c + 8 * m) * AT_STRIDE + d);
                sc[m] = fmaf(x.x, y.x, sc[m]);
                sc[m] = fmaf(x.y, y.y, sc[m]);
                sc[m] = fmaf(x.z, y.z, sc[m]);
                sc[m] = fmaf(x.w, y.w, sc[m]);
            }
        }
        float tile_max = -INFINITY;
#pragma unroll
        for (int m = 0; m < AT_POS / 8; m++) {
            const int j = c + 8 * m;
            sc[m] = j < np && p0 + j <= a_pos ? sc[m] * scale : -INFINITY;
            tile_max = fmaxf(tile_max, sc[m]);
        }
#pragma unroll
        for (int o8 = 1; o8 < 8; o8 <<= 1)
            tile_max = fmaxf(tile_max, __shfl_xor_sync(0xffffffffu, tile_max, o8));
        const float m_new = fmaxf(m_run, tile_max);
        // A vector with nothing to attend to yet (or none at all) keeps zeros.
        const float alpha = m_new == -INFINITY ? 1.0f : expf(m_run - m_new);
        float tile_sum = 0.0f;
#pragma unroll
        for (int m = 0; m < AT_POS / 8; m++) {
            const float e = sc[m] == -INFINITY ? 0.0f : expf(sc[m] - m_new);
            ps[a * (AT_POS + 1) + c + 8 * m] = e;
            tile_sum += e;
        }
#pragma unroll
        for (int o8 = 1; o8 < 8; o8 <<= 1)
            tile_sum += __shfl_xor_sync(0xffffffffu, tile_sum, o8);
        l_run = l_run * alpha + tile_sum;
        m_run = m_new;
#pragma unroll
        for (int i = 0; i < AT_DK / 32; i++) {
            o[i].x *= alpha;
            o[i].y *= alpha;
            o[i].z *= alpha;
            o[i].w *= alpha;
        }
        // Every score is read from the keys: the values may take their place.
        __syncthreads();
        for (int i = threadIdx.x; i < AT_POS * d4s; i += blockDim.x) {
            const int j = i / d4s, d4 = i % d4s;
            float4 x = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
            if (j < np) x = *(const float4*)(vbase + (p0 + j) * kd + 4 * d4);
            *(float4*)(kv + j * AT_STRIDE + 4 * d4) = x;
        }
        __syncthreads();
        for (int j = 0; j < np; j++) {
            const float e = ps[a * (AT_POS + 1) + j];
#pragma unroll
            for (int i = 0; i < AT_DK / 32; i++) {
                if (4 * c + 32 * i < dk) {
                    const float4 y = *(const float4*)(kv + j * AT_STRIDE + 4 * c + 32 * i);
                    o[i].x = fmaf(e, y.x, o[i].x);
                    o[i].y = fmaf(e, y.y, o[i].y);
                    o[i].z = fmaf(e, y.z, o[i].z);
                    o[i].w = fmaf(e, y.w, o[i].w);
                }
            }
        }
        // The next tile's keys overwrite these values.
        __syncthreads();
    }
    if (!a_valid) return;
    const float inv = 1.0f / l_run;
    float* dst = out + ((long long)ar * nh + kh * group + a % group) * dk;
#pragma unroll
    for (int i = 0; i < AT_DK / 32; i++) {
        if (4 * c + 32 * i < dk)
            *(float4*)(dst + 4 * c + 32 * i) =
                make_float4(o[i].x * inv, o[i].y * inv, o[i].z * inv, o[i].w * inv);
    }
}

// Row r's routing by one warp: the softmax over its router logits, its top k (ties to the
// lower expert), the weights (renormalized when `norm_topk`, times `w_scale`) into ids and wts;
// for k ≤ 32, lane `slot` also keeps its slot's expert and final weight in my_id / my_w.
// p: n_expert floats of shared memory of the warp's own (lane l holds experts l, l + 32, ...).
__device__ __forceinline__ void route_row(const float* __restrict__ logits, int r, int n_expert,
                                          int k, int norm_topk, float w_scale, float* p,
                                          unsigned int* __restrict__ ids,
                                          float* __restrict__ wts, int lane,
                                          unsigned int& my_id, float& my_w) {
    const float* lr = logits + (long long)r * n_expert;
    float mx = -INFINITY;
    for (int e = lane; e < n_expert; e += 32) {
        p[e] = lr[e];
        mx = fmaxf(mx, p[e]);
    }
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, o));
    float s = 0.0f;
    for (int e = lane; e < n_expert; e += 32) {
        p[e] = expf(p[e] - mx);
        s += p[e];
    }
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) s += __shfl_xor_sync(0xffffffffu, s, o);
    float wsum = 0.0f;
    // Up to 32 slots, lane `slot` keeps its slot's expert and probability and writes them
    // once the sum is known: lane 0 reading each weight back from global memory to scale it
    // was k memory latencies in a row in every layer.
    float my_prob = 0.0f;
    for (int slot = 0; slot < k; slot++) {
        float best = -1.0f;
        int best_e = 0x7fffffff;
        for (int e = lane; e < n_expert; e += 32) {
            if (p[e] > best || (p[e] == best && e < best_e)) {
                best = p[e];
                best_e = e;
            }
        }
#pragma unroll
        for (int o = 16; o > 0; o >>= 1) {
            const float ob = __shfl_xor_sync(0xffffffffu, best, o);
            const int oe = __shfl_xor_sync(0xffffffffu, best_e, o);
            if (ob > best || (ob == best && oe < best_e)) {
                best = ob;
                best_e = oe;
            }
        }
        const float prob = best / s;
        if (k > 32 && lane == 0) {
            ids[r * k + slot] = best_e;
            wts[r * k + slot] = prob;
        }
        if (lane == slot) {
            my_prob = prob;
            my_id = (unsigned int)best_e;
        }
        wsum += prob;
        if ((best_e & 31) == lane) p[best_e] = -2.0f;
        __syncwarp();
    }
    const float norm = norm_topk ? 1.0f / fmaxf(wsum, 6.1035156e-5f) : 1.0f;
    if (k <= 32 && lane < k) {
        float wv = my_prob;
        if (norm_topk) wv *= norm;
        my_w = wv * w_scale;
        ids[r * k + lane] = my_id;
        wts[r * k + lane] = my_w;
    } else if (k > 32 && lane == 0) {
        for (int slot = 0; slot < k; slot++) {
            float wv = wts[r * k + slot];
            if (norm_topk) wv *= norm;
            wts[r * k + slot] = wv * w_scale;
        }
    }
}

// Routing and the expert tables of one MoE layer, in one block (256 threads): each row's
// softmax over the router logits, its top k (ties to the lower expert), the weights
// (renormalized when `norm_topk`, times `w_scale`); then, per expert that any row picked
// (ascending), its rows in row order, and the tables the launches after it read:
//   gu:   gate and up matmul jobs per active expert (gathering the rows' activations),
//   glu:  the gated activation of each active expert's rows,
//   down: the down projections, their outputs at consecutive rows of `down_out`,
//   sum:  per row, its k output rows (addresses) and weights in slot order.
// Unused table entries get no tokens and the total block count as their first block.
// With `counted` (steps of many rows), moe_topk has routed the rows and moe_count has ranked
// the slots (in slot_row) and counted each expert's (counted[e]): this block only builds the
// tables. Both give the same tables.
// With `host_mask` (a u32 per expert, or null) the experts it marks are computed by the host
// (a decode step with routed experts in host memory): they get no jobs and no rows, and each
// row's slots of them read the row's weighted sum of them from `host_sums` (f32 rows of
// n_embd), at weight 1 from the row's first such slot and 0 from the others. In the one-row
// fast path the row's first `host_read` host slots (slot order) are the device's after all: the
// host copies their weights into the places the descriptor's tables give them in the streaming
// buffer before the expert launches (the general path takes host_read as 0).
// desc (u64): n_expert, k, norm_topk, w_scale bits, gate / up / down expert address tables,
// gate / up / down row strides, n_ff, n_embd, gate / up / down ggml types, the down
// projection's activation type and row bytes, the gate activation row bytes.
#define DESC_FIELDS 18
// The most routed experts of a layer (the host refuses more).
#define MAX_EXPERTS 512
extern "C" __global__ void moe_route(const float* __restrict__ logits, int n,
                                     const u64* __restrict__ desc, const u8* acts,
                                     u64 gate_out, u64 up_out, u64 hidden, u64 down_out,
                                     unsigned int* __restrict__ ids, float* __restrict__ wts,
                                     unsigned int* __restrict__ slot_row,
                                     unsigned int* __restrict__ gather, u64* __restrict__ gu,
                                     u64* __restrict__ glu, u64* __restrict__ down,
                                     u64* __restrict__ sum_rows, float* __restrict__ sum_w,
                                     int max_jobs, const unsigned int* __restrict__ counted,
                                     int mma_min, const unsigned int* __restrict__ host_mask,
                                     u64 host_sums, int host_read) {
    __shared__ unsigned int count[MAX_EXPERTS];
    __shared__ unsigned int first[MAX_EXPERTS];
    __shared__ int active[MAX_EXPERTS];
    __shared__ int n_active;
    // Each warp's row of probabilities (lanes read and mark them by expert index).
    __shared__ float probs[8][MAX_EXPERTS];
    // Per active expert: its first gate/up and down block.
    __shared__ unsigned int gu_first[MAX_EXPERTS];
    __shared__ unsigned int down_first[MAX_EXPERTS];
    __shared__ unsigned int gu_total, down_total;
    // Per warp of a chunk of slots, how many picked each expert.
    __shared__ unsigned int warp_count[8][MAX_EXPERTS];
    const int n_expert = (int)desc[0], k = (int)desc[1];
    const int norm_topk = (int)desc[2];
    const float w_scale = __uint_as_float((unsigned int)desc[3]);
    const u64* gate_w = (const u64*)desc[4];
    const u64* up_w = (const u64*)desc[5];
    const u64* down_w = (const u64*)desc[6];
    const u64 gate_stride = desc[7], up_stride = desc[8], down_stride = desc[9];
    const u64 n_ff = desc[10], n_embd = desc[11];
    const u64 gate_type = desc[12], up_type = desc[13], down_type = desc[14];
    const u64 hidden_type = desc[15], hidden_bytes = desc[16], act_bytes = desc[17];
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, warps = blockDim.x >> 5;
    // The descriptor and the expert address tables are the model's constants: read (the
    // tables fetched into L1) before waiting on the router, they are not two more memory
    // latencies between its logits and the tables (a one-row step's routing is one warp's
    // chain of them).
    const int lines = (n_expert * 8 + 127) / 128;
    for (int i = threadIdx.x; i < 3 * lines; i += blockDim.x) {
        const u64* addrs = i < lines ? gate_w : i < 2 * lines ? up_w : down_w;
        prefetch_l1((const u8*)addrs + 128 * (i % lines));
    }
    pdl_wait_then_release();
    // A gate, up and down job record and the activation record of active expert j (expert e,
    // c rows from row f of the expert-ordered lists, its first gate/up and down blocks).
    // `gathered`: the gate and up jobs read their activation rows through gather + f (null:
    // the rows in order from acts, as for a one-row step's only row).
    auto write_jobs = [&](int j, int e, u64 c, u64 f, u64 gu_first_j, u64 down_first_j,
                          bool gathered) {
        const u64 gather_at = gathered ? (u64)(gather + f) : 0;
        u64* g = gu + (2 * j) * JOB_FIELDS;
        u64* u = gu + (2 * j + 1) * JOB_FIELDS;
        u64* dn = down + j * JOB_FIELDS;
        u64* gl = glu + j * GLU_FIELDS;
        const u64 gate_fields[JOB_FIELDS] = {gate_w[e], (u64)acts, gate_out + 4 * f * n_ff,
                                             gate_stride, act_bytes, n_ff, n_embd, c,
                                             gate_type, gu_first_j, gather_at, 0};
        const u64 up_fields[JOB_FIELDS] = {up_w[e], (u64)acts, up_out + 4 * f * n_ff,
                                           up_stride, act_bytes, n_ff, n_embd, c, up_type,
                                           gu_first_j + job_blocks(n_ff, c, gate_type, mma_min),
                                           gather_at, 0};
        const u64 down_fields[JOB_FIELDS] = {down_w[e], hidden + f * hidden_bytes,
                                             down_out + 4 * f * n_embd, down_stride,
                                             hidden_bytes, n_embd, n_ff, c, down_type,
                                             down_first_j, 0, 0};
        for (int i = 0; i < JOB_FIELDS; i++) {
            g[i] = gate_fields[i];
            u[i] = up_fields[i];
            dn[i] = down_fields[i];
        }
        gl[0] = gate_out + 4 * f * n_ff;
        gl[1] = up_out + 4 * f * n_ff;
        gl[2] = hidden + f * hidden_bytes;
        gl[3] = n_ff;
        gl[4] = hidden_type;
        gl[5] = f;
        gl[6] = c;
    };
    // Lanes below k of warp 0 hold their slot's expert and final weight for one-row steps.
    unsigned int my_id = 0;
    float my_w = 0.0f;
    // A warp per row (unless moe_topk and moe_count did the rows and the counts).
    if (!counted) {
        for (int r = warp; r < n; r += warps)
            route_row(logits, r, n_expert, k, norm_topk, w_scale, probs[warp], ids, wts, lane,
                      my_id, my_w);
    }
    // A decode step (one row, up to 32 distinct experts, one job each): warp 0 writes every
    // table from its registers, the job of each slot's expert at the expert's rank among the
    // row's (the order the general path below gives): no block-wide passes over shared
    // counts, which made this kernel 9-10 µs of a 100 µs decode layer on the H200.
    if (!counted && n == 1 && k <= 32 && max_jobs == k) {
        if (warp != 0) return;
        unsigned int rank = 0;
        for (int j = 0; j < k; j++) {
            const unsigned int other = __shfl_sync(0xffffffffu, my_id, j);
            rank += (unsigned int)(lane < k && other < my_id);
        }
        // A host expert's job keeps its rank with no tokens (its blocks return at once); its
        // slots read the host's sum for the row instead, the first at weight 1.
        const bool host_slot = lane < k && host_mask && host_mask[my_id];
        const unsigned int host_slots = __ballot_sync(0xffffffffu, host_slot);
        const bool read_here =
            host_slot && __popc(host_slots & ((1u << lane) - 1u)) < (unsigned int)host_read;
        const bool on_host = host_slot && !read_here;
        const unsigned int host_lanes = __ballot_sync(0xffffffffu, on_host);
        if (lane < k) {
            const u64 per_gu = job_blocks(n_ff, 1, gate_type, mma_min) + job_blocks(n_ff, 1, up_type, mma_min);
            // The row is the step's only one: its gate and up jobs read acts' first row without
            // a gather index (one dependent load fewer ahead of their weights).
            write_jobs((int)rank, (int)my_id, on_host ? 0 : 1, rank, rank * per_gu,
                       rank * job_blocks(n_embd, 1, down_type, mma_min), false);
            slot_row[lane] = rank;
            if (on_host) {
                sum_rows[lane] = host_sums;
                sum_w[lane] = lane == __ffs(host_lanes) - 1 ? 1.0f : 0.0f;
            } else {
                sum_rows[lane] = down_out + 4 * (u64)rank * n_embd;
                sum_w[lane] = my_w;
            }
        }
        return;
    }
    __syncthreads();
    const int slots = n * k;
    // Each expert's count and each slot's rank among its expert's slots (in slot order), by a
    // counting sort over chunks of one slot per thread: within a warp the lanes that picked the
    // same expert find each other (match_any), across the chunk's warps and the chunks before
    // it the counts add up. Ranks go in slot_row for now.
    for (int e = threadIdx.x; e < n_expert; e += blockDim.x) count[e] = counted ? counted[e] : 0;
    if (counted) __syncthreads();
    for (int base = 0; !counted && base < slots; base += blockDim.x) {
        for (int x = threadIdx.x; x < warps * n_expert; x += blockDim.x)
            warp_count[x / n_expert][x % n_expert] = 0;
        __syncthreads();
        const int i = base + threadIdx.x;
        const bool valid = i < slots;
        const unsigned int e = valid ? ids[i] : 0xffffffffu;
        const unsigned int same = __match_any_sync(0xffffffffu, e);
        const unsigned int before = __popc(same & ((1u << lane) - 1u));
        if (valid && lane == __ffs(same) - 1) warp_count[warp][e] = __popc(same);
        __syncthreads();
        if (valid) {
            unsigned int r = count[e] + before;
            for (int w = 0; w < warp; w++) r += warp_count[w][e];
            slot_row[i] = r;
        }
        __syncthreads();
        for (int x = threadIdx.x; x < n_expert; x += blockDim.x) {
            unsigned int c = 0;
            for (int w = 0; w < warps; w++) c += warp_count[w][x];
            count[x] += c;
        }
        __syncthreads();
    }
    // The host's experts get no jobs (nor rows): their slots read the host's sums below.
    if (host_mask) {
        for (int e = threadIdx.x; e < n_expert; e += blockDim.x)
            if (host_mask[e]) count[e] = 0;
        __syncthreads();
    }
    // Each expert's first slot and the active experts in ascending order: warp 0 scans, a lane
    // per run of consecutive experts (one thread walking all of them was a serial 128+ steps
    // in every decode layer).
    if (warp == 0) {
        const int per_lane = (n_expert + 31) / 32;
        const int e0 = min(lane * per_lane, n_expert), e1 = min(e0 + per_lane, n_expert);
        unsigned int slots_here = 0, active_here = 0;
        for (int e = e0; e < e1; e++) {
            slots_here += count[e];
            active_here += count[e] != 0;
        }
        unsigned int slots_before = slots_here, active_before = active_here;
        const uint2 totals = warp_exclusive_scan2(slots_before, active_before, lane);
        if (lane == 31) n_active = (int)totals.y;
        for (int e = e0; e < e1; e++) {
            first[e] = slots_before;
            slots_before += count[e];
            if (count[e]) active[active_before++] = e;
        }
    }
    __syncthreads();
    // Each active expert's rows in row order, and where each slot's output row lands.
    for (int i = threadIdx.x; i < slots; i += blockDim.x) {
        if (host_mask && host_mask[ids[i]]) continue;
        const unsigned int at = first[ids[i]] + slot_row[i];
        gather[at] = i / k;
        slot_row[i] = at;
    }
    __syncthreads();
    // Each active expert's first gate/up and down block: the same scan over the active
    // experts (job_blocks divides in 64 bits, which one thread did 3 times per expert).
    if (warp == 0) {
        const int per_lane = (n_active + 31) / 32;
        const int j0 = min(lane * per_lane, n_active), j1 = min(j0 + per_lane, n_active);
        unsigned int gu_here = 0, down_here = 0;
        for (int j = j0; j < j1; j++) {
            const u64 c = count[active[j]];
            gu_here += (unsigned int)(job_blocks(n_ff, c, gate_type, mma_min) + job_blocks(n_ff, c, up_type, mma_min));
            down_here += (unsigned int)job_blocks(n_embd, c, down_type, mma_min);
        }
        unsigned int gu_before = gu_here, down_before = down_here;
        const uint2 totals = warp_exclusive_scan2(gu_before, down_before, lane);
        if (lane == 31) {
            gu_total = totals.x;
            down_total = totals.y;
        }
        for (int j = j0; j < j1; j++) {
            const u64 c = count[active[j]];
            gu_first[j] = gu_before;
            down_first[j] = down_before;
            gu_before += (unsigned int)(job_blocks(n_ff, c, gate_type, mma_min) + job_blocks(n_ff, c, up_type, mma_min));
            down_before += (unsigned int)job_blocks(n_embd, c, down_type, mma_min);
        }
    }
    __syncthreads();
    // A thread per job writes its records.
    for (int j = threadIdx.x; j < max_jobs; j += blockDim.x) {
        {
            u64* g = gu + (2 * j) * JOB_FIELDS;
            u64* u = gu + (2 * j + 1) * JOB_FIELDS;
            u64* dn = down + j * JOB_FIELDS;
            u64* gl = glu + j * GLU_FIELDS;
            if (j < n_active) {
                const int e = active[j];
                write_jobs(j, e, count[e], first[e], gu_first[j], down_first[j], true);
            } else {
                for (int i = 0; i < JOB_FIELDS; i++) {
                    g[i] = 0;
                    u[i] = 0;
                    dn[i] = 0;
                }
                g[5] = u[5] = n_ff;
                dn[5] = n_embd;
                for (int i = 0; i < GLU_FIELDS; i++) gl[i] = 0;
                gl[5] = slots;
                // Unused entries start where the used ones end (a job with no tokens returns).
                g[9] = u[9] = gu_total;
                dn[9] = down_total;
            }
        }
    }
    for (int i = threadIdx.x; i < slots; i += blockDim.x) {
        if (host_mask && host_mask[ids[i]]) {
            // The row's host sum, once: at weight 1 from its first host slot.
            const int t = i / k;
            bool first_host = true;
            for (int j = t * k; j < i; j++) first_host = first_host && !host_mask[ids[j]];
            sum_rows[i] = host_sums + 4 * (u64)t * n_embd;
            sum_w[i] = first_host ? 1.0f : 0.0f;
            continue;
        }
        sum_rows[i] = down_out + 4 * (u64)slot_row[i] * n_embd;
        sum_w[i] = wts[i];
    }
}

// The rows of a step of many rows routed in parallel, a warp per row (moe_route's rows, which
// one block did a warp at a time: 273 µs of a 512-row layer on the H100). 256 threads.
extern "C" __global__ void moe_topk(const float* __restrict__ logits, int n,
                                    const u64* __restrict__ desc,
                                    unsigned int* __restrict__ ids, float* __restrict__ wts) {
    pdl_wait_then_release();
    __shared__ float probs[8][MAX_EXPERTS];
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int r = blockIdx.x * 8 + warp;
    if (r >= n) return;
    unsigned int id = 0;
    float w = 0.0f;
    route_row(logits, r, (int)desc[0], (int)desc[1], (int)desc[2],
              __uint_as_float((unsigned int)desc[3]), probs[warp], ids, wts, lane, id, w);
}

// Each expert's slots in slot order, a warp per expert reading the slots' experts 32 at a time:
// slot_row[i] = slot i's rank among its expert's slots, counted[e] = how many it has (what
// moe_route's counting sort gives). 256 threads.
extern "C" __global__ void moe_count(const unsigned int* __restrict__ ids, int slots,
                                     int n_expert, unsigned int* __restrict__ slot_row,
                                     unsigned int* __restrict__ counted) {
    pdl_wait_then_release();
    const int e = blockIdx.x * 8 + (threadIdx.x >> 5), lane = threadIdx.x & 31;
    if (e >= n_expert) return;
    unsigned int c = 0;
    for (int base = 0; base < slots; base += 32) {
        const int i = base + lane;
        const bool mine = i < slots && ids[i] == (unsigned int)e;
        const unsigned int m = __ballot_sync(0xffffffffu, mine);
        if (mine) slot_row[i] = c + __popc(m & ((1u << lane) - 1u));
        c += __popc(m);
    }
    if (lane == 0) counted[e] = c;
}

// A step whose routed experts are partly the host's computes them there between the device's
// routing and its weighted sum (resident/handoff.rs). The two sides hand each layer over
// through page-locked host memory both address, each waiting on a flag the other sets: the
// device's side is launched (or replayed from a graph) ahead of the host's work, so neither a
// copy, an event nor a launch of the host's sits between the two.
//
// Flags are u32 words in that memory, 0 until set; a waiting kernel gives up after
// HANDOFF_TIMEOUT_NS (the host died or failed without releasing it), sets `failed` and goes on
// with whatever it has, and the host reports the step failed.
#define HANDOFF_TIMEOUT_NS 30000000000ull

__device__ __forceinline__ unsigned int load_acquire_sys(const unsigned int* p) {
    unsigned int v;
    asm volatile("ld.acquire.sys.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
    return v;
}

__device__ __forceinline__ void store_release_sys(unsigned int* p, unsigned int v) {
    asm volatile("st.release.sys.global.u32 [%0], %1;" ::"l"(p), "r"(v) : "memory");
}

__device__ __forceinline__ u64 global_ns() {
    u64 t;
    asm volatile("mov.u64 %0, %globaltimer;" : "=l"(t));
    return t;
}

// The layer's normed rows (`n_floats` of `hn`) and its first `slots` slot experts and weights
// out to the exchange (`xchg`: the rows, then slots_max experts, then slots_max weights), then
// `flag` set once all of it is visible to the host. The last block to finish sets it
// (`done`: a device counter, 0 between launches, that the last block puts back to 0).
extern "C" __global__ void handoff_out(const float* __restrict__ hn,
                                       const unsigned int* __restrict__ ids,
                                       const float* __restrict__ wts, int n_floats, int slots,
                                       int slots_max, float* xchg, unsigned int* flag,
                                       unsigned int* done) {
    pdl_wait_then_release();
    const int stride = gridDim.x * blockDim.x;
    const int i0 = blockIdx.x * blockDim.x + threadIdx.x;
    for (int i = i0; i < n_floats; i += stride) xchg[i] = hn[i];
    unsigned int* xids = (unsigned int*)(xchg + n_floats);
    float* xwts = xchg + n_floats + slots_max;
    for (int i = i0; i < slots; i += stride) {
        xids[i] = ids[i];
        xwts[i] = wts[i];
    }
    __threadfence_system();
    __syncthreads();
    if (threadIdx.x == 0) {
        if (atomicAdd(done, 1u) == gridDim.x - 1) {
            *done = 0;
            __threadfence_system();
            store_release_sys(flag, 1u);
        }
    }
}

// Waits until `flag` is set, then copies `n_floats` from `src` (host memory the host wrote
// before setting it) to `dst` in device memory (n_floats 0: only the wait).
extern "C" __global__ void handoff_in(const unsigned int* flag, const float* src,
                                      float* __restrict__ dst, int n_floats,
                                      unsigned int* failed) {
    pdl_wait_then_release();
    __shared__ int ok;
    if (threadIdx.x == 0) {
        const u64 t0 = global_ns();
        ok = 1;
        while (load_acquire_sys(flag) == 0) {
            if (global_ns() - t0 > HANDOFF_TIMEOUT_NS) {
                store_release_sys(failed, 1u);
                ok = 0;
                break;
            }
            __nanosleep(128);
        }
    }
    __syncthreads();
    if (!ok) return;
    const int stride = gridDim.x * blockDim.x;
    // Volatile loads: the values come from the host's memory, never from a cache line an
    // earlier layer's read left behind.
    for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < n_floats; i += stride)
        dst[i] = __ldcv(src + i);
}

// Sets `flag` once the copies ahead of it on its stream (the host's copy stream) are done.
extern "C" __global__ void handoff_signal(unsigned int* flag) {
    __threadfence_system();
    store_release_sys(flag, 1u);
}
