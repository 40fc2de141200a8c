//! What the float panels of both x86 levels share: the weight formats they are generic over
//! and the scalar load of their dots' tails.

/// The weight formats of the float panels.
pub(crate) const F32: u8 = 0;
pub(crate) const F16: u8 = 1;
pub(crate) const BF16: u8 = 2;

/// Weight `i` of format `KIND` of the row at `w`, as f32 (the dot's scalar tail).
///
/// # Safety
/// Element `i` of the row is readable.
#[inline]
pub(crate) unsafe fn scalar_w<const KIND: u8>(w: *const u8, i: usize) -> f32 {
    // SAFETY: the caller's contract; the reads are unaligned.
    unsafe {
        match KIND {
            F32 => (w as *const f32).add(i).read_unaligned(),
            F16 => half::f16::from_bits((w as *const u16).add(i).read_unaligned()).to_f32(),
            _ => f32::from_bits(((w as *const u16).add(i).read_unaligned() as u32) << 16),
        }
    }
}
