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
//! (`kq256::SuperblockSums`): per superblock the exact integers Σ scale·q·a and Σ min·bsum, then
//! the reference's float step, added in order (Q6_K's AVX-512 dot already worked that way). The
//! tiles reproduce those integers exactly — each weight is multiplied by its sub-block scale up
//! front (Q4_K ≤ 63·15 = 945, Q6_K |·| ≤ 128·32), split as 128·hi + lo into two int8 planes,
//! so one tile product per plane over the whole superblock gives Σ scale·q·a = 128·C_hi + C_lo —
//! and the float step is the same, one token per lane. So a value is the same whether the AMX
//! tiles, the AVX-512 dot or the scalar reference computed it, and nothing depends on the batch
//! around a token (as at every other level).
//!
//! The tile arithmetic is written once over [`unit::TileUnit`]: the real unit (inline
//! assembly) and a plain-Rust emulation with the instructions' semantics, so the packing and
//! the bookkeeping around the tiles are tested on every machine with AVX-512 (`tests.rs`), and
//! the real unit wherever the CPU has one (there `tests/panels.rs` covers the level too).

mod formats;
mod panel;
#[cfg(test)]
mod tests;
mod unit;

use std::arch::x86_64::*;
use std::sync::OnceLock;

pub use panel::{panel_q4_k, panel_q6_k};

/// The AMX level's dot product for `dtype`, where it differs from the AVX-512 one. Only for
/// `crate::isa`, after [`available`].
pub fn dot(dtype: gguf::GgmlType) -> Option<crate::DotFn> {
    match dtype {
        gguf::GgmlType::Q4K => Some(crate::x86::avx512::dot_q4_k_exact),
        // Q6_K's AVX-512 dot already has the reference's arithmetic, which the tiles reproduce.
        gguf::GgmlType::Q6K => Some(crate::x86::avx512::dot_q6_k),
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

/// The AMX level's chunk-dots kernel for `dtype` (the same condition as [`dot`]).
pub fn chunk_dots(dtype: gguf::GgmlType) -> Option<crate::panel::ChunkDotsFn> {
    match dtype {
        gguf::GgmlType::Q4K => Some(crate::x86::avx512::chunks_q4_k_exact),
        gguf::GgmlType::Q6K => Some(crate::x86::avx512::chunks_q6_k),
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
