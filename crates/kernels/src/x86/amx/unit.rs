//! The tile instructions behind one trait: the CPU's (inline assembly) and a plain-Rust
//! emulation with the same semantics, so everything around the tiles runs in tests anywhere.

use super::TILE;

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
