//! The AMX level: Sapphire Rapids and later Xeons multiply 16×64-byte int8 tiles in a matrix
//! unit (`tdpbssd`: 16 384 multiply-adds an instruction), about sixteen times what AVX-512 VNNI
//! does per cycle. Used for Q4_K and Q6_K batches (prefill) where the OS grants the tile state.
//!
//! **Availability** needs three things: the CPU says so (CPUID leaf 7: AMX-TILE, AMX-INT8), the
//! OS saves the tile state (XCR0 bits 17 and 18), and, on Linux, the process asked the kernel for
//! permission to use it (`arch_prctl(ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA)`); without that
//! last step the first tile instruction faults. A VM may advertise AMX and refuse the request:
//! then this level is simply not offered and the AVX-512 kernels run.
//!
//! **Same bits.** At this level the Q4_K dot is the scalar reference's arithmetic
//! (`kq256::q4k_exact_256`): per superblock the exact integers Σ scale·q·a and Σ min·bsum, then
//! the reference's float step, added in order (Q6_K's AVX-512 dot already worked that way). The
//! tiles reproduce those integers exactly — each weight is multiplied by its sub-block scale up
//! front (Q4_K ≤ 63·15 = 945, Q6_K |·| ≤ 128·32), split as 128·hi + lo into two int8 planes,
//! so one tile product per plane over the whole superblock gives Σ scale·q·a = 128·C_hi + C_lo —
//! and the float step is the same, one token per lane. So a value is the same whether the AMX
//! tiles, the AVX-512 dot or the scalar reference computed it, and nothing depends on the batch
//! around a token (as at every other level).
//!
//! The tile arithmetic is written once over [`TileUnit`]: the real unit (inline assembly) and a
//! plain-Rust emulation with the instructions' semantics, so the packing and the bookkeeping
//! around the tiles are tested on every machine with AVX-512 (this module's tests), and the real
//! unit wherever the CPU has one (there `tests/panels.rs` covers the level too).

use std::arch::x86_64::*;
use std::cell::RefCell;
use std::sync::OnceLock;

use crate::blocks::{BlockQ4K, BlockQ6K, BlockQ8K, QK_K};
use crate::panel::{Panel, PanelFn};
use crate::x86::scales::unpack_k4;

/// The AMX level's dot product for `dtype`, where it differs from the AVX-512 one. Only for
/// `crate::isa`, after [`available`].
pub fn dot(dtype: gguf::GgmlType) -> Option<crate::DotFn> {
    match dtype {
        gguf::GgmlType::Q4K => Some(super::avx512::dot_q4_k_exact),
        // Q6_K's AVX-512 dot already has the reference's arithmetic, which the tiles reproduce.
        gguf::GgmlType::Q6K => Some(super::avx512::dot_q6_k),
        _ => None,
    }
}

/// The AMX level's panel kernel for `dtype` (the same condition as [`dot`]).
pub fn panel(dtype: gguf::GgmlType) -> Option<crate::panel::PanelFn> {
    match dtype {
        gguf::GgmlType::Q4K => Some(panel_q4_k),
        gguf::GgmlType::Q6K => Some(panel_q6_k),
        _ => None,
    }
}

/// Rows and tokens of one tile: a tile product covers 16 weight rows × 16 tokens.
pub const TILE: usize = 16;

/// Whether this CPU and OS let this process use AMX int8 tiles (asked once).
pub fn available() -> bool {
    static AVAILABLE: OnceLock<bool> = OnceLock::new();
    *AVAILABLE.get_or_init(|| cpu_has_amx() && os_grants_tiles())
}

fn cpu_has_amx() -> bool {
    // Leaf 7 is read before its validity (leaf 0's maximum) is checked below: CPUID of a leaf
    // beyond the maximum returns data, not a fault.
    let (max_leaf, leaf7) = (__cpuid(0).eax, __cpuid_count(7, 0));
    let tile = leaf7.edx & (1 << 24) != 0;
    let int8 = leaf7.edx & (1 << 25) != 0;
    let osxsave = __cpuid(1).ecx & (1 << 27) != 0;
    if max_leaf < 7 || !tile || !int8 || !osxsave {
        return false;
    }
    // XCR0 bits 17 (TILECFG) and 18 (TILEDATA): the OS saves the tile state.
    // SAFETY: XGETBV with ECX = 0 is valid when CPUID says OSXSAVE (checked above).
    let xcr0 = unsafe { xgetbv0() };
    xcr0 & (0b11 << 17) == 0b11 << 17
}

/// XCR0, read with `xgetbv` (inline, so no `xsave` target feature is needed).
///
/// # Safety
/// The CPU supports XGETBV (CPUID.1:ECX.OSXSAVE).
unsafe fn xgetbv0() -> u64 {
    let (lo, hi): (u32, u32);
    // SAFETY: the caller's contract; `xgetbv` reads XCR[ecx] into edx:eax and touches nothing
    // else.
    unsafe {
        std::arch::asm!("xgetbv", in("ecx") 0, out("eax") lo, out("edx") hi,
            options(nomem, nostack, preserves_flags));
    }
    (u64::from(hi) << 32) | u64::from(lo)
}

#[cfg(target_os = "linux")]
fn os_grants_tiles() -> bool {
    const ARCH_REQ_XCOMP_PERM: libc::c_long = 0x1023;
    const XFEATURE_XTILEDATA: libc::c_long = 18;
    // SAFETY: arch_prctl(ARCH_REQ_XCOMP_PERM, feature) takes two integers and only changes the
    // process's permitted extended state; it fails cleanly (EINVAL, EPERM, ENOSYS) where refused.
    let r = unsafe {
        libc::syscall(
            libc::SYS_arch_prctl,
            ARCH_REQ_XCOMP_PERM,
            XFEATURE_XTILEDATA,
        )
    };
    r == 0
}

#[cfg(not(target_os = "linux"))]
fn os_grants_tiles() -> bool {
    false
}

/// The tile instructions the panels use, on fixed tile registers: `C_LO`, `C_HI`
/// (int32 accumulators, 16 rows × 16 columns), `A` (16 rows × 64 int8) and `B_LO`, `B_HI`
/// (16 rows of 64 int8 in the VNNI layout: row k holds four consecutive K elements of each of
/// the 16 output columns).
pub trait TileUnit {
    /// Sets up the tiles (`ldtilecfg`) before the first instruction.
    fn begin(&mut self);
    /// Releases the tiles (`tilerelease`).
    fn end(&mut self);
    fn zero(&mut self, tile: u8);
    /// Loads 16 rows of 64 bytes, row r from `ptr + r * stride`.
    ///
    /// # Safety
    /// The 16 rows are readable.
    unsafe fn load(&mut self, tile: u8, ptr: *const u8, stride: usize);
    /// `C[m][n] += Σ_k Σ_i A[m][4k + i] · B[k][4n + i]` (signed bytes, exact int32).
    fn dot(&mut self, c: u8, a: u8, b: u8);
    /// Stores 16 rows of 16 int32, row r to `ptr + r * stride`.
    ///
    /// # Safety
    /// The 16 rows are writable.
    unsafe fn store(&mut self, tile: u8, ptr: *mut u8, stride: usize);
}

pub const C_LO: u8 = 0;
pub const C_HI: u8 = 1;
/// A second pair of accumulators: one superblock's products run on the tile unit while the
/// previous superblock's are scaled on the vector units.
pub const C_LO2: u8 = 5;
pub const C_HI2: u8 = 6;
pub const A: u8 = 2;
pub const B_LO: u8 = 3;
pub const B_HI: u8 = 4;

/// The tile instructions executed by the CPU.
pub struct Hardware;

/// Palette 1, tiles 0..7 of 16 rows × 64 bytes.
#[repr(C, align(64))]
struct TileConfig([u8; 64]);

static CONFIG: TileConfig = {
    let mut c = [0u8; 64];
    c[0] = 1;
    let mut t = 0;
    while t < 7 {
        c[16 + 2 * t] = 64;
        c[48 + t] = 16;
        t += 1;
    }
    TileConfig(c)
};

impl TileUnit for Hardware {
    fn begin(&mut self) {
        // SAFETY: `Hardware` is only used after `available()` (CPU, XCR0 and the OS's
        // permission); `ldtilecfg` reads the 64 bytes of `CONFIG`.
        unsafe {
            std::arch::asm!("ldtilecfg [{}]", in(reg) CONFIG.0.as_ptr(), options(nostack, readonly));
        }
    }
    fn end(&mut self) {
        // SAFETY: as in `begin`; `tilerelease` only resets the tile state.
        unsafe { std::arch::asm!("tilerelease", options(nostack, nomem)) };
    }
    fn zero(&mut self, tile: u8) {
        // SAFETY: as in `begin`, after it; only the named tile register changes.
        unsafe {
            match tile {
                C_LO => std::arch::asm!("tilezero tmm0", options(nostack, nomem)),
                C_HI => std::arch::asm!("tilezero tmm1", options(nostack, nomem)),
                C_LO2 => std::arch::asm!("tilezero tmm5", options(nostack, nomem)),
                C_HI2 => std::arch::asm!("tilezero tmm6", options(nostack, nomem)),
                _ => unreachable!("tile {tile} is not an accumulator"),
            }
        }
    }
    unsafe fn load(&mut self, tile: u8, ptr: *const u8, stride: usize) {
        // SAFETY: the caller's contract (16 readable rows); as in `begin` for the unit.
        unsafe {
            match tile {
                A => std::arch::asm!("tileloadd tmm2, [{p} + {s}]", p = in(reg) ptr,
                    s = in(reg) stride, options(nostack, readonly)),
                B_LO => std::arch::asm!("tileloadd tmm3, [{p} + {s}]", p = in(reg) ptr,
                    s = in(reg) stride, options(nostack, readonly)),
                B_HI => std::arch::asm!("tileloadd tmm4, [{p} + {s}]", p = in(reg) ptr,
                    s = in(reg) stride, options(nostack, readonly)),
                _ => unreachable!("tile {tile} is not an operand"),
            }
        }
    }
    fn dot(&mut self, c: u8, a: u8, b: u8) {
        // SAFETY: as in `begin`; only tile registers are read and written.
        unsafe {
            match (c, a, b) {
                (C_LO, A, B_LO) => {
                    std::arch::asm!("tdpbssd tmm0, tmm2, tmm3", options(nostack, nomem))
                }
                (C_HI, A, B_HI) => {
                    std::arch::asm!("tdpbssd tmm1, tmm2, tmm4", options(nostack, nomem))
                }
                (C_LO2, A, B_LO) => {
                    std::arch::asm!("tdpbssd tmm5, tmm2, tmm3", options(nostack, nomem))
                }
                (C_HI2, A, B_HI) => {
                    std::arch::asm!("tdpbssd tmm6, tmm2, tmm4", options(nostack, nomem))
                }
                _ => unreachable!("tile product {c} += {a}·{b}"),
            }
        }
    }
    unsafe fn store(&mut self, tile: u8, ptr: *mut u8, stride: usize) {
        // SAFETY: the caller's contract (16 writable rows); as in `begin` for the unit.
        unsafe {
            match tile {
                C_LO => std::arch::asm!("tilestored [{p} + {s}], tmm0", p = in(reg) ptr,
                    s = in(reg) stride, options(nostack)),
                C_HI => std::arch::asm!("tilestored [{p} + {s}], tmm1", p = in(reg) ptr,
                    s = in(reg) stride, options(nostack)),
                C_LO2 => std::arch::asm!("tilestored [{p} + {s}], tmm5", p = in(reg) ptr,
                    s = in(reg) stride, options(nostack)),
                C_HI2 => std::arch::asm!("tilestored [{p} + {s}], tmm6", p = in(reg) ptr,
                    s = in(reg) stride, options(nostack)),
                _ => unreachable!("tile {tile} is not an accumulator"),
            }
        }
    }
}

/// The tile instructions in plain Rust, with the semantics the Intel SDM gives them.
// Constructed by the tests only: the kernels run on `Hardware`.
#[cfg_attr(not(test), allow(dead_code))]
pub struct Emulated {
    tiles: [[[u8; 64]; TILE]; 7],
}

impl Default for Emulated {
    fn default() -> Self {
        Emulated {
            tiles: [[[0; 64]; TILE]; 7],
        }
    }
}

impl TileUnit for Emulated {
    fn begin(&mut self) {}
    fn end(&mut self) {}
    fn zero(&mut self, tile: u8) {
        self.tiles[tile as usize] = [[0; 64]; TILE];
    }
    unsafe fn load(&mut self, tile: u8, ptr: *const u8, stride: usize) {
        for (r, row) in self.tiles[tile as usize].iter_mut().enumerate() {
            // SAFETY: the caller's contract: 64 readable bytes at each row's address.
            let src = unsafe { std::slice::from_raw_parts(ptr.add(r * stride), 64) };
            row.copy_from_slice(src);
        }
    }
    fn dot(&mut self, c: u8, a: u8, b: u8) {
        let (ta, tb) = (self.tiles[a as usize], self.tiles[b as usize]);
        let tc = &mut self.tiles[c as usize];
        for m in 0..TILE {
            for n in 0..TILE {
                let mut acc = i32::from_le_bytes(tc[m][4 * n..4 * n + 4].try_into().unwrap());
                for k in 0..TILE {
                    for i in 0..4 {
                        acc = acc.wrapping_add(
                            (ta[m][4 * k + i] as i8 as i32) * (tb[k][4 * n + i] as i8 as i32),
                        );
                    }
                }
                tc[m][4 * n..4 * n + 4].copy_from_slice(&acc.to_le_bytes());
            }
        }
    }
    unsafe fn store(&mut self, tile: u8, ptr: *mut u8, stride: usize) {
        for (r, row) in self.tiles[tile as usize].iter().enumerate() {
            // SAFETY: the caller's contract: 64 writable bytes at each row's address.
            let dst = unsafe { std::slice::from_raw_parts_mut(ptr.add(r * stride), 64) };
            dst.copy_from_slice(row);
        }
    }
}

/// A K-quant whose superblocks the tiles can take: each weight times its sub-block scale fits
/// in 13 bits, split as `128·hi + lo` into two int8 planes, so that one tile product per plane
/// over the superblock gives the exact Σ scale·q·a of the format's dot.
pub trait TileFormat {
    type Block: Copy;
    /// Whether the format subtracts `dmin·Σ min·bsum` (Q4_K) or not (Q6_K).
    const MINS: bool;
    /// The (lo, hi) planes of elements 64c..64c + 64 of the superblock, one byte each, given
    /// the block's [`Unpacked`] scales.
    ///
    /// # Safety
    /// The CPU has the `Isa::Avx512` features (as for `step`).
    unsafe fn planes(x: &Self::Block, c: usize, u: &Unpacked) -> (__m512i, __m512i);
    /// The block's scales and scalars.
    ///
    /// # Safety
    /// As for `planes`.
    unsafe fn unpack(x: &Self::Block) -> Unpacked;
    /// The format's float step: `acc` plus this superblock, one token per lane of `isum` /
    /// `msum` and one weight row's `d`, `dmin` in `d`, `dmin` … per lane, `dy` the token's scale.
    ///
    /// # Safety
    /// The CPU has the `Isa::Avx512` features.
    unsafe fn step(
        acc: __m512,
        dy: __m512,
        d: __m512,
        dmin: __m512,
        isum: __m512i,
        msum: __m512i,
    ) -> __m512;
}

/// What packing a superblock needs besides its quants: the sub-block scales (8 for Q4_K, 16 for
/// Q6_K), `d`, `dmin` (0 without mins) and the mins as (min_2p, min_2p+1) 16-bit pairs.
pub struct Unpacked {
    scales: [i16; 16],
    d: f32,
    dmin: f32,
    min_pairs: [i32; 4],
}

/// Q4_K: scale·q = 6-bit scale × 4-bit quant ≤ 945; float step as `formats::kquants::dot_q4_k`:
/// `acc + ((dy·d)·isum − (dy·dmin)·msum)`.
pub enum Q4K {}

impl TileFormat for Q4K {
    type Block = BlockQ4K;
    const MINS: bool = true;

    #[inline]
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,avx2,fma,f16c")]
    unsafe fn planes(x: &BlockQ4K, c: usize, u: &Unpacked) -> (__m512i, __m512i) {
        let (sc_lo, sc_hi) = (u.scales[2 * c], u.scales[2 * c + 1]);
        let m4 = _mm256_set1_epi8(0x0F);
        // SAFETY: bytes 32c..32c + 32 of the 128 in `qs` (c < 4).
        let q = unsafe { _mm256_loadu_si256(x.qs.as_ptr().add(32 * c) as *const __m256i) };
        // Elements 64c..64c + 32 are the low nibbles (sub-block 2c), the next 32 the high ones.
        let first = _mm512_mullo_epi16(
            _mm512_cvtepu8_epi16(_mm256_and_si256(q, m4)),
            _mm512_set1_epi16(sc_lo),
        );
        let second = _mm512_mullo_epi16(
            _mm512_cvtepu8_epi16(_mm256_and_si256(_mm256_srli_epi16::<4>(q), m4)),
            _mm512_set1_epi16(sc_hi),
        );
        split_planes(first, second)
    }

    #[inline]
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,avx2,fma,f16c")]
    unsafe fn unpack(x: &BlockQ4K) -> Unpacked {
        // SAFETY: the block's first 16 bytes (d, dmin and the 12 packed scale bytes).
        let v = unpack_k4(unsafe { _mm_loadu_si128(x as *const BlockQ4K as *const __m128i) });
        let mut b = [0u8; 16];
        // SAFETY: the store writes the 16 bytes of `b`.
        unsafe { _mm_storeu_si128(b.as_mut_ptr() as *mut __m128i, v) };
        let mins: [i32; 8] = std::array::from_fn(|j| b[8 + j] as i32);
        Unpacked {
            scales: std::array::from_fn(|j| if j < 8 { b[j] as i16 } else { 0 }),
            d: half::f16::from_le_bytes(x.d).to_f32(),
            dmin: half::f16::from_le_bytes(x.dmin).to_f32(),
            min_pairs: std::array::from_fn(|p| mins[2 * p] | (mins[2 * p + 1] << 16)),
        }
    }

    #[inline]
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,avx2,fma,f16c")]
    unsafe fn step(
        acc: __m512,
        dy: __m512,
        d: __m512,
        dmin: __m512,
        isum: __m512i,
        msum: __m512i,
    ) -> __m512 {
        let scaled = _mm512_mul_ps(_mm512_mul_ps(dy, d), _mm512_cvtepi32_ps(isum));
        let mins = _mm512_mul_ps(_mm512_mul_ps(dy, dmin), _mm512_cvtepi32_ps(msum));
        _mm512_add_ps(acc, _mm512_sub_ps(scaled, mins))
    }
}

/// Q6_K: scale·(q − 32) = signed 8-bit scale × 6-bit quant, |·| ≤ 4096; float step as
/// `formats::kquants::dot_q6_k` (and the AVX-512 dot): `acc + (d·dy)·isum`.
pub enum Q6K {}

impl TileFormat for Q6K {
    type Block = BlockQ6K;
    const MINS: bool = false;

    #[inline]
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,avx2,fma,f16c")]
    unsafe fn planes(x: &BlockQ6K, c: usize, u: &Unpacked) -> (__m512i, __m512i) {
        // Chunk c is quarter-pair (2(c % 2), 2(c % 2) + 1) of half c / 2: element l + 32k of the
        // half takes its low bits from ql[l] (k = 0, 2) or ql[l + 32] (k = 1, 3), low nibble for
        // k < 2, and bits 2k, 2k + 1 of qh[l]; scale 2k + l / 16 of the half's eight.
        let (h, k0) = (c / 2, 2 * (c % 2));
        let m4 = _mm256_set1_epi8(0x0F);
        let m3 = _mm256_set1_epi8(3);
        // SAFETY: bytes 64h..64h + 64 of the 128 in `ql` and 32h..32h + 32 of the 64 in `qh`.
        let (ql0, ql1, qh) = unsafe {
            (
                _mm256_loadu_si256(x.ql.as_ptr().add(64 * h) as *const __m256i),
                _mm256_loadu_si256(x.ql.as_ptr().add(64 * h + 32) as *const __m256i),
                _mm256_loadu_si256(x.qh.as_ptr().add(32 * h) as *const __m256i),
            )
        };
        let (low0, low1) = if k0 == 0 {
            (_mm256_and_si256(ql0, m4), _mm256_and_si256(ql1, m4))
        } else {
            (
                _mm256_and_si256(_mm256_srli_epi16::<4>(ql0), m4),
                _mm256_and_si256(_mm256_srli_epi16::<4>(ql1), m4),
            )
        };
        let (hb0, hb1) = if k0 == 0 {
            (
                _mm256_and_si256(qh, m3),
                _mm256_and_si256(_mm256_srli_epi16::<2>(qh), m3),
            )
        } else {
            (
                _mm256_and_si256(_mm256_srli_epi16::<4>(qh), m3),
                _mm256_and_si256(_mm256_srli_epi16::<6>(qh), m3),
            )
        };
        let k32 = _mm512_set1_epi16(32);
        let value = |low: __m256i, high: __m256i, k: usize| {
            let q = _mm256_or_si256(low, _mm256_slli_epi16::<4>(high));
            let q = _mm512_sub_epi16(_mm512_cvtepu8_epi16(q), k32);
            let s = |j: usize| u.scales[8 * h + 2 * k + j];
            let scale = _mm512_inserti64x4::<1>(
                _mm512_castsi256_si512(_mm256_set1_epi16(s(0))),
                _mm256_set1_epi16(s(1)),
            );
            _mm512_mullo_epi16(q, scale)
        };
        split_planes(value(low0, hb0, k0), value(low1, hb1, k0 + 1))
    }

    unsafe fn unpack(x: &BlockQ6K) -> Unpacked {
        Unpacked {
            scales: x.scales.map(i16::from),
            d: half::f16::from_le_bytes(x.d).to_f32(),
            dmin: 0.0,
            min_pairs: [0; 4],
        }
    }

    #[inline]
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,avx2,fma,f16c")]
    unsafe fn step(
        acc: __m512,
        dy: __m512,
        d: __m512,
        _: __m512,
        isum: __m512i,
        _: __m512i,
    ) -> __m512 {
        _mm512_add_ps(
            acc,
            _mm512_mul_ps(_mm512_mul_ps(d, dy), _mm512_cvtepi32_ps(isum)),
        )
    }
}

/// 64 products (two registers of 32 i16, element order) as the planes `lo = v & 127` and
/// `hi = v >> 7` (arithmetic), 64 bytes each: `v = 128·hi + lo` exactly.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,avx2,fma,f16c")]
fn split_planes(first: __m512i, second: __m512i) -> (__m512i, __m512i) {
    let k127 = _mm512_set1_epi16(127);
    let join = |a: __m512i, b: __m512i| {
        _mm512_inserti64x4::<1>(
            _mm512_castsi256_si512(_mm512_cvtepi16_epi8(a)),
            _mm512_cvtepi16_epi8(b),
        )
    };
    (
        join(
            _mm512_and_si512(first, k127),
            _mm512_and_si512(second, k127),
        ),
        join(
            _mm512_srai_epi16::<7>(first),
            _mm512_srai_epi16::<7>(second),
        ),
    )
}

/// The transpose of a 16×16 matrix of dwords (`r[m]` holds row m): `out[k]` holds column k.
/// This turns one plane chunk of 16 weight rows (64 bytes each) into the VNNI layout of a B
/// tile (row k: four consecutive K bytes of each of the 16 rows).
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,avx2,fma,f16c")]
fn transpose16(r: &[__m512i; TILE]) -> [__m512i; TILE] {
    // Within each 128-bit lane L: pairs of rows interleaved, then quads, so that u[4j + q]'s
    // lane L holds rows 4j..4j + 4 at column 4L + q.
    let t: [__m512i; TILE] = std::array::from_fn(|i| {
        if i % 2 == 0 {
            _mm512_unpacklo_epi32(r[i], r[i + 1])
        } else {
            _mm512_unpackhi_epi32(r[i - 1], r[i])
        }
    });
    let u: [__m512i; TILE] = std::array::from_fn(|i| {
        let (j, q) = (i / 4, i % 4);
        let (a, b) = (t[4 * j + q / 2], t[4 * j + 2 + q / 2]);
        if q % 2 == 0 {
            _mm512_unpacklo_epi64(a, b)
        } else {
            _mm512_unpackhi_epi64(a, b)
        }
    });
    // Then a 4×4 transpose of 128-bit lanes across u[q], u[4 + q], u[8 + q], u[12 + q].
    let mut out = [_mm512_setzero_si512(); TILE];
    for q in 0..4 {
        let (a, b, c, d) = (u[q], u[4 + q], u[8 + q], u[12 + q]);
        let x0 = _mm512_shuffle_i32x4::<0b01_00_01_00>(a, b);
        let x1 = _mm512_shuffle_i32x4::<0b11_10_11_10>(a, b);
        let y0 = _mm512_shuffle_i32x4::<0b01_00_01_00>(c, d);
        let y1 = _mm512_shuffle_i32x4::<0b11_10_11_10>(c, d);
        out[q] = _mm512_shuffle_i32x4::<0b10_00_10_00>(x0, y0);
        out[4 + q] = _mm512_shuffle_i32x4::<0b11_01_11_01>(x0, y0);
        out[8 + q] = _mm512_shuffle_i32x4::<0b10_00_10_00>(x1, y1);
        out[12 + q] = _mm512_shuffle_i32x4::<0b11_01_11_01>(x1, y1);
    }
    out
}

/// Bytes of one plane of one superblock: four B tiles of 16 rows × 64 bytes.
const PLANE_BYTES: usize = 4 * TILE * 64;

/// A block of up to 16 weight rows made ready for the tiles (rows past the block's end are
/// zeros): per superblock the two planes in the VNNI layout, and per row `d`, `dmin` and the
/// min pairs.
#[derive(Default)]
struct PackedRows {
    planes: Vec<u8>,
    min_pairs: Vec<[i32; TILE]>,
    d: Vec<[f32; TILE]>,
    dmin: Vec<[f32; TILE]>,
}

impl PackedRows {
    /// Packs the `rows` (≤ 16) rows `w[0..rows]` of `nb` superblocks each.
    ///
    /// # Safety
    /// Each `w[m]`, m < rows, points at `nb` readable blocks.
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,avx2,fma,f16c")]
    unsafe fn pack<F: TileFormat>(&mut self, nb: usize, w: &[*const F::Block; TILE], rows: usize) {
        self.planes.resize(nb * 2 * PLANE_BYTES, 0);
        self.min_pairs.resize(nb * 4, [0; TILE]);
        self.d.resize(nb, [0.0; TILE]);
        self.dmin.resize(nb, [0.0; TILE]);
        for b in 0..nb {
            let mut lo = [[_mm512_setzero_si512(); TILE]; 4];
            let mut hi = [[_mm512_setzero_si512(); TILE]; 4];
            for m in 0..TILE {
                if m >= rows {
                    self.d[b][m] = 0.0;
                    self.dmin[b][m] = 0.0;
                    for p in 0..4 {
                        self.min_pairs[b * 4 + p][m] = 0;
                    }
                    continue;
                }
                // SAFETY: block b < nb of row m < rows is readable (the contract above); the
                // blocks are plain bytes of alignment 1.
                let x = unsafe { &*w[m].add(b) };
                // SAFETY: this function runs only where the AVX-512 features it is compiled for
                // exist (its callers' contract).
                let u = unsafe { F::unpack(x) };
                self.d[b][m] = u.d;
                self.dmin[b][m] = u.dmin;
                for (p, pair) in u.min_pairs.into_iter().enumerate() {
                    self.min_pairs[b * 4 + p][m] = pair;
                }
                for c in 0..4 {
                    // SAFETY: as above.
                    (lo[c][m], hi[c][m]) = unsafe { F::planes(x, c, &u) };
                }
            }
            let dst = &mut self.planes[b * 2 * PLANE_BYTES..(b + 1) * 2 * PLANE_BYTES];
            for (plane, chunks) in [lo, hi].iter().enumerate() {
                for (c, chunk) in chunks.iter().enumerate() {
                    for (k, v) in transpose16(chunk).iter().enumerate() {
                        let at = plane * PLANE_BYTES + c * TILE * 64 + k * 64;
                        // SAFETY: 64 bytes at `at` lie inside `dst` (2 planes × 4 chunks × 16
                        // rows of 64 bytes).
                        unsafe { _mm512_storeu_si512(dst.as_mut_ptr().add(at) as *mut _, *v) };
                    }
                }
            }
        }
    }
}

/// Scratch of one thread: the packed weight rows, the last token tile padded to 16 tokens, and
/// per (token, superblock) the activations' scale and their (Σ sub-block 2p, Σ sub-block 2p+1)
/// pairs for the mins (shared by every block of rows).
#[derive(Default)]
struct Scratch {
    packed: PackedRows,
    tail: Vec<u8>,
    token_sums: Vec<TokenSums>,
}

#[derive(Clone, Copy, Default)]
struct TokenSums {
    dy: f32,
    pairs: [i32; 4],
}

thread_local! {
    static SCRATCH: RefCell<Scratch> = RefCell::new(Scratch::default());
}

/// Panels of fewer tokens than this run through the AVX-512 register tiles of the same
/// arithmetic (`small`): packing a block of rows for the tiles costs about as much as one tile
/// of 16 tokens computes (measured on the 16-core host, one thread: at 8 tokens the register
/// tiles were twice as fast, at 16 from even to 15 % faster, at 32 the AMX tiles 1.4–1.5×
/// faster).
pub const MIN_TOKENS: usize = 24;

/// The AMX Q4_K panel (a `crate::panel::PanelFn`).
///
/// # Safety
/// As for `crate::panel::PanelFn`, on a CPU where [`available`] is true.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,avx2,fma,f16c")]
pub unsafe fn panel_q4_k(p: &Panel) {
    // SAFETY: the caller's contract, and the CPU has AMX (`available`).
    unsafe { panel_on::<Q4K, _>(&mut Hardware, p, super::avx512::panel_q4_k_exact) }
}

/// The AMX Q6_K panel (a `crate::panel::PanelFn`): the same bits as the AVX-512 Q6_K dot.
///
/// # Safety
/// As for [`panel_q4_k`].
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,avx2,fma,f16c")]
pub unsafe fn panel_q6_k(p: &Panel) {
    // SAFETY: as in `panel_q4_k`.
    unsafe { panel_on::<Q6K, _>(&mut Hardware, p, super::avx512::panel_q6_k) }
}

/// A panel of format `F` over any [`TileUnit`] (the tests' emulated one too): 16-row × 16-token
/// tiles, the last row block padded with zero rows and the last token tile with zero tokens
/// (copies), whose outputs are dropped; panels of fewer than [`MIN_TOKENS`] tokens run through
/// `small`, the AVX-512 panel of the same arithmetic (the same bits).
///
/// # Safety
/// As for `crate::panel::PanelFn`; `unit` can run on this CPU.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,avx2,fma,f16c")]
pub unsafe fn panel_on<F: TileFormat, U: TileUnit>(unit: &mut U, p: &Panel, small: PanelFn) {
    let nb = p.k / QK_K;
    let a_bytes = nb * size_of::<BlockQ8K>();
    if p.n < MIN_TOKENS {
        // SAFETY: the caller's contract; `small` runs on AVX-512, which this CPU has.
        unsafe { small(p) };
        return;
    }
    SCRATCH.with_borrow_mut(|scratch| {
        let Scratch {
            packed,
            tail,
            token_sums,
        } = scratch;
        // The last partial token tile, copied and padded with zero blocks (d = 0, bsums 0).
        let tail_start = p.n / TILE * TILE;
        let tail_len = p.n - tail_start;
        if tail_len > 0 {
            tail.clear();
            tail.resize(TILE * a_bytes, 0);
            for t in 0..tail_len {
                // SAFETY: token tail_start + t < n is in the panel: `a_bytes` readable bytes.
                let src = unsafe {
                    std::slice::from_raw_parts(p.a.add((tail_start + t) * p.a_stride), a_bytes)
                };
                tail[t * a_bytes..(t + 1) * a_bytes].copy_from_slice(src);
            }
        }
        let padded = p.n.next_multiple_of(TILE);
        token_sums.clear();
        token_sums.resize(padded * nb, TokenSums::default());
        for t in 0..p.n {
            for b in 0..nb {
                // SAFETY: block b of token t < n is in the panel; alignment 1, plain bytes.
                let y = unsafe {
                    &*(p.a.add(t * p.a_stride + b * size_of::<BlockQ8K>()) as *const BlockQ8K)
                };
                let sub = |j: usize| y.bsum(2 * j) as i32 + y.bsum(2 * j + 1) as i32;
                token_sums[t * nb + b] = TokenSums {
                    dy: y.d(),
                    pairs: std::array::from_fn(|pi| {
                        (sub(2 * pi) & 0xFFFF) | (sub(2 * pi + 1) << 16)
                    }),
                };
            }
        }
        unit.begin();
        let mut c_lo = [[0i32; TILE]; TILE];
        let mut c_hi = [[0i32; TILE]; TILE];
        for r0 in (0..p.rows).step_by(TILE) {
            let rows = (p.rows - r0).min(TILE);
            let w: [*const F::Block; TILE] =
                std::array::from_fn(|m| p.w.wrapping_add((r0 + m) * p.w_stride) as *const F::Block);
            // SAFETY: rows r0..r0 + rows are in the panel, `nb` blocks each.
            unsafe { packed.pack::<F>(nb, &w, rows) };
            let row_mask: __mmask16 = if rows == TILE { !0 } else { (1 << rows) - 1 };
            for t0 in (0..p.n).step_by(TILE) {
                let (a0, a_stride, tokens) = if t0 == tail_start {
                    (tail.as_ptr(), a_bytes, tail_len)
                } else {
                    (p.a.wrapping_add(t0 * p.a_stride), p.a_stride, TILE)
                };
                let mut acc = [_mm512_setzero_ps(); TILE];
                // Superblock b's tile products are issued before superblock b − 1 is scaled.
                for step in 0..=nb {
                    if step < nb {
                        let b = step;
                        let (lo, hi) = if b % 2 == 0 {
                            (C_LO, C_HI)
                        } else {
                            (C_LO2, C_HI2)
                        };
                        unit.zero(lo);
                        unit.zero(hi);
                        let planes = &packed.planes[b * 2 * PLANE_BYTES..];
                        for c in 0..4 {
                            // SAFETY: the A tile is bytes 64c..64c + 64 of block b's quants of
                            // 16 token rows `a_stride` apart (the panel's, or the padded copy);
                            // the B tiles are chunk c of this superblock's two planes, 16 rows
                            // of 64 bytes.
                            unsafe {
                                let q = a0.add(b * size_of::<BlockQ8K>() + 4 + 64 * c);
                                unit.load(A, q, a_stride);
                                unit.load(B_LO, planes[c * TILE * 64..].as_ptr(), 64);
                                unit.load(B_HI, planes[PLANE_BYTES + c * TILE * 64..].as_ptr(), 64);
                            }
                            unit.dot(lo, A, B_LO);
                            unit.dot(hi, A, B_HI);
                        }
                    }
                    if step == 0 {
                        continue;
                    }
                    let b = step - 1;
                    let (lo, hi) = if b % 2 == 0 {
                        (C_LO, C_HI)
                    } else {
                        (C_LO2, C_HI2)
                    };
                    // SAFETY: each store writes 16 rows of 64 bytes into a 16×16 i32 array.
                    unsafe {
                        unit.store(lo, c_lo.as_mut_ptr() as *mut u8, 64);
                        unit.store(hi, c_hi.as_mut_ptr() as *mut u8, 64);
                    }
                    // SAFETY: the loads read the 16 f32 of `packed.d[b]` and `packed.dmin[b]`.
                    let (d, dmin) = unsafe {
                        (
                            _mm512_loadu_ps(packed.d[b].as_ptr()),
                            _mm512_loadu_ps(packed.dmin[b].as_ptr()),
                        )
                    };
                    let min_pairs: [__m512i; 4] = std::array::from_fn(|pi| {
                        // SAFETY: the 16 i32 of one entry of `min_pairs`.
                        unsafe {
                            _mm512_loadu_si512(packed.min_pairs[b * 4 + pi].as_ptr() as *const _)
                        }
                    });
                    for t in 0..TILE {
                        let sums = token_sums[(t0 + t) * nb + b];
                        // SAFETY: the loads read row t (16 i32) of each accumulator array.
                        let (lo, hi) = unsafe {
                            (
                                _mm512_loadu_si512(c_lo[t].as_ptr() as *const _),
                                _mm512_loadu_si512(c_hi[t].as_ptr() as *const _),
                            )
                        };
                        let isum = _mm512_add_epi32(_mm512_slli_epi32::<7>(hi), lo);
                        let mut msum = _mm512_setzero_si512();
                        if F::MINS {
                            // Σ_j min_j · (bsum_2j + bsum_2j+1), two sub-blocks per vpdpwssd.
                            for (pairs, bs) in min_pairs.iter().zip(sums.pairs) {
                                msum = _mm512_dpwssd_epi32(msum, _mm512_set1_epi32(bs), *pairs);
                            }
                        }
                        // SAFETY: AVX-512 is there (this function's contract).
                        acc[t] = unsafe {
                            F::step(acc[t], _mm512_set1_ps(sums.dy), d, dmin, isum, msum)
                        };
                    }
                }
                for (t, v) in acc.iter().enumerate().take(tokens) {
                    // SAFETY: outputs (t0 + t, r0..r0 + rows) are in the panel; the mask stores
                    // only those `rows` consecutive f32.
                    unsafe {
                        _mm512_mask_storeu_ps(p.out.add((t0 + t) * p.out_stride + r0), row_mask, *v)
                    };
                }
            }
        }
        unit.end();
    });
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::formats::kquants::{dot_q4_k, dot_q6_k};
    use crate::{ActKind, DotFn, Isa};

    /// Random rows of `F`: raw random bytes (every scale, min and quant value) with small finite
    /// f16 scales at `d_at` (and the byte after it: `dmin` for Q4_K).
    fn weights(seed: u64, rows: usize, k: usize, block: usize, d_at: &[usize]) -> Vec<u8> {
        let mut s = seed | 1;
        let mut next = || {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            s
        };
        let mut w: Vec<u8> = (0..rows * k / QK_K * block).map(|_| next() as u8).collect();
        for blk in w.chunks_exact_mut(block) {
            for &at in d_at {
                let d = half::f16::from_f32((next() % 1000) as f32 * 1e-5);
                blk[at..at + 2].copy_from_slice(&d.to_le_bytes());
            }
        }
        w
    }

    fn activations(n: usize, k: usize) -> Vec<u8> {
        let rb = ActKind::Q8K.row_bytes(k);
        let mut out = vec![0u8; n * rb];
        for t in 0..n {
            let x: Vec<f32> = (0..k)
                .map(|i| {
                    let v = ((i * 37 + t * 101) % 255) as f32 - 127.0;
                    if i % 97 == t % 97 { 30.0 * v } else { v }
                })
                .collect();
            ActKind::Q8K.quantize_row(&x, &mut out[t * rb..(t + 1) * rb]);
        }
        out
    }

    /// Runs the panel of `F` over `unit` for (rows, n, k) and checks every value against the
    /// level's dot and the scalar reference, bit for bit.
    fn check<F: TileFormat, U: TileUnit>(
        unit: &mut U,
        (rows, n, k): (usize, usize, usize),
        d_at: &[usize],
        (small, dot, reference): (PanelFn, DotFn, DotFn),
    ) {
        let block = size_of::<F::Block>();
        let (wb, ab) = (k / QK_K * block, ActKind::Q8K.row_bytes(k));
        let w = weights((rows * 31 + n * 7 + k) as u64, rows, k, block, d_at);
        let a = activations(n, k);
        let stride = rows + 2;
        let mut out = vec![f32::NAN; n * stride];
        let p = Panel {
            k,
            w: w.as_ptr(),
            w_stride: wb,
            rows,
            a: a.as_ptr(),
            a_stride: ab,
            n,
            out: out.as_mut_ptr(),
            out_stride: stride,
        };
        // SAFETY: the panel covers exactly `w`, `a` and `out` (sizes above); the CPU has
        // AVX-512 (checked by the callers) and the unit runs here.
        unsafe { panel_on::<F, U>(unit, &p, small) };
        for t in 0..n {
            for r in 0..rows {
                let (wr, ar) = (&w[r * wb..(r + 1) * wb], &a[t * ab..(t + 1) * ab]);
                let got = out[t * stride + r];
                let want = dot(k, wr, ar);
                assert_eq!(
                    got.to_bits(),
                    want.to_bits(),
                    "rows {rows} n {n} k {k}: ({r}, {t}) {got} vs {want}"
                );
                let reference = reference(k, wr, ar);
                assert_eq!(
                    want.to_bits(),
                    reference.to_bits(),
                    "dot {want} vs reference {reference}"
                );
            }
            for r in rows..stride {
                assert!(out[t * stride + r].is_nan(), "wrote outside the panel");
            }
        }
    }

    /// Whole tiles, partial row blocks and token tiles, a panel below `MIN_TOKENS`, long rows.
    const SHAPES: [(usize, usize, usize); 7] = [
        (16, 16, 256),
        (35, 37, 1024),
        (16, 48, 2048),
        (33, 16, 512),
        (7, 40, 256),
        (20, 5, 768),
        (18, 2, 256),
    ];

    fn check_all<U: TileUnit>(unit: &mut U) {
        for shape in SHAPES {
            use crate::x86::avx512 as level;
            let q4k = (
                level::panel_q4_k_exact as PanelFn,
                level::dot_q4_k_exact as DotFn,
                dot_q4_k as DotFn,
            );
            check::<Q4K, U>(unit, shape, &[0, 2], q4k);
            let q6k = (
                level::panel_q6_k as PanelFn,
                level::dot_q6_k as DotFn,
                dot_q6_k as DotFn,
            );
            check::<Q6K, U>(unit, shape, &[208], q6k);
        }
    }

    #[test]
    fn emulated_tiles_give_the_reference_bits() {
        if !Isa::Avx512.is_supported() {
            eprintln!("skipped: the AMX panels' vector steps need AVX-512");
            return;
        }
        check_all(&mut Emulated::default());
    }

    #[test]
    fn hardware_tiles_give_the_reference_bits() {
        if !Isa::Amx.is_supported() {
            eprintln!("skipped (no AMX, or the OS did not grant the tile state)");
            return;
        }
        check_all(&mut Hardware);
        eprintln!("AMX tiles checked on this CPU");
    }
}
