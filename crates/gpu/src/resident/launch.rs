//! A step's kernel launches. Arguments are collected as cudarc's launch builder collects them,
//! but the launch goes through `cuLaunchKernelEx`, so that on devices of compute capability 9.0
//! and later a kernel may be launched while the one ahead of it in the stream is still running
//! (programmatic dependent launch): its blocks start as the previous kernel's blocks leave, and
//! wait inside (matmul.cu `pdl_wait_then_release`) until that kernel's memory is visible. A
//! decode step is 13 launches a layer, most of them a few microseconds long; on an H100 the
//! overlap alone took 1.5 % off a decode step's device time, and 4–6 % with the dense matmuls'
//! weights fetched into L2 while they wait (docs/perf.md).

use std::ffi::c_void;
use std::marker::PhantomData;

use cudarc::driver::{CudaFunction, DeviceRepr, DriverError, LaunchConfig, sys};

/// How a step's launches run, read from the environment once, when the model is built.
#[derive(Clone, Copy, Debug)]
pub(super) struct LaunchSwitches {
    /// CUDA graphs for steps whose shape repeats, unless `MOESHARD_CUDA_GRAPHS=0` (to measure
    /// what they save).
    pub(super) graphs: bool,
    /// Launches may overlap the kernel before them: devices of compute capability 9.0+ (the
    /// kernels' `griddepcontrol` instructions), unless `MOESHARD_GPU_PDL=0` (a decode step's
    /// device time went 4255–4316 -> 4167–4238 µs on an H100 with it).
    pub(super) overlap: bool,
    /// With the overlap, the dp4a matmul kernels fetch their first weight rows into L2 before
    /// waiting on the kernel ahead (tables the host copied in only), unless
    /// `MOESHARD_GPU_PREFETCH=0` (a decode step's device time went 4208–4226 -> 4062–4115 µs).
    pub(super) prefetch: bool,
    /// Whether decode rows take the grouped attention (a block per kv head and split, its
    /// keys and values read once for the heads that share them) whatever the context:
    /// `MOESHARD_GPU_GROUPED_DECODE=1` always, `=0` never (a block per head and split); unset,
    /// by the step's context (step.rs `GROUPED_DECODE_MIN_CTX`).
    pub(super) grouped_decode: Option<bool>,
    /// A one-row step's expert matmuls find each block's job by division (matmul.cu
    /// `matmul_dp4a`'s `uniform`), unless `MOESHARD_GPU_UNIFORM_JOBS=0` (they search the table).
    pub(super) uniform_jobs: bool,
}

impl LaunchSwitches {
    pub(super) fn from_env(compute_capability: (i32, i32)) -> LaunchSwitches {
        let on = |var: &str| std::env::var(var).map_or(true, |v| v != "0");
        let overlap = compute_capability.0 >= 9 && on("MOESHARD_GPU_PDL");
        LaunchSwitches {
            graphs: on("MOESHARD_CUDA_GRAPHS"),
            overlap,
            prefetch: overlap && on("MOESHARD_GPU_PREFETCH"),
            grouped_decode: std::env::var("MOESHARD_GPU_GROUPED_DECODE")
                .ok()
                .map(|v| v != "0"),
            uniform_jobs: on("MOESHARD_GPU_UNIFORM_JOBS"),
        }
    }
}

/// One kernel launch's arguments: references to values that outlive the launch call (the
/// driver copies them when the launch is enqueued or captured).
pub(super) struct Launch<'a> {
    func: sys::CUfunction,
    args: Vec<*mut c_void>,
    _values: PhantomData<&'a ()>,
}

impl<'a> Launch<'a> {
    pub(super) fn new(f: &'a CudaFunction) -> Launch<'a> {
        Launch {
            func: f.cu_function(),
            args: Vec::with_capacity(24),
            _values: PhantomData,
        }
    }

    pub(super) fn arg<T: DeviceRepr>(&mut self, value: &'a T) -> &mut Self {
        self.args.push(value as *const T as *mut c_void);
        self
    }

    /// Enqueues the kernel on `stream`; with `overlap` it may start before the kernel ahead of
    /// it in the stream has finished (that one must be a kernel of this step, whose successors
    /// all wait for it).
    ///
    /// # Safety
    /// The arguments must be what the kernel's parameters say, and every address among them
    /// valid for what the kernel reads and writes there.
    pub(super) unsafe fn launch(
        &mut self,
        stream: sys::CUstream,
        cfg: LaunchConfig,
        overlap: bool,
    ) -> Result<(), DriverError> {
        let mut attr = sys::CUlaunchAttribute {
            id: sys::CUlaunchAttributeID::CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION,
            pad: [0; 4],
            value: sys::CUlaunchAttributeValue {
                programmaticStreamSerializationAllowed: 1,
            },
        };
        let config = sys::CUlaunchConfig {
            gridDimX: cfg.grid_dim.0,
            gridDimY: cfg.grid_dim.1,
            gridDimZ: cfg.grid_dim.2,
            blockDimX: cfg.block_dim.0,
            blockDimY: cfg.block_dim.1,
            blockDimZ: cfg.block_dim.2,
            sharedMemBytes: cfg.shared_mem_bytes,
            hStream: stream,
            attrs: &mut attr,
            numAttrs: u32::from(overlap),
        };
        // SAFETY: `config` and `attr` live through the call; the argument pointers point at
        // values borrowed for 'a; the caller vouches for the kernel's parameters.
        unsafe {
            sys::cuLaunchKernelEx(
                &config,
                self.func,
                self.args.as_mut_ptr(),
                std::ptr::null_mut(),
            )
        }
        .result()
    }
}
