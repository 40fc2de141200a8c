//! The 256-element IQ formats and TQ1_0/TQ2_0 against Q8_K, dots and panels (`crate::x86::iq256`), with the
//! group scales applied and accumulated in one `vpdpwssd` (VNNI on 256-bit registers).

// Tiles index several per-row and per-token arrays with the same loop variable.
#![allow(clippy::needless_range_loop)]

use std::arch::x86_64::*;

crate::x86::iq256::iq_kernel_set!(
    "avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,avx2,fma,f16c",
    super::kquants::dpwssd,
    [2, 3, 4, 5, 6, 7, 8]
);
