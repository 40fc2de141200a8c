//! A CUDA GPU as an [`kernels::Offload`] device: weight matrices are copied once into its
//! memory, and every matrix product whose weights it holds runs there — one launch per batch of
//! products, against the same quantized activations the CPU kernels use. The CUDA driver and
//! NVRTC are loaded when a device is opened, so the binary builds and runs without them.
//!
//! Formats with a GPU kernel: F32, F16, BF16, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q2_K, Q3_K, Q4_K,
//! Q5_K, Q6_K, IQ4_NL, IQ4_XS, IQ2_XXS, IQ2_XS, IQ2_S, IQ3_XXS, IQ3_S, IQ1_S, IQ1_M and MXFP4
//! (the ternary TQ1_0/TQ2_0 are not). Matrices of other formats stay on the CPU.

use gguf::GgmlType;

mod host_read;
#[cfg(any(target_os = "linux", target_os = "windows"))]
mod lookup_tables;
pub use host_read::{HostRead, HostReadPlan};
mod placement;
pub use placement::{Hotness, OffloadReport, upload_held_experts, upload_model};
mod streaming;

#[cfg(any(target_os = "linux", target_os = "windows"))]
mod cuda;
#[cfg(any(target_os = "linux", target_os = "windows"))]
mod matmul_table;
#[cfg(any(target_os = "linux", target_os = "windows"))]
mod resident;

#[cfg(any(target_os = "linux", target_os = "windows"))]
pub use cuda::{CudaOffload, kernel_source};
#[cfg(not(any(target_os = "linux", target_os = "windows")))]
mod no_cuda;
#[cfg(not(any(target_os = "linux", target_os = "windows")))]
pub use no_cuda::CudaOffload;

#[derive(Debug, thiserror::Error)]
pub enum GpuError {
    #[error("no CUDA here: {0}")]
    Unavailable(String),
    #[error("GPU {ordinal}: {what}: {detail}")]
    Driver {
        ordinal: usize,
        what: &'static str,
        detail: String,
    },
    #[error("compiling the GPU kernels with NVRTC: {0}")]
    Compile(String),
    #[error("GPU {ordinal} memory: {detail}")]
    Memory { ordinal: usize, detail: String },
}

/// Whether the GPU has a kernel for weights of `dtype`.
pub fn supports(dtype: GgmlType) -> bool {
    use GgmlType as T;
    matches!(
        dtype,
        T::F32
            | T::F16
            | T::Bf16
            | T::Q4_0
            | T::Q4_1
            | T::Q5_0
            | T::Q5_1
            | T::Q8_0
            | T::Q2K
            | T::Q3K
            | T::Q4K
            | T::Q5K
            | T::Q6K
            | T::Iq4Nl
            | T::Iq4Xs
            | T::Iq2Xxs
            | T::Iq2Xs
            | T::Iq2S
            | T::Iq3Xxs
            | T::Iq3S
            | T::Iq1S
            | T::Iq1M
            | T::Mxfp4
    )
}

/// What a device says about itself.
#[derive(Clone, Debug)]
pub struct DeviceInfo {
    pub ordinal: usize,
    pub name: String,
    pub compute_capability: (i32, i32),
    pub total_bytes: u64,
    pub free_bytes: u64,
}

impl std::fmt::Display for DeviceInfo {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "GPU {} ({}, sm_{}{}, {:.1} of {:.1} GiB free)",
            self.ordinal,
            self.name,
            self.compute_capability.0,
            self.compute_capability.1,
            self.free_bytes as f64 / GIB,
            self.total_bytes as f64 / GIB
        )
    }
}

const GIB: f64 = (1u64 << 30) as f64;

/// A device that runs `model`'s whole steps on `dev` (which must hold every weight of it, see
/// [`upload_model`], but routed experts it copies in through its streaming buffer: then it
/// runs the steps of a prompt's size and declines the others), or why it cannot: an
/// architecture or layer form without whole-layer kernels, weights left on the CPU.
pub fn whole_model(
    dev: std::sync::Arc<CudaOffload>,
    model: &std::sync::Arc<model::Model>,
) -> Result<std::sync::Arc<dyn model::LayerDevice>, String> {
    #[cfg(any(target_os = "linux", target_os = "windows"))]
    {
        Ok(std::sync::Arc::new(resident::ResidentModel::new(
            dev, model,
        )?))
    }
    #[cfg(not(any(target_os = "linux", target_os = "windows")))]
    {
        let _ = (dev, model);
        Err("built without the CUDA backend".into())
    }
}

/// Opens GPU `ordinal` and compiles its kernels. Fails with a reason (no driver, no such
/// device, NVRTC missing, a platform built without CUDA) where it cannot.
pub fn open(ordinal: usize) -> Result<CudaOffload, GpuError> {
    CudaOffload::open(ordinal)
}
