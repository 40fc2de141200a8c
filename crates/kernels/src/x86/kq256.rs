//! K-quant dot products on 256-bit registers, one 32-element group per register, shared by the
//! AVX2 and AVX-512 kernel sets: each expands a macro here with its own way to scale the 16-bit
//! pair sums by the sub-block scale and accumulate them (`vpmaddwd` + `vpaddd` with AVX2, one
//! `vpdpwssd` with AVX-512 VNNI).
//!
//! Quants stay unsigned for `vpmaddubsw` (products ≤ 63·127, so pair sums never saturate i16).
//! Offsets (Q3_K's 4, Q6_K's 32) and mins (Q2_K, Q4_K, Q5_K) are folded in once per superblock
//! through the exact activation sums `bsums`; where an offset is removed that way, the integer
//! sum is reduced before conversion (the offset term sits in other lanes than the products it
//! cancels). Scales are unpacked with vector operations (`crate::x86::scales`) and broadcast
//! per sub-block with `vpshufb`.
//!
//! On Zen 4 these measured faster than 512-bit versions (two groups per register) for Q2_K to
//! Q6_K: building the wider registers (broadcasts, variable shifts, inserts) costs more than the
//! halved instruction count saves. High bits (Q3_K, Q5_K) are moved with shifts in both sets:
//! AVX-512's `vptestmb` and a masked add, two instructions instead of four, measured slower
//! (Q3_K 11.0 against 13.4 GB/s).

use std::arch::x86_64::*;

use crate::blocks::BlockQ6K;
use crate::x86::simd256::bcast_f16;

/// What the kernel macros below use, imported at the start of each expansion.
pub(crate) mod prelude {
    pub(crate) use super::{K4_MINS, K4_SCALE, Q2K_SCALE, Q3K_SCALE, Q6K_SCALE, fma_d_dmin};
    pub(crate) use crate::blocks::{
        BlockQ2K, BlockQ3K, BlockQ4K, BlockQ5K, BlockQ6K, BlockQ8K, QK_K,
    };
    pub(crate) use crate::x86::scales::{unpack_k4, unpack_q3k};
    pub(crate) use crate::x86::simd256::{
        f16_scalar, hsum_epi32, hsum_ps, load128, load128_of, load256, load256_of,
    };
    pub(crate) use std::arch::x86_64::*;
}

/// `vpshufb` control making 16-bit lanes of source bytes: `lo` in the low 128-bit lane and `hi`
/// in the high one, zero-extended.
const fn byte_words(lo: u8, hi: u8) -> [u8; 32] {
    let mut out = [0x80u8; 32];
    let mut i = 0;
    while i < 32 {
        out[i] = if i < 16 { lo } else { hi };
        i += 2;
    }
    out
}

/// `vpshufb` control making 16-bit lanes from source 16-bit lane `lo` (low 128-bit lane) and
/// `hi` (high 128-bit lane).
const fn word_words(lo: u8, hi: u8) -> [u8; 32] {
    let mut out = [0u8; 32];
    let mut i = 0;
    while i < 32 {
        let w = if i < 16 { lo } else { hi };
        out[i] = 2 * w + (i % 2) as u8;
        i += 1;
    }
    out
}

/// Q4_K/Q5_K: sub-block j's scale (byte j of the unpacked scales) in every 16-bit lane.
pub(crate) static K4_SCALE: [[u8; 32]; 8] = {
    let mut t = [[0u8; 32]; 8];
    let mut j = 0;
    while j < 8 {
        t[j] = byte_words(j as u8, j as u8);
        j += 1;
    }
    t
};

/// Q4_K/Q5_K mins (bytes 8..16 of the unpacked scales) each repeated over the two 16-bit bsums
/// of its 32 elements: `[m0, m0, m1, m1, m2, m2, m3, m3 | m4, m4, ... m7, m7]`.
pub(crate) static K4_MINS: [u8; 32] = {
    let mut t = [0x80u8; 32];
    let mut i = 0;
    while i < 16 {
        t[2 * i] = 8 + (i / 2) as u8;
        i += 1;
    }
    t
};

/// Q2_K: the register of half h, shift s covers groups 8h+2s (low lane) and 8h+2s+1 (high).
pub(crate) static Q2K_SCALE: [[u8; 32]; 8] = {
    let mut t = [[0u8; 32]; 8];
    let mut k = 0;
    while k < 8 {
        t[k] = byte_words(2 * k as u8, 2 * k as u8 + 1);
        k += 1;
    }
    t
};

/// Q3_K: from the eight i16 scales of one half, groups 2s (low lane) and 2s+1 (high lane).
pub(crate) static Q3K_SCALE: [[u8; 32]; 4] = [
    word_words(0, 1),
    word_words(2, 3),
    word_words(4, 5),
    word_words(6, 7),
];

/// `acc_d + d·dy·isum` and `acc_m − dmin·dy·msum` from the f16 pair `[d, dmin]` at `dm`.
///
/// # Safety
/// `dm..dm + 4` is readable: the pair, through a pointer to the whole block (not to `d` alone).
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
pub(crate) unsafe fn fma_d_dmin(
    acc: &mut [__m256; 2],
    isum: __m256i,
    msum: __m256i,
    dm: *const u8,
    dy: f32,
) {
    // SAFETY: the caller's contract; `read_unaligned` has no alignment requirement.
    let dm = _mm_cvtph_ps(_mm_set1_epi32(unsafe {
        (dm as *const i32).read_unaligned()
    }));
    let dm = _mm_mul_ps(dm, _mm_set1_ps(dy));
    let d = _mm256_broadcastss_ps(dm);
    let dmin = _mm256_broadcastss_ps(_mm_movehdup_ps(dm));
    acc[0] = _mm256_fmadd_ps(d, _mm256_cvtepi32_ps(isum), acc[0]);
    acc[1] = _mm256_fnmadd_ps(dmin, _mm256_cvtepi32_ps(msum), acc[1]);
}

/// The running sum of a Q5_K dot in the AVX2/AVX-512 levels' arithmetic (Q4_K's is
/// `crate::x86::q4k_octets`): each
/// superblock's integer lanes converted and scaled lane by lane (`fma_d_dmin`), the lanes added
/// at the end.
pub(crate) struct LaneSums([__m256; 2]);

impl LaneSums {
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    pub(crate) fn new() -> Self {
        LaneSums([_mm256_setzero_ps(); 2])
    }

    /// One superblock, as for [`SuperblockSums::push`].
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    pub(crate) fn push(
        &mut self,
        isum: __m256i,
        msum: __m256i,
        dy: f32,
        d: [u8; 2],
        dmin: [u8; 2],
    ) {
        let dm = [d[0], d[1], dmin[0], dmin[1]];
        // SAFETY: `dm` is the four bytes [d, dmin], as `fma_d_dmin` reads them from a block.
        unsafe { fma_d_dmin(&mut self.0, isum, msum, dm.as_ptr(), dy) };
    }

    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    pub(crate) fn finish(self) -> f32 {
        crate::x86::simd256::hsum_ps(_mm256_add_ps(self.0[0], self.0[1]))
    }
}

/// The running sum of a Q4_K/Q5_K dot in the scalar reference's arithmetic: each superblock's
/// exact integer sums (as 8-lane vectors) wait in a batch of eight, which is reduced across
/// lanes at once (`hsums`) and put through the reference's float step with one superblock per
/// lane; the eight results are then added to the scalar sum one by one, in superblock order, as
/// the reference does.
/// Reducing each superblock alone measured ~25 % slower on L2-resident weights (Zen 4).
pub(crate) struct SuperblockSums {
    acc: f32,
    len: usize,
    isum: [__m256i; 8],
    msum: [__m256i; 8],
    dy: [f32; 8],
    d: [[u8; 2]; 8],
    dmin: [[u8; 2]; 8],
}

impl SuperblockSums {
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    pub(crate) fn new() -> Self {
        SuperblockSums {
            acc: 0.0,
            len: 0,
            isum: [_mm256_setzero_si256(); 8],
            msum: [_mm256_setzero_si256(); 8],
            dy: [0.0; 8],
            d: [[0; 2]; 8],
            dmin: [[0; 2]; 8],
        }
    }

    /// One superblock: its lanes of Σ scale·products and of Σ min·bsums, the activations'
    /// scale and the block's f16 `d` and `dmin`.
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    pub(crate) fn push(
        &mut self,
        isum: __m256i,
        msum: __m256i,
        dy: f32,
        d: [u8; 2],
        dmin: [u8; 2],
    ) {
        if self.store(isum, msum, dy, d, dmin) {
            self.flush();
        }
    }

    /// Queues one superblock; whether the batch of eight is full.
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    fn store(&mut self, isum: __m256i, msum: __m256i, dy: f32, d: [u8; 2], dmin: [u8; 2]) -> bool {
        let i = self.len;
        self.isum[i] = isum;
        self.msum[i] = msum;
        self.dy[i] = dy;
        self.d[i] = d;
        self.dmin[i] = dmin;
        self.len += 1;
        self.len == 8
    }

    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    fn flush(&mut self) {
        let step = self.steps();
        for &v in &step[..self.len] {
            self.acc += v;
        }
        self.len = 0;
    }

    /// The reference's float step of each waiting superblock (lanes `0..len`).
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    fn steps(&self) -> [f32; 8] {
        // SAFETY: each load reads exactly one of the 8-element arrays (16 or 32 bytes).
        let (dy, d, dmin) = unsafe {
            (
                _mm256_loadu_ps(self.dy.as_ptr()),
                _mm256_cvtph_ps(_mm_loadu_si128(self.d.as_ptr() as *const __m128i)),
                _mm256_cvtph_ps(_mm_loadu_si128(self.dmin.as_ptr() as *const __m128i)),
            )
        };
        let scaled = _mm256_mul_ps(
            _mm256_mul_ps(dy, d),
            _mm256_cvtepi32_ps(crate::x86::simd256::hsums(&self.isum)),
        );
        let mins = _mm256_mul_ps(
            _mm256_mul_ps(dy, dmin),
            _mm256_cvtepi32_ps(crate::x86::simd256::hsums(&self.msum)),
        );
        crate::x86::simd256::lanes(_mm256_sub_ps(scaled, mins))
    }

    /// The dot product: the superblocks still waiting added, then the sum.
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    pub(crate) fn finish(mut self) -> f32 {
        if self.len > 0 {
            self.flush();
        }
        self.acc
    }
}

/// [`SuperblockSums`] over a row cut into chunks of `per_chunk` superblocks: chunk c's value,
/// written to `out[c]`, is what `SuperblockSums::finish` gives for that chunk alone (its steps
/// added to 0.0 in order), but the batches of eight run across chunk boundaries, so chunks of
/// one superblock (a chunked decode) still reduce eight superblocks at a time instead of one.
pub(crate) struct ChunkSums {
    sums: SuperblockSums,
    per_chunk: usize,
    in_chunk: usize,
    out: *mut f32,
    done: usize,
}

impl ChunkSums {
    /// # Safety
    /// `out` is writable for as many values as chunks will be completed.
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    pub(crate) unsafe fn new(per_chunk: usize, out: *mut f32) -> Self {
        ChunkSums {
            sums: SuperblockSums::new(),
            per_chunk,
            in_chunk: 0,
            out,
            done: 0,
        }
    }

    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    pub(crate) fn push(
        &mut self,
        isum: __m256i,
        msum: __m256i,
        dy: f32,
        d: [u8; 2],
        dmin: [u8; 2],
    ) {
        if self.sums.store(isum, msum, dy, d, dmin) {
            self.flush();
        }
    }

    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    fn flush(&mut self) {
        let step = self.sums.steps();
        for &v in &step[..self.sums.len] {
            self.sums.acc += v;
            self.in_chunk += 1;
            if self.in_chunk == self.per_chunk {
                // SAFETY: chunk `done` is one the caller's contract (`new`) makes writable.
                unsafe { *self.out.add(self.done) = self.sums.acc };
                self.done += 1;
                self.sums.acc = 0.0;
                self.in_chunk = 0;
            }
        }
        self.sums.len = 0;
    }

    /// Writes the chunks still waiting.
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    pub(crate) fn finish(mut self) {
        if self.sums.len > 0 {
            self.flush();
        }
    }
}

/// The scalar reference's float step of one Q4_K or Q5_K superblock
/// (`formats::kquants::dot_q4_k`) for tiles, one token per lane: `acc + ((dy·d)·isum −
/// (dy·dmin)·msum)` from the superblock's exact integer sums; `dm` points at the block's
/// `[d, dmin]` (its first four bytes).
///
/// # Safety
/// `dm..dm + 4` is readable.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
pub(crate) unsafe fn q4k_float_step(
    acc: __m256,
    dy: __m256,
    dm: *const u8,
    isum: __m256i,
    msum: __m256i,
) -> __m256 {
    // SAFETY: the caller's contract; `read_unaligned` has no alignment requirement.
    let [d0, d1, m0, m1] = unsafe { (dm as *const [u8; 4]).read_unaligned() };
    let d = _mm256_mul_ps(dy, bcast_f16(&[d0, d1]));
    let dmin = _mm256_mul_ps(dy, bcast_f16(&[m0, m1]));
    let scaled = _mm256_mul_ps(d, _mm256_cvtepi32_ps(isum));
    let mins = _mm256_mul_ps(dmin, _mm256_cvtepi32_ps(msum));
    _mm256_add_ps(acc, _mm256_sub_ps(scaled, mins))
}

/// Q6_K: 16-bit lanes of scale 2k (low 128-bit lane) and 2k+1 (high) of a half's eight.
pub(crate) static Q6K_SCALE: [[u8; 32]; 4] = Q3K_SCALE;

/// `q2k_256!(n, w, a, accumulate)`: the whole kernel body; `accumulate(acc, pairs, scale)`.
macro_rules! q2k_256 {
    ($n:expr, $w:expr, $a:expr, $acc:path) => {{
        use $crate::x86::kq256::prelude::*;
        let nb = $n / QK_K;
        let (w, a): (&[BlockQ2K], &[BlockQ8K]) =
            (bytemuck::cast_slice($w), bytemuck::cast_slice($a));
        let m3 = _mm256_set1_epi8(3);
        let m4 = _mm_set1_epi8(0x0F);
        let mut acc = [_mm256_setzero_ps(); 2];
        for (x, y) in w[..nb].iter().zip(&a[..nb]) {
            let raw = load128_of(&x.scales);
            let mins = _mm256_cvtepu8_epi16(_mm_and_si128(_mm_srli_epi16::<4>(raw), m4));
            let msum = _mm256_madd_epi16(mins, load256_of(&y.bsums));
            let sc = _mm256_broadcastsi128_si256(_mm_and_si128(raw, m4));
            let q8 = y.qs.as_ptr() as *const u8;
            let mut sum = [_mm256_setzero_si256(); 2];
            for h in 0..2 {
                // SAFETY: bytes 32h..32h + 32 of the 64 in `x.qs` (h < 2).
                let q = unsafe { load256(x.qs.as_ptr().add(32 * h)) };
                let parts = [
                    q,
                    _mm256_srli_epi16::<2>(q),
                    _mm256_srli_epi16::<4>(q),
                    _mm256_srli_epi16::<6>(q),
                ];
                for (s, part) in parts.into_iter().enumerate() {
                    // SAFETY: bytes 128h + 32s.. + 32 of the 256 in `y.qs` (h < 2, s < 4).
                    let a8 = unsafe { load256(q8.add(128 * h + 32 * s)) };
                    let p = _mm256_maddubs_epi16(_mm256_and_si256(part, m3), a8);
                    let scale = _mm256_shuffle_epi8(sc, load256_of(&Q2K_SCALE[4 * h + s]));
                    sum[s % 2] = $acc(sum[s % 2], p, scale);
                }
            }
            let isum = _mm256_add_epi32(sum[0], sum[1]);
            // d and dmin are adjacent at offset 80.
            // SAFETY: offset 80 stays inside the 84-byte block `x`.
            let dm = unsafe { (x as *const BlockQ2K as *const u8).add(80) };
            // SAFETY: `dm..dm + 4` is `d` and `dmin`, the last 4 bytes of `x`, reached through a
            // pointer to the whole block.
            unsafe { fma_d_dmin(&mut acc, isum, msum, dm, y.d()) };
        }
        hsum_ps(_mm256_add_ps(acc[0], acc[1]))
    }};
}
pub(crate) use q2k_256;

/// `q3k_256!(n, w, a, accumulate)`: the whole kernel body; `accumulate(acc, pairs, scale)`.
macro_rules! q3k_256 {
    ($n:expr, $w:expr, $a:expr, $acc:path) => {{
        use $crate::x86::kq256::prelude::*;
        let nb = $n / QK_K;
        let (w, a): (&[BlockQ3K], &[BlockQ8K]) =
            (bytemuck::cast_slice($w), bytemuck::cast_slice($a));
        let m3 = _mm256_set1_epi8(3);
        let k4 = _mm256_set1_epi8(4);
        let mut acc = 0f32;
        for (x, y) in w[..nb].iter().zip(&a[..nb]) {
            // The 16 bytes ending at the block's end: scales at 2..14 (a load past the scales
            // could leave the row).
            // SAFETY: bytes 94..110 of the 110-byte block `x`, through a pointer to the whole
            // block.
            let tail = unsafe { load128((x as *const BlockQ3K as *const u8).add(94)) };
            let sc16 = _mm256_cvtepi8_epi16(unpack_q3k(tail));
            // Quants are stored as `lo + 4·hbit − 4`: we multiply `lo + 4·hbit` and subtract
            // 4·Σ scale·(sum of the 16 activations).
            let bias = _mm256_madd_epi16(sc16, load256_of(&y.bsums));
            let halves = [
                _mm256_broadcastsi128_si256(_mm256_castsi256_si128(sc16)),
                _mm256_broadcastsi128_si256(_mm256_extracti128_si256::<1>(sc16)),
            ];
            let q8 = y.qs.as_ptr() as *const u8;
            // Bit 4h+s of hmask is the high bit of half h, shift s; it is moved to bit 2.
            let mut hbits = load256_of(&x.hmask);
            let mut sum = [_mm256_setzero_si256(); 2];
            for (h, sc) in halves.into_iter().enumerate() {
                // SAFETY: bytes 32h..32h + 32 of the 64 in `x.qs` (h < 2).
                let q = unsafe { load256(x.qs.as_ptr().add(32 * h)) };
                let parts = [
                    q,
                    _mm256_srli_epi16::<2>(q),
                    _mm256_srli_epi16::<4>(q),
                    _mm256_srli_epi16::<6>(q),
                ];
                for (s, part) in parts.into_iter().enumerate() {
                    // Bits moved across bytes by the 16-bit shifts never reach bit 2.
                    let hb = _mm256_and_si256(_mm256_slli_epi16::<2>(hbits), k4);
                    hbits = _mm256_srli_epi16::<1>(hbits);
                    let u = _mm256_or_si256(_mm256_and_si256(part, m3), hb);
                    // SAFETY: bytes 128h + 32s.. + 32 of the 256 in `y.qs` (h < 2, s < 4).
                    let a8 = unsafe { load256(q8.add(128 * h + 32 * s)) };
                    let p = _mm256_maddubs_epi16(u, a8);
                    let scale = _mm256_shuffle_epi8(sc, load256_of(&Q3K_SCALE[s]));
                    sum[s % 2] = $acc(sum[s % 2], p, scale);
                }
            }
            let isum = _mm256_sub_epi32(
                _mm256_add_epi32(sum[0], sum[1]),
                _mm256_slli_epi32::<2>(bias),
            );
            // Reduced in integers: the bias sits in other lanes than the products it cancels.
            acc += f16_scalar(&x.d) * y.d() * hsum_epi32(isum) as f32;
        }
        acc
    }};
}
pub(crate) use q3k_256;

/// `q6k_256!(n, w, a, accumulate)`: the whole kernel body; `accumulate(acc, pairs, scale)`.
macro_rules! q6k_256 {
    ($n:expr, $w:expr, $a:expr, $acc:path) => {{
        use $crate::x86::kq256::prelude::*;
        let nb = $n / QK_K;
        let (w, a): (&[BlockQ6K], &[BlockQ8K]) =
            (bytemuck::cast_slice($w), bytemuck::cast_slice($a));
        let m4 = _mm256_set1_epi8(0x0F);
        let m30 = _mm256_set1_epi8(0x30);
        let mut acc = 0f32;
        for (x, y) in w[..nb].iter().zip(&a[..nb]) {
            let scales16 = _mm256_cvtepi8_epi16(load128_of(&x.scales));
            let bsums = load256_of(&y.bsums);
            // The quants are stored biased by 32: subtract 32·Σ scale·(sum of the 16
            // activations).
            let bias = _mm256_slli_epi32::<5>(_mm256_madd_epi16(scales16, bsums));
            let halves = [
                _mm256_broadcastsi128_si256(_mm256_castsi256_si128(scales16)),
                _mm256_broadcastsi128_si256(_mm256_extracti128_si256::<1>(scales16)),
            ];
            let mut sum = [_mm256_setzero_si256(); 2];
            for (half, sc) in halves.into_iter().enumerate() {
                // SAFETY: bytes 64·half.. + 64 of the 128 in `x.ql` and 32·half.. + 32 of the
                // 64 in `x.qh` (half < 2).
                let (ql0, ql1, qh) = unsafe {
                    (
                        load256(x.ql.as_ptr().add(64 * half)),
                        load256(x.ql.as_ptr().add(64 * half + 32)),
                        load256(x.qh.as_ptr().add(32 * half)),
                    )
                };
                let q = [
                    _mm256_or_si256(
                        _mm256_and_si256(ql0, m4),
                        _mm256_and_si256(_mm256_slli_epi16::<4>(qh), m30),
                    ),
                    _mm256_or_si256(
                        _mm256_and_si256(ql1, m4),
                        _mm256_and_si256(_mm256_slli_epi16::<2>(qh), m30),
                    ),
                    _mm256_or_si256(
                        _mm256_and_si256(_mm256_srli_epi16::<4>(ql0), m4),
                        _mm256_and_si256(qh, m30),
                    ),
                    _mm256_or_si256(
                        _mm256_and_si256(_mm256_srli_epi16::<4>(ql1), m4),
                        _mm256_and_si256(_mm256_srli_epi16::<2>(qh), m30),
                    ),
                ];
                for (k, qk) in q.into_iter().enumerate() {
                    let off = 128 * half + 32 * k;
                    // SAFETY: bytes off..off + 32 of the 256 in `y.qs` (half < 2, k < 4).
                    let q8 = unsafe { load256(y.qs.as_ptr().add(off) as *const u8) };
                    // Lanes 0..8 use scale 8·half + 2k, lanes 8..16 the next one.
                    let scale = _mm256_shuffle_epi8(sc, load256_of(&Q6K_SCALE[k]));
                    let p = _mm256_maddubs_epi16(qk, q8);
                    sum[k % 2] = $acc(sum[k % 2], p, scale);
                }
            }
            let isum = _mm256_sub_epi32(_mm256_add_epi32(sum[0], sum[1]), bias);
            // Reduced in integers: the bias sits in other lanes than the products it cancels, and
            // converting lanes first would round terms much larger than the result.
            acc += f16_scalar(&x.d) * y.d() * hsum_epi32(isum) as f32;
        }
        acc
    }};
}
pub(crate) use q6k_256;

/// `q4k_256!(n, w, a, accumulate[, Sums])`: the whole kernel body; `accumulate(acc, pairs,
/// scale)`; `Sums` ([`LaneSums`] unless named) takes each superblock's integer lanes and makes
/// the float steps: [`SuperblockSums`] is the scalar reference's arithmetic
/// (`formats::kquants::dot_q4_k`, bit for bit), which the AMX level uses because its tiles can
/// reproduce it (the lane layout depends on how the products were grouped; an integer does not).
macro_rules! q4k_256 {
    ($n:expr, $w:expr, $a:expr, $acc:path) => {
        $crate::x86::kq256::q4k_256!($n, $w, $a, $acc, $crate::x86::kq256::LaneSums)
    };
    ($n:expr, $w:expr, $a:expr, $acc:path, $sums:ty) => {{
        use $crate::x86::kq256::prelude::*;
        let nb = $n / QK_K;
        let (w, a): (&[BlockQ4K], &[BlockQ8K]) =
            (bytemuck::cast_slice($w), bytemuck::cast_slice($a));
        let m4 = _mm256_set1_epi8(0x0F);
        let mut sums = <$sums>::new();
        for (x, y) in w[..nb].iter().zip(&a[..nb]) {
            let (isum, msum) =
                $crate::x86::kq256::q4k_q5k_body!(x, y, m4, $acc, |g, lo, hi| (lo, hi));
            sums.push(isum, msum, y.d(), x.d, x.dmin);
        }
        sums.finish()
    }};
}
pub(crate) use q4k_256;

/// `q5k_256!(n, w, a, accumulate)`: the whole kernel body; `accumulate(acc, pairs, scale)`.
macro_rules! q5k_256 {
    ($n:expr, $w:expr, $a:expr, $acc:path) => {{
        use $crate::x86::kq256::prelude::*;
        let nb = $n / QK_K;
        let (w, a): (&[BlockQ5K], &[BlockQ8K]) =
            (bytemuck::cast_slice($w), bytemuck::cast_slice($a));
        let m4 = _mm256_set1_epi8(0x0F);
        let k16 = _mm256_set1_epi8(16);
        let mut sums = $crate::x86::kq256::LaneSums::new();
        for (x, y) in w[..nb].iter().zip(&a[..nb]) {
            // Bit 2g of qh[l] is the fifth bit of the low nibble of group g, bit 2g+1 of the high.
            let mut hbits = load256_of(&x.qh);
            let (isum, msum) = $crate::x86::kq256::q4k_q5k_body!(x, y, m4, $acc, |g, lo, hi| {
                let hlo = _mm256_and_si256(_mm256_slli_epi16::<4>(hbits), k16);
                let hhi = _mm256_and_si256(_mm256_slli_epi16::<3>(hbits), k16);
                hbits = _mm256_srli_epi16::<2>(hbits);
                (_mm256_or_si256(lo, hlo), _mm256_or_si256(hi, hhi))
            });
            sums.push(isum, msum, y.d(), x.d, x.dmin);
        }
        sums.finish()
    }};
}
pub(crate) use q5k_256;

/// One superblock of Q4_K or Q5_K: its lanes of Σ scale·products and of Σ min·bsums, as
/// `(isum, msum)`. Group g's low nibbles are sub-block 2g (activations 64g..64g+32), its high
/// nibbles sub-block 2g+1; `$fifth(g, lo, hi)` adds Q5_K's fifth bits and returns the new
/// `(lo, hi)`.
macro_rules! q4k_q5k_body {
    ($x:ident, $y:ident, $m4:ident, $accf:path,
     |$g:ident, $lo:ident, $hi:ident| $fifth:expr) => {{
        use $crate::x86::kq256::prelude::*;
        // d, dmin and the 12 scale bytes.
        // SAFETY: the first 16 bytes of the 144-byte (Q4_K) or 176-byte (Q5_K) block `$x`,
        // through a pointer to the whole block.
        let u = unpack_k4(unsafe { load128($x as *const _ as *const u8) });
        let u = _mm256_broadcastsi128_si256(u);
        let mins = _mm256_shuffle_epi8(u, load256_of(&K4_MINS));
        let msum = _mm256_madd_epi16(mins, load256_of(&$y.bsums));
        let q8 = $y.qs.as_ptr() as *const u8;
        let mut sum = [_mm256_setzero_si256(); 2];
        for $g in 0..4 {
            // SAFETY: bytes 32g..32g + 32 of the 128 in `qs` (g < 4).
            let q = unsafe { load256($x.qs.as_ptr().add(32 * $g)) };
            let $lo = _mm256_and_si256(q, $m4);
            let $hi = _mm256_and_si256(_mm256_srli_epi16::<4>(q), $m4);
            let ($lo, $hi) = $fifth;
            // SAFETY: bytes 64g..64g + 64 of the 256 in `y.qs` (g < 4).
            let (alo, ahi) = unsafe { (load256(q8.add(64 * $g)), load256(q8.add(64 * $g + 32))) };
            let slo = _mm256_shuffle_epi8(u, load256_of(&K4_SCALE[2 * $g]));
            let shi = _mm256_shuffle_epi8(u, load256_of(&K4_SCALE[2 * $g + 1]));
            let plo = _mm256_maddubs_epi16($lo, alo);
            let phi = _mm256_maddubs_epi16($hi, ahi);
            sum[0] = $accf(sum[0], plo, slo);
            sum[1] = $accf(sum[1], phi, shi);
        }
        (_mm256_add_epi32(sum[0], sum[1]), msum)
    }};
}
pub(crate) use q4k_q5k_body;

/// Elements 64c..64c + 64 of a Q6_K superblock as bytes `q` (0..63), in two registers of 32:
/// quarter pair (2(c % 2), 2(c % 2) + 1) of half c / 2, as in `formats::kquants::q6_values`
/// (element l + 32k of a half: low bits from `ql[l]` (k = 0, 2) or `ql[l + 32]` (k = 1, 3), the
/// low nibble for k < 2, and bits 2k, 2k + 1 of `qh[l]`): the unpack of the row lanes (AVX2 and
/// AVX-512) and of the AMX planes.
#[inline]
#[target_feature(enable = "avx2")]
pub(crate) fn q6k_quants(x: &BlockQ6K, c: usize) -> (__m256i, __m256i) {
    let (h, upper) = (c / 2, c % 2 == 1);
    let m4 = _mm256_set1_epi8(0x0F);
    let m3 = _mm256_set1_epi8(3);
    // SAFETY: bytes 64h..64h + 64 of the 128 in `ql` and 32h..32h + 32 of the 64 in `qh` (h < 2).
    let (ql0, ql1, qh) = unsafe {
        (
            _mm256_loadu_si256(x.ql.as_ptr().add(64 * h) as *const __m256i),
            _mm256_loadu_si256(x.ql.as_ptr().add(64 * h + 32) as *const __m256i),
            _mm256_loadu_si256(x.qh.as_ptr().add(32 * h) as *const __m256i),
        )
    };
    let (low0, low1, hb0, hb1) = if upper {
        (
            _mm256_and_si256(_mm256_srli_epi16::<4>(ql0), m4),
            _mm256_and_si256(_mm256_srli_epi16::<4>(ql1), m4),
            _mm256_and_si256(_mm256_srli_epi16::<4>(qh), m3),
            _mm256_and_si256(_mm256_srli_epi16::<6>(qh), m3),
        )
    } else {
        (
            _mm256_and_si256(ql0, m4),
            _mm256_and_si256(ql1, m4),
            _mm256_and_si256(qh, m3),
            _mm256_and_si256(_mm256_srli_epi16::<2>(qh), m3),
        )
    };
    (
        _mm256_or_si256(low0, _mm256_slli_epi16::<4>(hb0)),
        _mm256_or_si256(low1, _mm256_slli_epi16::<4>(hb1)),
    )
}
