//! AArch64 kernels at three levels, chosen at run time by `crate::isa` like the x86 ones:
//!
//! - `neon`: Advanced SIMD, which every AArch64 CPU has (Cortex-A53/A72, Raspberry Pi 3/4);
//! - `dotprod`: plus FEAT_DotProd `sdot` (Cortex-A55/A76 and later, Neoverse N1, Apple M1+);
//! - `i8mm`: plus FEAT_I8MM `smmla` (Neoverse V1/N2/V2, Graviton 3/4, Apple M2+), which the
//!   prefill panels use.
//!
//! Every level has a dot product for every format (`float` for F32/F16/BF16; `quant` over the
//! per-format unpacking of `formats` for the rest); the quantized ones give the scalar
//! reference's bits (see `quant`), the float ones differ from it only in summation order. The
//! panels exist at the i8mm level, for every quantized format.

// The plain-NEON kernels are entered from ordinary functions, on the grounds that every AArch64
// target enables NEON; this makes that ground a build error if it ever fails.
#[cfg(not(target_feature = "neon"))]
compile_error!("the AArch64 kernels assume a target with NEON (Advanced SIMD)");

mod float;
mod formats;
mod int8;
mod quant;

pub(crate) use float::{exp_sub_sum, scores, weighted_sum};

use gguf::GgmlType;

use crate::Isa;
use crate::formats::DotFn;
use crate::panel::{Panel, PanelFn};

/// Whether this CPU runs kernels of `isa` (one of the AArch64 levels).
pub(crate) fn is_supported(isa: Isa) -> bool {
    match isa {
        Isa::Neon => true,
        Isa::NeonDotprod => std::arch::is_aarch64_feature_detected!("dotprod"),
        Isa::NeonI8mm => {
            std::arch::is_aarch64_feature_detected!("dotprod")
                && std::arch::is_aarch64_feature_detected!("i8mm")
        }
        _ => false,
    }
}

/// The dot product of `dtype` at level `isa`. Only for `crate::isa`, after it checked that the
/// CPU supports `isa`: the `sdot` kernels returned for the dotprod and i8mm levels need it.
pub(crate) fn dot(isa: Isa, dtype: GgmlType) -> Option<DotFn> {
    use GgmlType as T;
    use formats::*;
    use quant::{dot_neon, dot_sdot};
    let sdot = match isa {
        Isa::Neon => false,
        Isa::NeonDotprod | Isa::NeonI8mm => true,
        _ => return None,
    };
    macro_rules! pick {
        ($q:ty) => {
            if sdot {
                dot_sdot::<$q> as DotFn
            } else {
                dot_neon::<$q>
            }
        };
    }
    Some(match dtype {
        T::F32 => float::dot_f32,
        T::F16 => float::dot_f16,
        T::Bf16 => float::dot_bf16,
        T::Q4_0 => pick!(Q4_0),
        T::Q4_1 => pick!(Q4_1),
        T::Q5_0 => pick!(Q5_0),
        T::Q5_1 => pick!(Q5_1),
        T::Q8_0 => pick!(Q8_0),
        T::Mxfp4 => pick!(Mxfp4),
        T::Q2K => pick!(Q2K),
        T::Q3K => pick!(Q3K),
        T::Q4K => pick!(Q4K),
        T::Q5K => pick!(Q5K),
        T::Q6K => pick!(Q6K),
        T::Q8K => pick!(Q8K),
        _ => return None,
    })
}

/// Runs the i8mm panel of `Q`.
///
/// # Safety
/// [`PanelFn`]'s contract; only handed out by [`panel`] for the i8mm level, which
/// `crate::isa` offers only after detecting FEAT_DotProd and FEAT_I8MM.
unsafe fn panel_entry<Q: formats::Quant>(p: &Panel) {
    // SAFETY: the bounds, aliasing and CPU features are this function's own contract.
    unsafe { quant::panel_i8mm::<Q>(p) }
}

/// The panel kernel of `dtype` at level `isa`, if there is one (the same condition as [`dot`]).
pub(crate) fn panel(isa: Isa, dtype: GgmlType) -> Option<PanelFn> {
    use GgmlType as T;
    use formats::*;
    if isa != Isa::NeonI8mm {
        return None;
    }
    Some(match dtype {
        T::Q4_0 => panel_entry::<Q4_0>,
        T::Q4_1 => panel_entry::<Q4_1>,
        T::Q5_0 => panel_entry::<Q5_0>,
        T::Q5_1 => panel_entry::<Q5_1>,
        T::Q8_0 => panel_entry::<Q8_0>,
        T::Mxfp4 => panel_entry::<Mxfp4>,
        T::Q2K => panel_entry::<Q2K>,
        T::Q3K => panel_entry::<Q3K>,
        T::Q4K => panel_entry::<Q4K>,
        T::Q5K => panel_entry::<Q5K>,
        T::Q6K => panel_entry::<Q6K>,
        T::Q8K => panel_entry::<Q8K>,
        _ => return None,
    })
}
