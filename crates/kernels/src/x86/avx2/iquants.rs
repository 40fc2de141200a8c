//! The 256-element IQ formats and TQ1_0/TQ2_0 against Q8_K, dots and panels (`crate::x86::iq256`), with the
//! group scales applied by `vpmaddwd` and accumulated with `vpaddd`.

// Tiles index several per-row and per-token arrays with the same loop variable.
#![allow(clippy::needless_range_loop)]

use std::arch::x86_64::*;

crate::x86::iq256::iq_kernel_set!("avx2,fma,f16c", super::kquants::madd_acc, [2, 3, 4]);
