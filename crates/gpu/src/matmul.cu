// Matrix products on the GPU, compiled by NVRTC when the device is opened. One launch runs a
// whole batch of jobs (q/k/v, the experts of a step): each block finds its job in a table,
// each warp computes one weight row against a tile of up to TT activation rows. A lane takes
// one 32-value segment of the row at a time (a sub-block of a K-quant superblock, a legacy
// block, or 32 plain values), loads it once and multiplies it with every token of the tile,
// in int8 (dp4a) against the same quantized activations the CPU kernels read (Q8_K for the
// K-quants, Q8_0 for the legacy formats), in f32 for float weights.
//
// Block layouts are ggml's (crates/kernels/src/blocks.rs). No headers: NVRTC is given none.

typedef unsigned char u8;
typedef unsigned short u16;
typedef unsigned int u32;
typedef unsigned long long u64;

#define TT 8
#define ROWS_PER_BLOCK 4
#define JOB_FIELDS 12

// ggml type ids.
#define T_F32 0
#define T_F16 1
#define T_Q4_0 2
#define T_Q4_1 3
#define T_Q5_0 6
#define T_Q5_1 7
#define T_Q8_0 8
#define T_Q2_K 10
#define T_Q3_K 11
#define T_Q4_K 12
#define T_Q5_K 13
#define T_Q6_K 14
#define T_IQ2_XXS 16
#define T_IQ2_XS 17
#define T_IQ3_XXS 18
#define T_IQ1_S 19
#define T_IQ4_NL 20
#define T_IQ3_S 21
#define T_IQ2_S 22
#define T_IQ4_XS 23
#define T_IQ1_M 29
#define T_BF16 30
#define T_MXFP4 39

__device__ __forceinline__ float f16_to_f32(u16 h) {
    float f;
    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h));
    return f;
}

__device__ __forceinline__ float bf16_to_f32(u16 h) {
    return __uint_as_float(((u32)h) << 16);
}

// Programmatic dependent launch (compute capability 9.0+): a step's host (resident/launch.rs)
// may launch a kernel while the one ahead of it in the stream still runs. Every kernel
// therefore waits, before it reads or writes anything another kernel touches, until the
// kernel ahead has finished and its memory is visible (which, each kernel waiting on its own
// predecessor, covers every earlier one), then lets the kernel behind it start launching.
// Both are no-ops for a kernel launched the ordinary way and on older devices.
__device__ __forceinline__ void pdl_wait_then_release() {
#if __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.wait;" ::: "memory");
    asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}

// Four bytes at a 2-byte aligned address.
__device__ __forceinline__ u32 ld_u32_a2(const u8* p) {
    const u16* q = (const u16*)p;
    return (u32)q[0] | ((u32)q[1] << 16);
}

// Eight words (32 bytes) at a 2-byte aligned address: nine aligned words and a funnel shift,
// not sixteen 2-byte loads (a Q6_K superblock is 210 bytes, so every other one is only 2-byte
// aligned). Also reads the 2 bytes before p (in p's own aligned word) and up to 4 past the 32:
// callers keep those inside the block.
__device__ __forceinline__ void ld_8u32_a2(const u8* p, u32* out) {
    const u32* b = (const u32*)((unsigned long long)p & ~3ull);
    const u32 shift = ((unsigned long long)p & 2) * 8;
    u32 w[9];
#pragma unroll
    for (int i = 0; i < 9; i++) w[i] = b[i];
#pragma unroll
    for (int i = 0; i < 8; i++) out[i] = __funnelshift_r(w[i], w[i + 1], shift);
}

__device__ __forceinline__ int ld_i16(const u8* p) {
    return (int)*(const short*)p;
}

// Four bytes at any address (MXFP4's blocks are 17 bytes).
__device__ __forceinline__ u32 ld_u32_a1(const u8* p) {
    return (u32)p[0] | ((u32)p[1] << 8) | ((u32)p[2] << 16) | ((u32)p[3] << 24);
}

// Each byte of `idx` (0..15) replaced by that entry of a 16-entry int8 table packed into four
// words (the non-linear levels of IQ4_NL/IQ4_XS and MXFP4): two byte permutes, each over half
// the table, and the index's bit 3 picks between them.
__device__ __forceinline__ u32 lookup16(u32 idx, u32 t0, u32 t1, u32 t2, u32 t3) {
    const u32 x = idx & 0x07070707u;
    const u32 sel = (x & 0x7u) | ((x >> 4) & 0x70u) | ((x >> 8) & 0x700u) | ((x >> 12) & 0x7000u);
    const u32 lo = __byte_perm(t0, t1, sel), hi = __byte_perm(t2, t3, sel);
    const u32 m = ((idx >> 3) & 0x01010101u) * 0xFFu;
    return (lo & ~m) | (hi & m);
}

// Four bits to the fifth bit (value 16) of four bytes: Q5_0/Q5_1's high bits.
__device__ __forceinline__ u32 high_bits4(u32 b) {
    return ((b & 1u) << 4) | ((b & 2u) << 11) | ((b & 4u) << 18) | ((b & 8u) << 25);
}

// Four grid magnitudes (bytes below 128) negated where the low four bits of `signs` say.
__device__ __forceinline__ u32 signed4(u32 v, u32 signs) {
    const u32 m = (((signs & 0xFu) * 0x00204081u) & 0x01010101u) * 0xFFu;
    return __vsub4(v ^ m, m);
}

// Eight grid magnitudes (byte j element j) with their eight sign bits: two words of q.
__device__ __forceinline__ void signed8(u64 g, u32 signs, u32* q) {
    q[0] = signed4((u32)g, signs);
    q[1] = signed4((u32)(g >> 32), signs >> 4);
}

// MXFP4's shared exponent as a float, halved (its levels are stored doubled).
__device__ __forceinline__ float e8m0_half(u8 e) {
    return __uint_as_float(e < 2 ? 0x00200000u << e : ((u32)e - 1) << 23);
}

// Q8_K activation block: d f32, qs[256] i8, bsums[16] i16.
#define Q8K_BYTES 292
// Q8_0 block: d f16, qs[32] i8.
#define Q8_0_BYTES 34

// Q4_K/Q5_K's 6-bit scale and min of sub-block `sub` from the 12 packed bytes, as three words
// (bytes 0-3, 4-7, 8-11). Shifts, not an indexed array: a sub-block that varies by lane would
// put the array in local memory.
__device__ __forceinline__ void k4_scale_min(u32 s0, u32 s1, u32 s2, int sub, int& sc,
                                             int& mn) {
    const int k = 8 * (sub & 3);
    const int b0 = (s0 >> k) & 0xFF, b1 = (s1 >> k) & 0xFF, b2 = (s2 >> k) & 0xFF;
    if (sub < 4) {
        sc = b0 & 63;
        mn = b1 & 63;
    } else {
        sc = (b2 & 0xF) | ((b0 >> 6) << 4);
        mn = (b2 >> 4) | ((b1 >> 6) << 4);
    }
}

// Q4_K and Q5_K share the rest of a sub-block: its 6-bit scale and min (packed in 12 bytes
// after d and dmin), and the dot with the Q8_K activations (their 16-value sums give the min's
// share).
template <int NT>
__device__ __forceinline__ void sub_block_k4(const u8* wb, int sub, const u32* q, int blk,
                                             const u8* const* arow, int nt, float* acc) {
    const u8* sc = wb + 4;
    int scale, mn;
    if (sub < 4) {
        scale = sc[sub] & 63;
        mn = sc[sub + 4] & 63;
    } else {
        scale = (sc[sub + 4] & 0xF) | ((sc[sub - 4] >> 6) << 4);
        mn = (sc[sub + 4] >> 4) | ((sc[sub] >> 6) << 4);
    }
    const float d = f16_to_f32(((const u16*)wb)[0]) * scale;
    const float m = f16_to_f32(((const u16*)wb)[1]) * mn;
#pragma unroll
    for (int t = 0; t < NT; t++) {
        if (t < nt) {
            const u8* ab = arow[t] + blk * Q8K_BYTES;
            const int* q8 = (const int*)(ab + 4 + 32 * sub);
            int sumi = 0;
#pragma unroll
            for (int i = 0; i < 8; i++) sumi = __dp4a((int)q[i], q8[i], sumi);
            const int bsum = ld_i16(ab + 260 + 4 * sub) + ld_i16(ab + 262 + 4 * sub);
            acc[t] += *(const float*)ab * (d * (float)sumi - m * (float)bsum);
        }
    }
}

// Q4_K: d, dmin (f16), scales[12] (6-bit scale and min of 8 sub-blocks), qs[128].
template <int NT>
__device__ __forceinline__ void seg_q4_k(const u8* w, int s, const u8* const* arow,
                                         int nt, float* acc) {
    const int blk = s >> 3, sub = s & 7;
    const u8* wb = w + blk * 144;
    const u32* qs = (const u32*)(wb + 16 + 32 * (sub >> 1));
    const int shift = 4 * (sub & 1);
    u32 q[8];
#pragma unroll
    for (int i = 0; i < 8; i++) q[i] = (qs[i] >> shift) & 0x0F0F0F0Fu;
    sub_block_k4<NT>(wb, sub, q, blk, arow, nt, acc);
}

// Q5_K: d, dmin, scales[12], qh[32] (bit `sub` of byte l: the fifth bit), qs[128].
template <int NT>
__device__ __forceinline__ void seg_q5_k(const u8* w, int s, const u8* const* arow,
                                         int nt, float* acc) {
    const int blk = s >> 3, sub = s & 7;
    const u8* wb = w + blk * 176;
    const u32* qs = (const u32*)(wb + 48 + 32 * (sub >> 1));
    const u32* qh = (const u32*)(wb + 16);
    const int shift = 4 * (sub & 1);
    u32 q[8];
#pragma unroll
    for (int i = 0; i < 8; i++)
        q[i] = ((qs[i] >> shift) & 0x0F0F0F0Fu) | (((qh[i] >> sub) & 0x01010101u) << 4);
    sub_block_k4<NT>(wb, sub, q, blk, arow, nt, acc);
}

// A sub-block's two 16-value halves (q[0..4] and q[4..8]) against token t's activations:
// their integer sums.
__device__ __forceinline__ void dot_halves(const u32* q, const u8* ab, int sub, int* s0,
                                           int* s1) {
    const int* q8 = (const int*)(ab + 4 + 32 * sub);
    int a = 0, b = 0;
#pragma unroll
    for (int i = 0; i < 4; i++) a = __dp4a((int)q[i], q8[i], a);
#pragma unroll
    for (int i = 4; i < 8; i++) b = __dp4a((int)q[i], q8[i], b);
    *s0 = a;
    *s1 = b;
}

// The activations' sum over 16-value group g of a Q8_K block.
__device__ __forceinline__ int bsum16(const u8* ab, int g) {
    return ld_i16(ab + 260 + 2 * g);
}

// Q6_K: ql[128], qh[64], scales[16] i8, d f16; value = d * scale * (q6 - 32). Segment s covers
// values 128*(s/4) + 32*(s%4) .. +32, two scale groups of 16.
template <int NT>
__device__ __forceinline__ void seg_q6_k(const u8* w, int s, const u8* const* arow,
                                         int nt, float* acc) {
    const int blk = s >> 3, half = (s >> 2) & 1, part = s & 3;
    const u8* wb = w + blk * 210;
    const u8* ql = wb + 64 * half + 32 * (part & 1);
    const u8* qh = wb + 128 + 32 * half;
    const signed char* sc = (const signed char*)(wb + 192) + 8 * half + 2 * part;
    // ql's 32 bytes end by byte 128 and qh's by 192 of the 210: the extra word stays inside.
    u32 l[8], h[8], q[8];
    ld_8u32_a2(ql, l);
    ld_8u32_a2(qh, h);
#pragma unroll
    for (int i = 0; i < 8; i++) {
        const u32 lo = part >= 2 ? (l[i] >> 4) & 0x0F0F0F0Fu : l[i] & 0x0F0F0F0Fu;
        q[i] = lo | (((h[i] >> (2 * part)) & 0x03030303u) << 4);
    }
    const float d = f16_to_f32(*(const u16*)(wb + 208));
    const float s0 = d * sc[0], s1 = d * sc[1];
    // Segment s's 32 values are the superblock's sub-block s % 8 (= 4 half + part).
    const int sub = s & 7;
#pragma unroll
    for (int t = 0; t < NT; t++) {
        if (t < nt) {
            const u8* ab = arow[t] + blk * Q8K_BYTES;
            int sum0, sum1;
            dot_halves(q, ab, sub, &sum0, &sum1);
            acc[t] += *(const float*)ab * (s0 * (float)(sum0 - 32 * bsum16(ab, 2 * sub)) +
                                           s1 * (float)(sum1 - 32 * bsum16(ab, 2 * sub + 1)));
        }
    }
}

// The 32-value formats, one block per segment, against Q8_0 activations.
// Q4_0: d f16, qs[16] (low nibbles values 0..15, high 16..31); value = d * (q - 8).
// Q4_1: d, m f16, qs[16]; value = d * q + m.  Q8_0: d f16, qs[32] i8.
// Q5_0: d, qh[4] (bit j: value j's fifth bit), qs[16]; value = d * (q - 16).
// Q5_1: d, m, qh[4], qs[16]; value = d * q + m.  IQ4_NL: d, qs[16]; value = d * level[q].
// MXFP4: e (E8M0), qs[16]; value = 2^(e - 127) * fp4[q] (levels stored doubled).
template <int TYPE>
__device__ __forceinline__ int legacy_bytes() {
    return TYPE == T_Q4_0 || TYPE == T_IQ4_NL ? 18
         : TYPE == T_Q4_1                    ? 20
         : TYPE == T_Q5_0                    ? 22
         : TYPE == T_Q5_1                    ? 24
         : TYPE == T_MXFP4                   ? 17
                                             : 34;
}

template <int TYPE, int NT>
__device__ __forceinline__ void seg_legacy(const u8* w, int s, const u8* const* arow,
                                           int nt, float* acc) {
    const u8* wb = w + s * legacy_bytes<TYPE>();
    u32 q[8];
    float d, m = 0.f;
    if (TYPE == T_Q8_0) {
#pragma unroll
        for (int i = 0; i < 8; i++) q[i] = ld_u32_a2(wb + 2 + 4 * i);
        d = f16_to_f32(*(const u16*)wb);
    } else if (TYPE == T_MXFP4) {
#pragma unroll
        for (int i = 0; i < 4; i++) {
            const u32 v = ld_u32_a1(wb + 1 + 4 * i);
            q[i] = lookup16(v & 0x0F0F0F0Fu, KVALUES_MXFP4_W0, KVALUES_MXFP4_W1,
                            KVALUES_MXFP4_W2, KVALUES_MXFP4_W3);
            q[i + 4] = lookup16((v >> 4) & 0x0F0F0F0Fu, KVALUES_MXFP4_W0, KVALUES_MXFP4_W1,
                                KVALUES_MXFP4_W2, KVALUES_MXFP4_W3);
        }
        d = e8m0_half(wb[0]);
    } else {
        const int qs_at = TYPE == T_Q4_1 ? 4 : TYPE == T_Q5_0 ? 6 : TYPE == T_Q5_1 ? 8 : 2;
        const u8* qs = wb + qs_at;
        u32 qh = 0;
        if (TYPE == T_Q5_0 || TYPE == T_Q5_1) qh = ld_u32_a2(wb + (TYPE == T_Q5_0 ? 2 : 4));
#pragma unroll
        for (int i = 0; i < 4; i++) {
            const u32 v = ld_u32_a2(qs + 4 * i);
            u32 lo = v & 0x0F0F0F0Fu, hi = (v >> 4) & 0x0F0F0F0Fu;
            if (TYPE == T_Q5_0 || TYPE == T_Q5_1) {
                lo |= high_bits4(qh >> (4 * i));
                hi |= high_bits4(qh >> (16 + 4 * i));
            }
            if (TYPE == T_IQ4_NL) {
                lo = lookup16(lo, KVALUES_IQ4NL_W0, KVALUES_IQ4NL_W1, KVALUES_IQ4NL_W2,
                              KVALUES_IQ4NL_W3);
                hi = lookup16(hi, KVALUES_IQ4NL_W0, KVALUES_IQ4NL_W1, KVALUES_IQ4NL_W2,
                              KVALUES_IQ4NL_W3);
            }
            q[i] = lo;
            q[i + 4] = hi;
        }
        d = f16_to_f32(*(const u16*)wb);
        if (TYPE == T_Q4_1 || TYPE == T_Q5_1) m = f16_to_f32(*(const u16*)(wb + 2));
    }
    const bool sums = TYPE == T_Q4_0 || TYPE == T_Q4_1 || TYPE == T_Q5_0 || TYPE == T_Q5_1;
#pragma unroll
    for (int t = 0; t < NT; t++) {
        if (t < nt) {
            const u8* ab = arow[t] + s * Q8_0_BYTES;
            int sumi = 0, sum8 = 0;
#pragma unroll
            for (int i = 0; i < 8; i++) {
                const int x = (int)ld_u32_a2(ab + 2 + 4 * i);
                sumi = __dp4a((int)q[i], x, sumi);
                if (sums) sum8 = __dp4a(0x01010101, x, sum8);
            }
            const float da = f16_to_f32(*(const u16*)ab);
            float v;
            if (TYPE == T_Q4_0) v = d * (float)(sumi - 8 * sum8);
            else if (TYPE == T_Q5_0) v = d * (float)(sumi - 16 * sum8);
            else if (TYPE == T_Q4_1 || TYPE == T_Q5_1) v = d * (float)sumi + m * (float)sum8;
            else v = d * (float)sumi;
            acc[t] += da * v;
        }
    }
}

// The 256-value formats below take a 32-value sub-block per segment against Q8_K activations,
// like the K-quants above: `blk` the superblock, `sub` the sub-block within it.

// Q2_K: scales[16] (low nibble scale, high nibble min, per 16 values), qs[64], d, dmin.
// Sub-block c is bits 2(c%4) of qs[32(c/4)..+32]; value = d * sc * q - dmin * mn.
template <int NT>
__device__ __forceinline__ void seg_q2_k(const u8* w, int s, const u8* const* arow,
                                         int nt, float* acc) {
    const int blk = s >> 3, c = s & 7;
    const u8* wb = w + blk * 84;
    const u32* qs = (const u32*)(wb + 16 + 32 * (c >> 2));
    const int shift = 2 * (c & 3);
    u32 q[8];
#pragma unroll
    for (int i = 0; i < 8; i++) q[i] = (qs[i] >> shift) & 0x03030303u;
    const int sc0 = wb[2 * c], sc1 = wb[2 * c + 1];
    const float d = f16_to_f32(*(const u16*)(wb + 80)), dmin = f16_to_f32(*(const u16*)(wb + 82));
#pragma unroll
    for (int t = 0; t < NT; t++) {
        if (t < nt) {
            const u8* ab = arow[t] + blk * Q8K_BYTES;
            int s0, s1;
            dot_halves(q, ab, c, &s0, &s1);
            const int mins = (sc0 >> 4) * bsum16(ab, 2 * c) + (sc1 >> 4) * bsum16(ab, 2 * c + 1);
            acc[t] += *(const float*)ab *
                      (d * (float)((sc0 & 0xF) * s0 + (sc1 & 0xF) * s1) - dmin * (float)mins);
        }
    }
}

// Q3_K: hmask[32] (bit c of byte l: value l of sub-block c has its third bit), qs[64] (as
// Q2_K), scales[12] (sixteen 6-bit scales, offset by 32), d; value = d * sc * (q - 4 + 4 h).
template <int NT>
__device__ __forceinline__ void seg_q3_k(const u8* w, int s, const u8* const* arow,
                                         int nt, float* acc) {
    const int blk = s >> 3, c = s & 7;
    const u8* wb = w + blk * 110;
    const u8* qs = wb + 32 + 32 * (c >> 2);
    const int shift = 2 * (c & 3);
    u32 q[8];
#pragma unroll
    for (int i = 0; i < 8; i++) {
        const u32 lo = (ld_u32_a2(qs + 4 * i) >> shift) & 0x03030303u;
        const u32 h = (ld_u32_a2(wb + 4 * i) >> c) & 0x01010101u;
        q[i] = lo | (h << 2);
    }
    const u8* raw = wb + 96;
    int sc[2];
#pragma unroll
    for (int k = 0; k < 2; k++) {
        const int i = 2 * c + k;
        const int low = i < 8 ? raw[i] & 0xF : raw[i - 8] >> 4;
        sc[k] = (low | (((raw[8 + (i & 3)] >> (2 * (i >> 2))) & 3) << 4)) - 32;
    }
    const float d = f16_to_f32(*(const u16*)(wb + 108));
#pragma unroll
    for (int t = 0; t < NT; t++) {
        if (t < nt) {
            const u8* ab = arow[t] + blk * Q8K_BYTES;
            int s0, s1;
            dot_halves(q, ab, c, &s0, &s1);
            const int sumi = sc[0] * (s0 - 4 * bsum16(ab, 2 * c)) +
                             sc[1] * (s1 - 4 * bsum16(ab, 2 * c + 1));
            acc[t] += *(const float*)ab * d * (float)sumi;
        }
    }
}

// A sub-block of integer values q[0..8] scaled by ds0 (first 16 values) and ds1 (last 16),
// plus `delta` times the sub-block's activation sum (IQ1_S), into every token's sum.
template <int NT>
__device__ __forceinline__ void sub_block_iq(const u32* q, int blk, int sub, float ds0, float ds1,
                                             const u8* const* arow, int nt, float* acc) {
#pragma unroll
    for (int t = 0; t < NT; t++) {
        if (t < nt) {
            const u8* ab = arow[t] + blk * Q8K_BYTES;
            int s0, s1;
            dot_halves(q, ab, sub, &s0, &s1);
            acc[t] += *(const float*)ab * (ds0 * (float)s0 + ds1 * (float)s1);
        }
    }
}

// IQ4_XS: d, scales_h (u16, 2 bits a sub-block), scales_l[4] (4 bits a sub-block), qs[128]
// (16 bytes a sub-block, nibbles as IQ4_NL); value = d * (ls - 32) * level[q].
template <int NT>
__device__ __forceinline__ void seg_iq4_xs(const u8* w, int s, const u8* const* arow,
                                           int nt, float* acc) {
    const int blk = s >> 3, sub = s & 7;
    const u8* wb = w + blk * 136;
    const int ls = ((wb[4 + (sub >> 1)] >> (4 * (sub & 1))) & 0xF) |
                   (((*(const u16*)(wb + 2) >> (2 * sub)) & 3) << 4);
    const float dl = f16_to_f32(*(const u16*)wb) * (float)(ls - 32);
    const u32* qs = (const u32*)(wb + 8 + 16 * sub);
    u32 q[8];
#pragma unroll
    for (int i = 0; i < 4; i++) {
        const u32 v = qs[i];
        q[i] = lookup16(v & 0x0F0F0F0Fu, KVALUES_IQ4NL_W0, KVALUES_IQ4NL_W1, KVALUES_IQ4NL_W2,
                        KVALUES_IQ4NL_W3);
        q[i + 4] = lookup16((v >> 4) & 0x0F0F0F0Fu, KVALUES_IQ4NL_W0, KVALUES_IQ4NL_W1,
                            KVALUES_IQ4NL_W2, KVALUES_IQ4NL_W3);
    }
    sub_block_iq<NT>(q, blk, sub, dl, dl, arow, nt, acc);
}

// IQ2_XXS: d, then per sub-block two words: four 8-bit grid indices, and four 7-bit sign
// indices with a 4-bit scale on top; value = d * (0.5 + ls) / 4 * grid * sign.
template <int NT>
__device__ __forceinline__ void seg_iq2_xxs(const u8* w, int s, const u8* const* arow,
                                            int nt, float* acc) {
    const int blk = s >> 3, sub = s & 7;
    const u8* wb = w + blk * 66;
    const u32 idx = ld_u32_a2(wb + 2 + 8 * sub), aux = ld_u32_a2(wb + 6 + 8 * sub);
    u32 q[8];
#pragma unroll
    for (int l = 0; l < 4; l++) {
        signed8(IQ2XXS_GRID[(idx >> (8 * l)) & 0xFF], KSIGNS_IQ2XS[(aux >> (7 * l)) & 127],
                q + 2 * l);
    }
    const float db = f16_to_f32(*(const u16*)wb) * (0.5f + (float)(aux >> 28)) * 0.25f;
    sub_block_iq<NT>(q, blk, sub, db, db, arow, nt, acc);
}

// IQ2_XS and IQ2_S: a sub-block's halves scaled by d (0.5 + ls) / 4, ls the two nibbles of
// its scale byte.
template <int NT>
__device__ __forceinline__ void iq2_nibble_scales(const u32* q, int blk, int sub, float d, int sc,
                                                  const u8* const* arow, int nt, float* acc) {
    sub_block_iq<NT>(q, blk, sub, d * (0.5f + (float)(sc & 0xF)) * 0.25f,
                     d * (0.5f + (float)(sc >> 4)) * 0.25f, arow, nt, acc);
}

// IQ2_XS: d, qs[32] u16 (9-bit grid index, 7-bit sign index), scales[8] (a nibble per 16
// values); value = d * (0.5 + ls) / 4 * grid * sign.
template <int NT>
__device__ __forceinline__ void seg_iq2_xs(const u8* w, int s, const u8* const* arow,
                                           int nt, float* acc) {
    const int blk = s >> 3, sub = s & 7;
    const u8* wb = w + blk * 74;
    const u16* qs = (const u16*)(wb + 2 + 8 * sub);
    u32 q[8];
#pragma unroll
    for (int l = 0; l < 4; l++) {
        const u32 v = qs[l];
        signed8(IQ2XS_GRID[v & 511], KSIGNS_IQ2XS[v >> 9], q + 2 * l);
    }
    iq2_nibble_scales<NT>(q, blk, sub, f16_to_f32(*(const u16*)wb), wb[66 + sub], arow, nt, acc);
}

// IQ2_S: d, qs[32] (low 8 bits of 10-bit grid indices), signs[32], qh[8] (the indices' top
// two bits), scales[8]; value = d * (0.5 + ls) / 4 * grid * sign.
template <int NT>
__device__ __forceinline__ void seg_iq2_s(const u8* w, int s, const u8* const* arow,
                                          int nt, float* acc) {
    const int blk = s >> 3, sub = s & 7;
    const u8* wb = w + blk * 82;
    const u8* qs = wb + 2 + 4 * sub;
    const u8* signs = wb + 34 + 4 * sub;
    const u32 qh = wb[66 + sub];
    u32 q[8];
#pragma unroll
    for (int l = 0; l < 4; l++) {
        signed8(IQ2S_GRID[qs[l] | ((qh << (8 - 2 * l)) & 0x300)], signs[l], q + 2 * l);
    }
    iq2_nibble_scales<NT>(q, blk, sub, f16_to_f32(*(const u16*)wb), wb[74 + sub], arow, nt, acc);
}

// IQ3_XXS: d, qs[64] (8-bit grid indices of 4 values), then a word per sub-block: four
// 7-bit sign indices and a 4-bit scale; value = d * (0.5 + ls) / 2 * grid * sign.
template <int NT>
__device__ __forceinline__ void seg_iq3_xxs(const u8* w, int s, const u8* const* arow,
                                            int nt, float* acc) {
    const int blk = s >> 3, sub = s & 7;
    const u8* wb = w + blk * 98;
    const u8* qs = wb + 2 + 8 * sub;
    const u32 aux = ld_u32_a2(wb + 66 + 4 * sub);
    u32 q[8];
#pragma unroll
    for (int l = 0; l < 4; l++) {
        const u64 g = IQ3XXS_GRID[qs[2 * l]] | ((u64)IQ3XXS_GRID[qs[2 * l + 1]] << 32);
        signed8(g, KSIGNS_IQ2XS[(aux >> (7 * l)) & 127], q + 2 * l);
    }
    const float db = f16_to_f32(*(const u16*)wb) * (0.5f + (float)(aux >> 28)) * 0.5f;
    sub_block_iq<NT>(q, blk, sub, db, db, arow, nt, acc);
}

// IQ3_S: d, qs[64] (low 8 bits of 9-bit grid indices), qh[8], signs[32], scales[4] (a
// nibble per sub-block); value = d * (1 + 2 ls) * grid * sign.
template <int NT>
__device__ __forceinline__ void seg_iq3_s(const u8* w, int s, const u8* const* arow,
                                          int nt, float* acc) {
    const int blk = s >> 3, sub = s & 7;
    const u8* wb = w + blk * 110;
    const u8* qs = wb + 2 + 8 * sub;
    const u32 qh = wb[66 + sub];
    const u8* signs = wb + 74 + 4 * sub;
    u32 q[8];
#pragma unroll
    for (int l = 0; l < 4; l++) {
        const u64 g = IQ3S_GRID[qs[2 * l] | ((qh << (8 - 2 * l)) & 256)] |
                      ((u64)IQ3S_GRID[qs[2 * l + 1] | ((qh << (7 - 2 * l)) & 256)] << 32);
        signed8(g, signs[l], q + 2 * l);
    }
    const int ls = (wb[106 + (sub >> 1)] >> (4 * (sub & 1))) & 0xF;
    const float db = f16_to_f32(*(const u16*)wb) * (float)(1 + 2 * ls);
    sub_block_iq<NT>(q, blk, sub, db, db, arow, nt, acc);
}

// IQ1_S and IQ1_M: grid values -1, 0, 1 (int8 bytes) plus a shift of ±1/8 per group.
#define IQ1_DELTA 0.125f

// IQ1_S: d, qs[32] (low 8 bits of 11-bit grid indices), qh[8] u16 (per sub-block: the
// indices' top 3 bits, a 3-bit scale, the shift's sign); value = d (2 ls + 1) (grid ± 1/8).
template <int NT>
__device__ __forceinline__ void seg_iq1_s(const u8* w, int s, const u8* const* arow,
                                          int nt, float* acc) {
    const int blk = s >> 3, sub = s & 7;
    const u8* wb = w + blk * 50;
    const u8* qs = wb + 2 + 4 * sub;
    const u32 qh = *(const u16*)(wb + 34 + 2 * sub);
    u32 q[8];
#pragma unroll
    for (int l = 0; l < 4; l++) {
        const u64 g = IQ1S_GRID[qs[l] | (((qh >> (3 * l)) & 7) << 8)];
        q[2 * l] = (u32)g;
        q[2 * l + 1] = (u32)(g >> 32);
    }
    const float dl = f16_to_f32(*(const u16*)wb) * (float)(2 * ((qh >> 12) & 7) + 1);
    const float delta = (qh & 0x8000) ? -IQ1_DELTA : IQ1_DELTA;
#pragma unroll
    for (int t = 0; t < NT; t++) {
        if (t < nt) {
            const u8* ab = arow[t] + blk * Q8K_BYTES;
            int s0, s1;
            dot_halves(q, ab, sub, &s0, &s1);
            const int bsum = bsum16(ab, 2 * sub) + bsum16(ab, 2 * sub + 1);
            acc[t] += *(const float*)ab * dl * ((float)(s0 + s1) + delta * (float)bsum);
        }
    }
}

// IQ1_M: qs[32], qh[16] (per 8 values: the index's top 3 bits and the shift's sign),
// scales[8] (four u16: 3-bit scales per 16 values, and the f16 d in their top nibbles);
// value = d (2 ls + 1) (grid ± 1/8).
template <int NT>
__device__ __forceinline__ void seg_iq1_m(const u8* w, int s, const u8* const* arow,
                                          int nt, float* acc) {
    const int blk = s >> 3, sub = s & 7;
    const u8* wb = w + blk * 56;
    const u8* qs = wb + 4 * sub;
    const u8* qh = wb + 32 + 2 * sub;
    const u16* sc = (const u16*)(wb + 48);
    const u16 d16 = (u16)((sc[0] >> 12) | ((sc[1] >> 8) & 0x00F0) | ((sc[2] >> 4) & 0x0F00) |
                          (sc[3] & 0xF000));
    const float d = f16_to_f32(d16);
    const int shift = 6 * (sub & 1);
    const float dl1 = d * (float)(2 * ((sc[sub >> 1] >> shift) & 7) + 1);
    const float dl2 = d * (float)(2 * ((sc[sub >> 1] >> (shift + 3)) & 7) + 1);
    u32 q[8];
    float delta[4];
#pragma unroll
    for (int l = 0; l < 4; l++) {
        const u32 h = qh[l >> 1] >> (4 * (l & 1));
        const u64 g = IQ1S_GRID[qs[l] | ((h & 7) << 8)];
        q[2 * l] = (u32)g;
        q[2 * l + 1] = (u32)(g >> 32);
        delta[l] = (h & 8) ? -IQ1_DELTA : IQ1_DELTA;
    }
#pragma unroll
    for (int t = 0; t < NT; t++) {
        if (t < nt) {
            const u8* ab = arow[t] + blk * Q8K_BYTES;
            const int* q8 = (const int*)(ab + 4 + 32 * sub);
            float part[2] = {0.f, 0.f};
#pragma unroll
            for (int l = 0; l < 4; l++) {
                const int sumi = __dp4a((int)q[2 * l + 1], q8[2 * l + 1],
                                        __dp4a((int)q[2 * l], q8[2 * l], 0));
                const int sum8 = __dp4a(0x01010101, q8[2 * l + 1],
                                        __dp4a(0x01010101, q8[2 * l], 0));
                part[l >> 1] += (float)sumi + delta[l] * (float)sum8;
            }
            acc[t] += *(const float*)ab * (dl1 * part[0] + dl2 * part[1]);
        }
    }
}

// A 16-bit float of TYPE (f16 or bf16) as f32.
template <int TYPE>
__device__ __forceinline__ float half_to_f32(u16 h) {
    return TYPE == T_F16 ? f16_to_f32(h) : bf16_to_f32(h);
}

// Element c of a float row of TYPE (f32, f16 or bf16) as f32.
template <int TYPE>
__device__ __forceinline__ float float_weight(const u8* w, long long c) {
    return TYPE == T_F32 ? ((const float*)w)[c] : half_to_f32<TYPE>(((const u16*)w)[c]);
}

// Float weights (f32, f16, bf16) against f32 activations: lane l takes columns l, l + 32, ...
// of the whole row, so a warp's loads of weights and activations are contiguous.
template <int TYPE, int NT>
__device__ __forceinline__ void row_float(const u8* w, int cols, int lane,
                                          const u8* const* arow, int nt, float* acc) {
    for (int c = lane; c < cols; c += 32) {
        const float v = float_weight<TYPE>(w, c);
#pragma unroll
        for (int t = 0; t < NT; t++) {
            if (t < nt) acc[t] += v * ((const float*)arow[t])[c];
        }
    }
}

#define SEGMENTS(f)                                                                 \
    for (int s = lane; s < n_seg; s += 32) f<NT>(w, s, arow, nt, acc);             \
    break
#define LEGACY(T)                                                                   \
    for (int s = lane; s < n_seg; s += 32) seg_legacy<T, NT>(w, s, arow, nt, acc); \
    break

// The formats less often met: the low-bit and non-linear ones.
template <int NT>
__device__ __forceinline__ void row_dot_other(int type, const u8* w, int n_seg, int lane,
                                              const u8* const* arow, int nt, float* acc) {
    switch (type) {
    case T_Q2_K: SEGMENTS(seg_q2_k);
    case T_Q3_K: SEGMENTS(seg_q3_k);
    case T_IQ4_XS: SEGMENTS(seg_iq4_xs);
    case T_IQ2_XXS: SEGMENTS(seg_iq2_xxs);
    case T_IQ2_XS: SEGMENTS(seg_iq2_xs);
    case T_IQ2_S: SEGMENTS(seg_iq2_s);
    case T_IQ3_XXS: SEGMENTS(seg_iq3_xxs);
    case T_IQ3_S: SEGMENTS(seg_iq3_s);
    case T_IQ1_S: SEGMENTS(seg_iq1_s);
    case T_IQ1_M: SEGMENTS(seg_iq1_m);
    case T_Q5_0: LEGACY(T_Q5_0);
    case T_Q5_1: LEGACY(T_Q5_1);
    case T_IQ4_NL: LEGACY(T_IQ4_NL);
    case T_MXFP4: LEGACY(T_MXFP4);
    default: break;
    }
}

// Whether `type` is one of row_dot_other's.
__device__ __forceinline__ bool other_format(int type) {
    return !(type == T_Q4_K || type == T_Q5_K || type == T_Q6_K || type == T_Q4_0 ||
             type == T_Q4_1 || type == T_Q8_0 || type == T_F32 || type == T_F16 || type == T_BF16);
}

// One lane's share of a weight row of `type` (segments lane, lane + 32, ...; float rows
// column by column) against a tile of tokens: the common formats, or (OTHER) the others.
// Every type `supports` (lib.rs) names is one or the other.
template <int NT, bool OTHER>
__device__ __forceinline__ void row_dot(int type, const u8* w, int cols, int lane,
                                        const u8* const* arow, int nt, float* acc) {
    const int n_seg = (cols + 31) / 32;
    if (OTHER) {
        row_dot_other<NT>(type, w, n_seg, lane, arow, nt, acc);
        return;
    }
    switch (type) {
    case T_Q4_K: SEGMENTS(seg_q4_k);
    case T_Q5_K: SEGMENTS(seg_q5_k);
    case T_Q6_K: SEGMENTS(seg_q6_k);
    case T_Q4_0: LEGACY(T_Q4_0);
    case T_Q4_1: LEGACY(T_Q4_1);
    case T_Q8_0: LEGACY(T_Q8_0);
    case T_F32: row_float<T_F32, NT>(w, cols, lane, arow, nt, acc); break;
    case T_F16: row_float<T_F16, NT>(w, cols, lane, arow, nt, acc); break;
    case T_BF16: row_float<T_BF16, NT>(w, cols, lane, arow, nt, acc); break;
    default: break;
    }
}
#undef SEGMENTS
#undef LEGACY

// The tensor-core path: a block of 4 warps computes MMA_ROWS weight rows × MMA_TOKENS tokens
// of a K-quant job with `mma_min` or more tokens, a 16-row × 8-token int8 `mma` per
// 32-value sub-block (two 16-value ones for Q6_K, whose scales cover 16 values). The block's
// tokens' Q8_K activations go through shared memory a superblock at a time; each warp keeps
// its two weight rows per thread in registers and reuses them for all the block's tokens.
// A sub-block's exact integer sums are scaled by the rows' integer sub-block scales (and the
// mins by the activations' 32-value sums) in int32 over a superblock, then once in float.
#define MMA_ROWS 64
#define MMA_TOKENS 32
// Blocks of matmul_mma an SM must hold: its register budget (matmul_table.rs
// `kernel_compile_options`). 4 (128 registers, some spilled) beat 2 (none spilled) by 1.2–1.4×
// on an H100.
#ifndef MMA_MIN_BLOCKS
#define MMA_MIN_BLOCKS 4
#endif
// A token's superblock of activation bytes in shared memory: 256 + 16 so that the eight
// tokens of a B fragment load fall in distinct banks.
#define MMA_ACT_STRIDE 272

// Whether a job takes the tensor-core path. `mma_min`, the fewest tokens that do, is the
// launch's (the host's `step_mma_min` for the step; every kernel reading a table gets the same).
__device__ __forceinline__ bool mma_path(u64 type, u64 n, int mma_min) {
    return n >= (u64)mma_min && (type == T_Q4_K || type == T_Q5_K || type == T_Q6_K);
}

// Whether a job is one token against float weights, which a block takes a row at a time
// (float_row_block; matmul_table.rs `float_row_blocks` passes 0 to turn it off).
#ifndef FLOAT_ROW_BLOCKS
#define FLOAT_ROW_BLOCKS 1
#endif
__device__ __forceinline__ bool float_row_job(u64 type, u64 n) {
    return FLOAT_ROW_BLOCKS && n == 1 && (type == T_F32 || type == T_F16 || type == T_BF16);
}

// Blocks of one job (host: matmul_table.rs `job_blocks`, which must agree).
__device__ __forceinline__ u64 job_blocks(u64 rows, u64 n, u64 type, int mma_min) {
    if (mma_path(type, n, mma_min))
        return ((rows + MMA_ROWS - 1) / MMA_ROWS) * ((n + MMA_TOKENS - 1) / MMA_TOKENS);
    if (float_row_job(type, n)) return rows;
    return ((rows + ROWS_PER_BLOCK - 1) / ROWS_PER_BLOCK) * ((n + TT - 1) / TT);
}

struct __align__(16) MmaShared {
    u8 qs[MMA_TOKENS * MMA_ACT_STRIDE];
    float d[MMA_TOKENS];
    short bsum[MMA_TOKENS * 16];
    const u8* row[MMA_TOKENS];
};

// A block's two stages of activations (one computed, the next arriving).
struct __align__(16) MmaStages {
    MmaShared stage[2];
};

// A 4-byte asynchronous copy into shared memory, zeros where `src_bytes` is 0.
__device__ __forceinline__ void cp_async4(void* dst, const void* src, int src_bytes) {
    const unsigned int d = (unsigned int)__cvta_generic_to_shared(dst);
    asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;" ::"r"(d), "l"(src),
                 "r"(src_bytes));
}

__device__ __forceinline__ void cp_async_commit() {
    asm volatile("cp.async.commit_group;");
}

// Waits until at most one group of this thread's copies is still in flight.
__device__ __forceinline__ void cp_async_wait_one() {
    asm volatile("cp.async.wait_group 1;" ::: "memory");
}

__device__ __forceinline__ void prefetch_l1(const void* p) {
    asm volatile("prefetch.global.L1 [%0];" ::"l"(p));
}

// D (16 × 8, s32) += A (16 × 32, s8, rows g and g + 8 of lane's group) · B (32 × 8, s8).
// a[0]: row g, k 4·tig..+3; a[1]: row g + 8, same k; a[2], a[3]: the same rows, k + 16.
// b0: k 4·tig..+3 of column g; b1: k + 16. D: c[0], c[1] row g, columns 2·tig, 2·tig + 1;
// c[2], c[3] row g + 8.
__device__ __forceinline__ void mma_k32(int* c, const u32* a, u32 b0, u32 b1) {
    asm("mma.sync.aligned.m16n8k32.row.col.s32.s8.s8.s32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
        "{%8,%9}, {%0,%1,%2,%3};"
        : "+r"(c[0]), "+r"(c[1]), "+r"(c[2]), "+r"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// The same over 16 values: a0 row g, a1 row g + 8, k 4·tig..+3; b k 4·tig..+3.
__device__ __forceinline__ void mma_k16(int* c, u32 a0, u32 a1, u32 b) {
    asm("mma.sync.aligned.m16n8k16.row.col.s32.s8.s8.s32 {%0,%1,%2,%3}, {%4,%5}, {%6}, "
        "{%0,%1,%2,%3};"
        : "+r"(c[0]), "+r"(c[1]), "+r"(c[2]), "+r"(c[3])
        : "r"(a0), "r"(a1), "r"(b));
}

__device__ __forceinline__ int byte_at(const u32* w, int i) {
    return (int)((w[i >> 2] >> (8 * (i & 3))) & 0xFF);
}

// One superblock of Q4_K or Q5_K rows pa (row g) and pb (row g + 8) against the block's
// tokens in shared memory, added to acc[n-tile][fragment element].
template <int TYPE>
__device__ __forceinline__ void mma_superblock_k4(const u8* pa, const u8* pb,
                                                  const MmaShared* sh, int g, int tig,
                                                  float (*acc)[4]) {
    const int qs_at = TYPE == T_Q4_K ? 16 : 48;
    const u32 ha = *(const u32*)pa, hb = *(const u32*)pb;
    const u32 sa[3] = {*(const u32*)(pa + 4), *(const u32*)(pa + 8), *(const u32*)(pa + 12)};
    const u32 sb[3] = {*(const u32*)(pb + 4), *(const u32*)(pb + 8), *(const u32*)(pb + 12)};
    u32 qha0 = 0, qha1 = 0, qhb0 = 0, qhb1 = 0;
    if (TYPE == T_Q5_K) {
        qha0 = *(const u32*)(pa + 16 + 4 * tig);
        qha1 = *(const u32*)(pa + 32 + 4 * tig);
        qhb0 = *(const u32*)(pb + 16 + 4 * tig);
        qhb1 = *(const u32*)(pb + 32 + 4 * tig);
    }
    int isd[4][4], ism[4][4];
#pragma unroll
    for (int j = 0; j < 4; j++)
#pragma unroll
        for (int i = 0; i < 4; i++) isd[j][i] = ism[j][i] = 0;
#pragma unroll
    for (int p = 0; p < 4; p++) {
        const u32 qa0 = *(const u32*)(pa + qs_at + 32 * p + 4 * tig);
        const u32 qa1 = *(const u32*)(pa + qs_at + 32 * p + 16 + 4 * tig);
        const u32 qb0 = *(const u32*)(pb + qs_at + 32 * p + 4 * tig);
        const u32 qb1 = *(const u32*)(pb + qs_at + 32 * p + 16 + 4 * tig);
#pragma unroll
        for (int h = 0; h < 2; h++) {
            const int sub = 2 * p + h;
            u32 a[4] = {(qa0 >> (4 * h)) & 0x0F0F0F0Fu, (qb0 >> (4 * h)) & 0x0F0F0F0Fu,
                        (qa1 >> (4 * h)) & 0x0F0F0F0Fu, (qb1 >> (4 * h)) & 0x0F0F0F0Fu};
            if (TYPE == T_Q5_K) {
                a[0] |= ((qha0 >> sub) & 0x01010101u) << 4;
                a[1] |= ((qhb0 >> sub) & 0x01010101u) << 4;
                a[2] |= ((qha1 >> sub) & 0x01010101u) << 4;
                a[3] |= ((qhb1 >> sub) & 0x01010101u) << 4;
            }
            int sca, mna, scb, mnb;
            k4_scale_min(sa[0], sa[1], sa[2], sub, sca, mna);
            k4_scale_min(sb[0], sb[1], sb[2], sub, scb, mnb);
#pragma unroll
            for (int j = 0; j < 4; j++) {
                const u8* bq = sh->qs + (8 * j + g) * MMA_ACT_STRIDE + 32 * sub + 4 * tig;
                int c[4] = {0, 0, 0, 0};
                mma_k32(c, a, *(const u32*)bq, *(const u32*)(bq + 16));
                const int t = 8 * j + 2 * tig;
                const int bs0 = sh->bsum[16 * t + 2 * sub] + sh->bsum[16 * t + 2 * sub + 1];
                const int bs1 = sh->bsum[16 * t + 16 + 2 * sub] + sh->bsum[16 * t + 17 + 2 * sub];
                isd[j][0] += sca * c[0];
                isd[j][1] += sca * c[1];
                isd[j][2] += scb * c[2];
                isd[j][3] += scb * c[3];
                ism[j][0] += mna * bs0;
                ism[j][1] += mna * bs1;
                ism[j][2] += mnb * bs0;
                ism[j][3] += mnb * bs1;
            }
        }
    }
    const float da = f16_to_f32((u16)ha), ma = f16_to_f32((u16)(ha >> 16));
    const float db = f16_to_f32((u16)hb), mb = f16_to_f32((u16)(hb >> 16));
#pragma unroll
    for (int j = 0; j < 4; j++) {
        const int t = 8 * j + 2 * tig;
        const float x0 = sh->d[t], x1 = sh->d[t + 1];
        acc[j][0] += x0 * (da * (float)isd[j][0] - ma * (float)ism[j][0]);
        acc[j][1] += x1 * (da * (float)isd[j][1] - ma * (float)ism[j][1]);
        acc[j][2] += x0 * (db * (float)isd[j][2] - mb * (float)ism[j][2]);
        acc[j][3] += x1 * (db * (float)isd[j][3] - mb * (float)ism[j][3]);
    }
}

// Q6_K's 6-bit values of sub-block part `part` from four ql and qh bytes, as s8 (q - 32).
__device__ __forceinline__ u32 q6_bytes(u32 ql, u32 qh, int part) {
    const u32 lo = part >= 2 ? (ql >> 4) & 0x0F0F0F0Fu : ql & 0x0F0F0F0Fu;
    return __vsub4(lo | (((qh >> (2 * part)) & 0x03030303u) << 4), 0x20202020u);
}

__device__ __forceinline__ void mma_superblock_q6k(const u8* pa, const u8* pb,
                                                   const MmaShared* sh, int g, int tig,
                                                   float (*acc)[4]) {
    u32 sa[4], sb[4];
#pragma unroll
    for (int i = 0; i < 4; i++) {
        sa[i] = ld_u32_a2(pa + 192 + 4 * i);
        sb[i] = ld_u32_a2(pb + 192 + 4 * i);
    }
    int isd[4][4];
#pragma unroll
    for (int j = 0; j < 4; j++)
#pragma unroll
        for (int i = 0; i < 4; i++) isd[j][i] = 0;
#pragma unroll
    for (int half = 0; half < 2; half++) {
        const u32 ha0 = ld_u32_a2(pa + 128 + 32 * half + 4 * tig);
        const u32 ha1 = ld_u32_a2(pa + 128 + 32 * half + 16 + 4 * tig);
        const u32 hb0 = ld_u32_a2(pb + 128 + 32 * half + 4 * tig);
        const u32 hb1 = ld_u32_a2(pb + 128 + 32 * half + 16 + 4 * tig);
#pragma unroll
        for (int odd = 0; odd < 2; odd++) {
            const int off = 64 * half + 32 * odd + 4 * tig;
            const u32 la0 = ld_u32_a2(pa + off), la1 = ld_u32_a2(pa + off + 16);
            const u32 lb0 = ld_u32_a2(pb + off), lb1 = ld_u32_a2(pb + off + 16);
#pragma unroll
            for (int hi = 0; hi < 2; hi++) {
                const int part = odd + 2 * hi;
                const int sub = 4 * half + part;
                const u32 a0 = q6_bytes(la0, ha0, part), a1 = q6_bytes(lb0, hb0, part);
                const u32 a2 = q6_bytes(la1, ha1, part), a3 = q6_bytes(lb1, hb1, part);
                // Scales of the sub-block's two 16-value groups, rows g and g + 8.
                const int s0a = (int)(signed char)byte_at(sa, 2 * sub);
                const int s1a = (int)(signed char)byte_at(sa, 2 * sub + 1);
                const int s0b = (int)(signed char)byte_at(sb, 2 * sub);
                const int s1b = (int)(signed char)byte_at(sb, 2 * sub + 1);
#pragma unroll
                for (int j = 0; j < 4; j++) {
                    const u8* bq = sh->qs + (8 * j + g) * MMA_ACT_STRIDE + 32 * sub + 4 * tig;
                    int c0[4] = {0, 0, 0, 0}, c1[4] = {0, 0, 0, 0};
                    mma_k16(c0, a0, a1, *(const u32*)bq);
                    mma_k16(c1, a2, a3, *(const u32*)(bq + 16));
                    isd[j][0] += s0a * c0[0] + s1a * c1[0];
                    isd[j][1] += s0a * c0[1] + s1a * c1[1];
                    isd[j][2] += s0b * c0[2] + s1b * c1[2];
                    isd[j][3] += s0b * c0[3] + s1b * c1[3];
                }
            }
        }
    }
    const float da = f16_to_f32(*(const u16*)(pa + 208)), db = f16_to_f32(*(const u16*)(pb + 208));
#pragma unroll
    for (int j = 0; j < 4; j++) {
        const int t = 8 * j + 2 * tig;
        const float x0 = sh->d[t], x1 = sh->d[t + 1];
        acc[j][0] += x0 * da * (float)isd[j][0];
        acc[j][1] += x1 * da * (float)isd[j][1];
        acc[j][2] += x0 * db * (float)isd[j][2];
        acc[j][3] += x1 * db * (float)isd[j][3];
    }
}

// Block `local` of a job on the tensor-core path (every thread of the block calls it). The
// activations are staged a superblock ahead (cp.async into the other half of `st`) and the
// next superblock's weight rows prefetched into L1 while one is computed, so a block does not
// wait for either between superblocks: the expert launches of a 512-row step took 25–30 %
// less time than loading each superblock after the last was done (docs/perf.md).
__device__ void mma_block(const u64* job, long long local, MmaStages* st) {
    const long long rows = (long long)job[5];
    const int n = (int)job[7], cols = (int)job[6], type = (int)job[8];
    const long long rblocks = (rows + MMA_ROWS - 1) / MMA_ROWS;
    const long long r0 = (local % rblocks) * MMA_ROWS;
    const int t0 = (int)(local / rblocks) * MMA_TOKENS;
    const int valid = min(MMA_TOKENS, n - t0);
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, tig = lane & 3;
    const long long a_stride = (long long)job[4];
    const unsigned int* gather = (const unsigned int*)job[10];
    const u8* acts = (const u8*)job[1];
    // The previous block's last reads of both stages are behind its final barrier. The row
    // addresses live in stage 0.
    if (threadIdx.x < MMA_TOKENS) {
        const int t = threadIdx.x;
        const u8* r = t < valid ? acts + (long long)(gather ? gather[t0 + t] : (unsigned int)(t0 + t)) *
                                              a_stride
                                : nullptr;
        st->stage[0].row[t] = r;
    }
    __syncthreads();
    const MmaShared* rows_of = &st->stage[0];
    // Token 0 is always valid: the address a zero-filling copy names.
    const u8* any_row = rows_of->row[0];
    auto fill = [&](int s, int blk) {
        MmaShared* sh = &st->stage[s];
        for (int i = threadIdx.x; i < MMA_TOKENS * 64; i += blockDim.x) {
            const u8* r = rows_of->row[i >> 6];
            cp_async4(sh->qs + (i >> 6) * MMA_ACT_STRIDE + 4 * (i & 63),
                      r ? r + blk * Q8K_BYTES + 4 + 4 * (i & 63) : any_row, r ? 4 : 0);
        }
        for (int i = threadIdx.x; i < MMA_TOKENS * 8; i += blockDim.x) {
            const u8* r = rows_of->row[i >> 3];
            cp_async4((u32*)sh->bsum + i, r ? r + blk * Q8K_BYTES + 260 + 4 * (i & 7) : any_row,
                      r ? 4 : 0);
        }
        if (threadIdx.x < MMA_TOKENS) {
            const u8* r = rows_of->row[threadIdx.x];
            cp_async4(sh->d + threadIdx.x, r ? r + blk * Q8K_BYTES : any_row, r ? 4 : 0);
        }
    };
    const long long ra = r0 + 16 * warp + g, rb = ra + 8;
    const long long stride = (long long)job[3];
    const u8* wa = (const u8*)job[0] + min(ra, rows - 1) * stride;
    const u8* wb = (const u8*)job[0] + min(rb, rows - 1) * stride;
    const int block_bytes = type == T_Q4_K ? 144 : type == T_Q5_K ? 176 : 210;
    // Four points no more than 70 bytes apart from a superblock's first byte to its last: every
    // cache line it touches gets one of the row's four lanes' prefetches.
    const int probe = tig == 3 ? block_bytes - 1 : 70 * tig;
    float acc[4][4];
#pragma unroll
    for (int j = 0; j < 4; j++)
#pragma unroll
        for (int i = 0; i < 4; i++) acc[j][i] = 0.0f;
    const int n_blk = cols / 256;
    fill(0, 0);
    cp_async_commit();
    for (int blk = 0; blk < n_blk; blk++) {
        if (blk + 1 < n_blk) {
            fill((blk + 1) & 1, blk + 1);
            prefetch_l1(wa + (long long)(blk + 1) * block_bytes + probe);
            prefetch_l1(wb + (long long)(blk + 1) * block_bytes + probe);
        }
        // An empty group when nothing was filled keeps the count the wait below expects.
        cp_async_commit();
        cp_async_wait_one();
        __syncthreads();
        const MmaShared* sh = &st->stage[blk & 1];
        const u8* pa = wa + (long long)blk * block_bytes;
        const u8* pb = wb + (long long)blk * block_bytes;
        if (type == T_Q4_K) mma_superblock_k4<T_Q4_K>(pa, pb, sh, g, tig, acc);
        else if (type == T_Q5_K) mma_superblock_k4<T_Q5_K>(pa, pb, sh, g, tig, acc);
        else mma_superblock_q6k(pa, pb, sh, g, tig, acc);
        // Every warp is done with this stage before the next iteration refills it.
        __syncthreads();
    }
    float* out = (float*)job[2];
    const bool add = job[11] & 1;
#pragma unroll
    for (int j = 0; j < 4; j++) {
#pragma unroll
        for (int i = 0; i < 4; i++) {
            const int t = 8 * j + 2 * tig + (i & 1);
            const long long r = i < 2 ? ra : rb;
            if (t < valid && r < rows) {
                float* o = out + (long long)(t0 + t) * rows + r;
                *o = add ? *o + acc[j][i] : acc[j][i];
            }
        }
    }
}

// The weight row this thread's warp takes in block `local` of a dp4a-path job (tiles of
// tokens outer), and in `tile` that tile.
__device__ __forceinline__ long long dp4a_row(const u64* job, long long local, long long* tile) {
    if (float_row_job(job[8], job[7])) {
        *tile = 0;
        return local;
    }
    // A job of one tile (decode's, and most of a prompt's experts) has one block per row group:
    // no 64-bit division.
    if (job[7] <= (u64)TT) {
        *tile = 0;
        return local * ROWS_PER_BLOCK + (threadIdx.x >> 5);
    }
    const long long rb = ((long long)job[5] + ROWS_PER_BLOCK - 1) / ROWS_PER_BLOCK;
    *tile = local / rb;
    return (local % rb) * ROWS_PER_BLOCK + (threadIdx.x >> 5);
}

// One token against one float row, the block's threads splitting its columns (four
// consecutive ones a thread, in one 16- or 8-byte load where the row and the activations are
// aligned). A decode router is a few rows (128 of 2048 f32 columns): a warp a row put them on
// 32 SMs, whose loads in flight per SM bounded the launch (7 µs under ncu on an H100, where
// 128 blocks read its 1 MB in about 3).
template <int TYPE>
__device__ __noinline__ void float_row_block(const u64* job, long long row) {
    __shared__ float warp_sums[ROWS_PER_BLOCK];
    const int cols = (int)job[6];
    const u8* w = (const u8*)job[0] + row * (long long)job[3];
    const unsigned int* gather = (const unsigned int*)job[10];
    const float* a = (const float*)((const u8*)job[1] +
                                    (long long)(gather ? gather[0] : 0u) * (long long)job[4]);
    const int elem = TYPE == T_F32 ? 4 : 2;
    float s = 0.0f;
    if ((cols & 3) == 0 && (((unsigned long long)w & (4 * elem - 1)) | ((unsigned long long)a & 15)) == 0) {
#pragma unroll 4
        for (int c4 = threadIdx.x; c4 < cols / 4; c4 += blockDim.x) {
            const float4 y = ((const float4*)a)[c4];
            float4 x;
            if (TYPE == T_F32) {
                x = ((const float4*)w)[c4];
            } else {
                const uint2 h = ((const uint2*)w)[c4];
                x = make_float4(half_to_f32<TYPE>((u16)h.x), half_to_f32<TYPE>((u16)(h.x >> 16)),
                                half_to_f32<TYPE>((u16)h.y), half_to_f32<TYPE>((u16)(h.y >> 16)));
            }
            s += x.x * y.x;
            s += x.y * y.y;
            s += x.z * y.z;
            s += x.w * y.w;
        }
    } else {
        for (int c = threadIdx.x; c < cols; c += blockDim.x) s += float_weight<TYPE>(w, c) * a[c];
    }
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) s += __shfl_xor_sync(0xffffffffu, s, o);
    if ((threadIdx.x & 31) == 0) warp_sums[threadIdx.x >> 5] = s;
    __syncthreads();
    if (threadIdx.x == 0) {
        float total = 0.0f;
#pragma unroll
        for (int i = 0; i < ROWS_PER_BLOCK; i++) total += warp_sums[i];
        float* o = (float*)job[2] + row;
        *o = (job[11] & 1) ? *o + total : total;
    }
    // The next block of the grid-stride loop writes warp_sums again.
    __syncthreads();
}

// Block `local` of a job on the dp4a path: each warp one weight row against up to TT tokens.
// NT is how many tokens a warp is compiled for: TT, or 1 for steps of one token (decode),
// whose jobs have at most one; its registers go from 80 to fewer, so more blocks are resident.
template <int NT, bool OTHER>
__device__ __forceinline__ void dp4a_rows(const u64* job, long long local, int t_off) {
    const int lane = threadIdx.x & 31;
    const long long rows = (long long)job[5];
    const int n = (int)job[7];
    long long tile;
    const long long row = dp4a_row(job, local, &tile);
    const long long t0l = tile * TT + t_off;
    // Whole warps leave together: the shuffles below need every lane.
    if (row >= rows || t0l >= n) return;
    const int t0 = (int)t0l;
    const int nt = min(NT, n - t0);
    const long long a_stride = (long long)job[4];
    const u8* w = (const u8*)job[0] + row * (long long)job[3];
    const unsigned int* gather = (const unsigned int*)job[10];
    const u8* arow[NT];
#pragma unroll
    for (int t = 0; t < NT; t++) {
        const int tt = min(t0 + t, n - 1);
        arow[t] = (const u8*)job[1] + (long long)(gather ? gather[tt] : (unsigned int)tt) * a_stride;
    }
    const int cols = (int)job[6];
    float acc[NT];
#pragma unroll
    for (int t = 0; t < NT; t++) acc[t] = 0.f;
    row_dot<NT, OTHER>((int)job[8], w, cols, lane, arow, nt, acc);
    float* out = (float*)job[2];
#pragma unroll
    for (int t = 0; t < NT; t++) {
        if (t < nt) {
            float v = acc[t];
#pragma unroll
            for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
            if (lane == 0) {
                float* o = out + (long long)(t0 + t) * rows + row;
                *o = (job[11] & 1) ? *o + v : v;
            }
        }
    }
}

// The other formats' blocks in a function of their own, called rather than inlined, and a
// tile of eight tokens in two passes of four: their registers then do not raise those of the
// common formats' loops (matmul_one stays at 56 registers, matmul_grouped at 80, neither
// spilling).
template <int NT>
__device__ __noinline__ void dp4a_block_other(const u64* job, long long local) {
    if (NT == 1) {
        dp4a_rows<1, true>(job, local, 0);
    } else {
#pragma unroll 1
        for (int t = 0; t < TT; t += 2) dp4a_rows<2, true>(job, local, t);
    }
}

template <int NT>
__device__ __forceinline__ void dp4a_block(const u64* job, long long local) {
    if (float_row_job(job[8], job[7])) {
        if (local >= (long long)job[5]) return;
        if (job[8] == T_F32) float_row_block<T_F32>(job, local);
        else if (job[8] == T_F16) float_row_block<T_F16>(job, local);
        else float_row_block<T_BF16>(job, local);
        return;
    }
    if (other_format((int)job[8])) dp4a_block_other<NT>(job, local);
    else dp4a_rows<NT, false>(job, local, 0);
}

// table: n_jobs records of JOB_FIELDS u64s: weights, activations, output (device addresses),
// weight row stride (bytes), activation row stride (bytes), rows, cols, tokens, ggml type, the
// job's first block, a gather index (u32 per token: which activation row; 0 = the rows in
// order), flags (bit 0: add to the output instead of writing it). A job has job_blocks()
// blocks, numbered from its first block (tiles outer); the last record's first block plus its
// blocks is the total. Two kernels read a table: matmul_grouped runs the blocks of dp4a-path
// jobs, matmul_mma those of tensor-core jobs (they differ in registers and shared memory), each
// skipping the other's. Their grids stride over the blocks, so a grid may be smaller than the
// total (a capped launch) or larger (an upper bound for tables built on the device).
// The last of a table's n records (of `fields` u64s each, field `first` the record's first
// block, nondecreasing) whose first block is at or before block b.
__device__ __forceinline__ const u64* record_of_block(const u64* table, int n, int fields,
                                                      int first, long long b) {
    int lo = 0, hi = n - 1;
    while (lo < hi) {
        const int mid = (lo + hi + 1) >> 1;
        if ((long long)table[mid * fields + first] <= b) lo = mid;
        else hi = mid - 1;
    }
    return table + lo * fields;
}

__device__ __forceinline__ const u64* find_job(const u64* table, int n_jobs, long long b,
                                               long long* local, int mma_min) {
    const u64* job = record_of_block(table, n_jobs, JOB_FIELDS, 9, b);
    *local = b - (long long)job[9];
    if (*local < 0 || *local >= (long long)job_blocks(job[5], job[7], job[8], mma_min))
        return nullptr;
    return job;
}

__device__ __forceinline__ long long table_blocks(const u64* table, int n_jobs, int mma_min) {
    const u64* last = table + (long long)(n_jobs - 1) * JOB_FIELDS;
    return (long long)(last[9] + job_blocks(last[5], last[7], last[8], mma_min));
}

// The weight rows of this block's first job block fetched into L2. Only for a table the host
// copied in before the step's first kernel (`early`): it and the weights are then readable
// before pdl_wait_then_release, and the rows' memory latency overlaps the kernel ahead.
__device__ __forceinline__ void prefetch_first_rows(const u64* table, int n_jobs, int mma_min) {
    long long local;
    const u64* job = find_job(table, n_jobs, blockIdx.x, &local, mma_min);
    if (!job || mma_path(job[8], job[7], mma_min)) return;
    long long tile;
    const long long row = dp4a_row(job, local, &tile);
    if (row >= (long long)job[5]) return;
    const unsigned long long start = job[0] + (unsigned long long)row * job[3];
    const unsigned long long end = start + job[3];
    for (unsigned long long p = (start & ~127ull) + (threadIdx.x & 31) * 128; p < end;
         p += 32 * 128)
        asm volatile("prefetch.global.L2 [%0];" ::"l"(p));
}

// `uniform` > 0: job j's blocks are [j · uniform, (j + 1) · uniform) (a one-row step's expert
// tables, which moe_route's fast path lays out so), and a block finds its job by division
// instead of reading the last record for the total and searching the first blocks: two fewer
// steps in the chain of dependent loads ahead of the weights.
template <int NT>
__device__ __forceinline__ void matmul_dp4a(const u64* __restrict__ table, int n_jobs,
                                            int mma_min, int early, int uniform) {
    if (early && n_jobs > 0) prefetch_first_rows(table, n_jobs, mma_min);
    pdl_wait_then_release();
    if (n_jobs <= 0) return;
    const long long total =
        uniform > 0 ? (long long)n_jobs * uniform : table_blocks(table, n_jobs, mma_min);
    for (long long b = blockIdx.x; b < total; b += gridDim.x) {
        long long local;
        const u64* job;
        if (uniform > 0) {
            const int j = (int)b / uniform;
            local = b - (long long)j * uniform;
            job = table + (long long)j * JOB_FIELDS;
            // A job of no tokens (a host expert's) has no blocks: its blocks skip it.
            if (local >= (long long)job_blocks(job[5], job[7], job[8], mma_min)) job = nullptr;
        } else {
            job = find_job(table, n_jobs, b, &local, mma_min);
        }
        if (job && !mma_path(job[8], job[7], mma_min)) dp4a_block<NT>(job, local);
    }
}

// Blocks of the dp4a kernels an SM must hold: their register budgets (matmul_table.rs
// `kernel_compile_options`), 80 and 56 registers at 6 and 9.
#ifndef GROUPED_MIN_BLOCKS
#define GROUPED_MIN_BLOCKS 6
#endif
#ifndef ONE_MIN_BLOCKS
#define ONE_MIN_BLOCKS 9
#endif

// `mma_min`: the fewest tokens of a job on the tensor-core path (mma_path); `early`: the table
// was copied in before the step's first kernel (prefetch_first_rows).
extern "C" __global__ void __launch_bounds__(128, GROUPED_MIN_BLOCKS)
    matmul_grouped(const u64* __restrict__ table, int n_jobs, int mma_min, int early) {
    matmul_dp4a<TT>(table, n_jobs, mma_min, early, 0);
}

// The same for tables whose jobs have at most one token each (the host launches it for steps
// of one row only), with `uniform` as matmul_dp4a's (0: search the table).
extern "C" __global__ void __launch_bounds__(128, ONE_MIN_BLOCKS)
    matmul_one(const u64* __restrict__ table, int n_jobs, int mma_min, int early, int uniform) {
    matmul_dp4a<1>(table, n_jobs, mma_min, early, uniform);
}

// Arguments as matmul_grouped's (the tensor-core blocks fetch nothing ahead).
extern "C" __global__ void __launch_bounds__(128, MMA_MIN_BLOCKS)
    matmul_mma(const u64* __restrict__ table, int n_jobs, int mma_min, int early) {
    __shared__ MmaStages sh;
    pdl_wait_then_release();
    if (n_jobs <= 0) return;
    const long long total = table_blocks(table, n_jobs, mma_min);
    for (long long b = blockIdx.x; b < total; b += gridDim.x) {
        long long local;
        const u64* job = find_job(table, n_jobs, b, &local, mma_min);
        if (job && mma_path(job[8], job[7], mma_min)) mma_block(job, local, &sh);
    }
}

// An expert's gated activation, SiLU(gate) * up, quantized in place of the CPU to the form its
// down projection reads. table: n_jobs records of GLU_FIELDS u64s: gate, up (f32 rows of
// `width`), hidden (output rows), width, ggml type of the output form (Q8_K, Q8_0 or F32),
// first row, rows. One block of 256 threads per row.
#define GLU_FIELDS 7
#define T_Q8_K 15

__device__ __forceinline__ u16 f32_to_f16(float f) {
    u16 h;
    asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(f));
    return h;
}

__device__ __forceinline__ float silu_mul(float g, float u) {
    return g / (1.0f + expf(-g)) * u;
}

// One Q8_0 block (32 values, lane l holding value l) quantized by a warp, as the CPU does.
__device__ __forceinline__ void warp_quant_q8_0(float v, u8* out, int lane) {
    float amax = fabsf(v);
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, o));
    const float d = amax / 127.0f;
    const float id = amax != 0.0f ? 127.0f / amax : 0.0f;
    out[2 + lane] = (u8)(signed char)__float2int_rn(v * id);
    if (lane == 0) *(u16*)out = f32_to_f16(d);
}

// One Q8_K block (256 values, lane l holding 8l..8l+7 in v) quantized by a warp: the scale
// from the value of largest magnitude, the first such one (as the CPU picks it).
__device__ __forceinline__ void warp_quant_q8_k(const float* v, u8* out, int lane) {
    float best = 0.0f, best_v = 0.0f;
    int best_i = 0x7fffffff;
#pragma unroll
    for (int i = 0; i < 8; i++) {
        if (fabsf(v[i]) > best) {
            best = fabsf(v[i]);
            best_v = v[i];
            best_i = 8 * lane + i;
        }
    }
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
        const float ob = __shfl_xor_sync(0xffffffffu, best, o);
        const float ov = __shfl_xor_sync(0xffffffffu, best_v, o);
        const int oi = __shfl_xor_sync(0xffffffffu, best_i, o);
        if (ob > best || (ob == best && oi < best_i)) {
            best = ob;
            best_v = ov;
            best_i = oi;
        }
    }
    if (best == 0.0f) {
        for (int i = lane; i < Q8K_BYTES; i += 32) out[i] = 0;
        return;
    }
    const float iscale = -127.0f / best_v;
    int sum = 0;
#pragma unroll
    for (int i = 0; i < 8; i++) {
        const int q = min(127, __float2int_rn(iscale * v[i]));
        out[4 + 8 * lane + i] = (u8)(signed char)q;
        sum += q;
    }
    sum += __shfl_down_sync(0xffffffffu, sum, 1);
    if ((lane & 1) == 0) *(short*)(out + 260 + lane) = (short)sum;
    if (lane == 0) *(float*)out = 1.0f / iscale;
}

extern "C" __global__ void glu_quantize(const u64* __restrict__ table, int n_jobs) {
    pdl_wait_then_release();
    const int b = blockIdx.x;
    const u64* job = record_of_block(table, n_jobs, GLU_FIELDS, 5, b);
    const long long r = b - (long long)job[5];
    if (r < 0 || r >= (long long)job[6]) return;
    const int width = (int)job[3];
    const float* g = (const float*)job[0] + r * width;
    const float* u = (const float*)job[1] + r * width;
    const int type = (int)job[4];
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    if (type == T_F32) {
        float* h = (float*)job[2] + r * width;
        for (int i = threadIdx.x; i < width; i += blockDim.x) h[i] = silu_mul(g[i], u[i]);
        return;
    }
    if (type == T_Q8_0) {
        u8* row = (u8*)job[2] + r * (width / 32) * 34;
        for (int blk = warp; blk < width / 32; blk += blockDim.x / 32)
            warp_quant_q8_0(silu_mul(g[blk * 32 + lane], u[blk * 32 + lane]), row + blk * 34, lane);
        return;
    }
    u8* row = (u8*)job[2] + r * (width / 256) * Q8K_BYTES;
    for (int blk = warp; blk < width / 256; blk += blockDim.x / 32) {
        float v[8];
#pragma unroll
        for (int i = 0; i < 8; i++) {
            const int c = blk * 256 + 8 * lane + i;
            v[i] = silu_mul(g[c], u[c]);
        }
        warp_quant_q8_k(v, row + blk * Q8K_BYTES, lane);
    }
}

// Each token's weighted sum of its experts' output rows. offsets[t]..offsets[t + 1] index
// `rows` (device addresses of f32 rows of `width`) and `weights`. Grid (tokens, column
// chunks): a thread per column of its chunk, so one token's sum is spread over the device. With
// `accumulate` the sum is added to `out` (the residual stream) instead of written. Up to
// SUM_SLOTS experts a token, every address and weight is loaded before the first row value and
// every row value before the first sum: one after the other, a decode token's eight experts
// were sixteen memory latencies in a row (4.4 µs on the H200). The sum keeps the slots' order.
#define SUM_SLOTS 16
extern "C" __global__ void weighted_sum(const unsigned int* __restrict__ offsets,
                                        const u64* __restrict__ rows,
                                        const float* __restrict__ weights, int width,
                                        float* __restrict__ out, int accumulate) {
    // The offsets come with the step's input (the resident step) or from launches that
    // finished before this one started (an ordinary launch): readable before the wait.
    const int t = blockIdx.x;
    const unsigned int e0 = offsets[t], e1 = offsets[t + 1];
    pdl_wait_then_release();
    const unsigned int ne = e1 - e0;
    if (ne <= SUM_SLOTS) {
        const float* src[SUM_SLOTS];
        float wt[SUM_SLOTS];
#pragma unroll
        for (unsigned int j = 0; j < SUM_SLOTS; j++) {
            src[j] = j < ne ? (const float*)rows[e0 + j] : nullptr;
            wt[j] = j < ne ? weights[e0 + j] : 0.0f;
        }
        for (int c = blockIdx.y * blockDim.x + threadIdx.x; c < width;
             c += blockDim.x * gridDim.y) {
            float* o = out + (long long)t * width + c;
            const float prior = accumulate ? *o : 0.0f;
            float v[SUM_SLOTS];
#pragma unroll
            for (unsigned int j = 0; j < SUM_SLOTS; j++) v[j] = j < ne ? src[j][c] : 0.0f;
            float acc = 0.0f;
#pragma unroll
            for (unsigned int j = 0; j < SUM_SLOTS; j++)
                if (j < ne) acc += wt[j] * v[j];
            *o = accumulate ? prior + acc : acc;
        }
        return;
    }
    for (int c = blockIdx.y * blockDim.x + threadIdx.x; c < width; c += blockDim.x * gridDim.y) {
        float acc = 0.0f;
        for (unsigned int e = e0; e < e1; e++) acc += weights[e] * ((const float*)rows[e])[c];
        float* o = out + (long long)t * width + c;
        *o = accumulate ? *o + acc : acc;
    }
}
