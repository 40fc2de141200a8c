//! The CUDA device: its context and stream, the weights it holds (keyed by the host address
//! they were copied from), the host pages it locks, and the batched matrix-product launch; the
//! expert FFN call is `expert_ffn`.

use std::any::Any;
use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};

use cudarc::driver::{
    CudaContext, CudaFunction, CudaSlice, CudaStream, DevicePtr, LaunchConfig, PinnedHostSlice,
    PushKernelArg,
};
use cudarc::nvrtc::{CompileOptions, compile_ptx_with_opts};
use kernels::{ExpertFfnJob, MatmulError, MatmulJob, Offload, Weights};

use crate::matmul_table::{
    Grids, JOB_FIELDS, MatRecord, THREADS_PER_BLOCK, kernel_compile_options, step_mma_min,
    write_matmul_table,
};
use crate::streaming::STREAM_ALIGN;
use crate::{DeviceInfo, GpuError, supports};

mod expert_ffn;

/// The matrix products, then the kernels between them of whole layers on the device.
const SOURCE: &str = concat!(include_str!("matmul.cu"), include_str!("resident.cu"));

/// The whole CUDA source NVRTC compiles when a device opens: the formats' lookup tables, then
/// the kernels (`tools/gpu/check_kernels.py` compiles the same text without a GPU).
pub fn kernel_source() -> String {
    crate::lookup_tables::cuda_source() + SOURCE
}
/// Host bytes `[host, host + len)` live on the device at `dev`.
struct Region {
    len: usize,
    dev: u64,
}

/// Buffers reused from one launch to the next. The host sides are page-locked, so the copies
/// are asynchronous DMA in the stream's order (a pageable copy costs a staged, synchronous one).
#[derive(Default)]
pub(crate) struct Scratch {
    /// Job table, then the activations of every job (each distinct input once).
    host_in: Option<PinnedHostSlice<u8>>,
    host_out: Option<PinnedHostSlice<f32>>,
    dev_in: Option<CudaSlice<u8>>,
    /// Intermediates that never leave the device (expert FFNs' gate/up and hidden rows).
    dev_tmp: Option<CudaSlice<u8>>,
    dev_out: Option<CudaSlice<f32>>,
    /// Routed experts' weights copied in for one pass of an expert FFN call (`Streaming`).
    dev_stream: Option<CudaSlice<u8>>,
}

/// Routed experts the device does not hold, run there anyway by copying their weights in
/// for the call when they serve at least `from` of a step's rows. `capacity` bytes of device
/// memory (part of `--gpu-mem`, taken by `upload_model`) take one pass of such experts at a
/// time; 0: nothing is streamed.
#[derive(Clone, Copy, Debug, Default)]
struct Streaming {
    from: Option<usize>,
    capacity: usize,
}

pub struct CudaOffload {
    pub(crate) ordinal: usize,
    pub(crate) name: String,
    pub(crate) ctx: Arc<CudaContext>,
    pub(crate) stream: Arc<CudaStream>,
    pub(crate) module: Arc<cudarc::driver::CudaModule>,
    pub(crate) matmul: CudaFunction,
    pub(crate) matmul_mma: CudaFunction,
    glu: CudaFunction,
    weighted_sum: CudaFunction,
    /// By host start address.
    regions: BTreeMap<usize, Region>,
    /// The device copies of `regions`, kept alive.
    buffers: Vec<CudaSlice<u8>>,
    /// What keeps each region's host bytes mapped at their address (the model's files):
    /// a region's key must not come to name other bytes while the device is in use.
    owners: Vec<Arc<dyn Any + Send + Sync>>,
    uploaded: u64,
    scratch: Mutex<Scratch>,
    streaming: Streaming,
    /// The most bytes `upload_model` may set aside for streaming (`None`: its own choice).
    streaming_limit: Option<usize>,
    /// Bytes of expert weights copied in by expert FFN calls so far.
    pub(crate) streamed: std::sync::atomic::AtomicU64,
    /// Host routed experts that whole decode steps copied in and computed so far.
    pub(crate) read_over_link: std::sync::atomic::AtomicU64,
    /// Host ranges page-locked for faster copies ([`CudaOffload::lock_host`]).
    locked_host: Vec<(usize, usize)>,
    /// Of a one-row whole step's routed experts on the host, how many the device computes,
    /// their weights copied over the link ([`CudaOffload::read_host_experts`]).
    host_read: crate::HostRead,
}

impl CudaOffload {
    pub fn open(ordinal: usize) -> Result<CudaOffload, GpuError> {
        // SAFETY: only asks whether the shared libraries can be loaded.
        let (driver, nvrtc) = unsafe {
            (
                cudarc::driver::sys::is_culib_present(),
                cudarc::nvrtc::sys::is_culib_present(),
            )
        };
        if !driver {
            return Err(GpuError::Unavailable(
                "the CUDA driver library (libcuda) could not be loaded".into(),
            ));
        }
        if !nvrtc {
            return Err(GpuError::Unavailable(
                "NVRTC (libnvrtc) could not be loaded: put the CUDA toolkit's lib64 on \
                 LD_LIBRARY_PATH"
                    .into(),
            ));
        }
        let driver_err = |what: &'static str| {
            move |e: cudarc::driver::DriverError| GpuError::Driver {
                ordinal,
                what,
                detail: e.to_string(),
            }
        };
        let count = CudaContext::device_count().map_err(driver_err("counting devices"))?;
        if ordinal >= count.max(0) as usize {
            return Err(GpuError::Unavailable(format!(
                "GPU {ordinal} asked for, {count} present"
            )));
        }
        let ctx = CudaContext::new(ordinal).map_err(driver_err("creating a context"))?;
        let name = ctx.name().map_err(driver_err("reading its name"))?;
        let (major, minor) = ctx
            .compute_capability()
            .map_err(driver_err("reading its compute capability"))?;
        let arch: &'static str = Box::leak(format!("sm_{major}{minor}").into_boxed_str());
        let ptx = compile_ptx_with_opts(
            kernel_source(),
            CompileOptions {
                arch: Some(arch),
                name: Some("matmul.cu".into()),
                options: kernel_compile_options(),
                ..Default::default()
            },
        )
        .map_err(|e| GpuError::Compile(format!("{e:?}")))?;
        let module = ctx
            .load_module(ptx)
            .map_err(driver_err("loading the kernels"))?;
        let matmul = module
            .load_function("matmul_grouped")
            .map_err(driver_err("finding matmul_grouped"))?;
        let matmul_mma = module
            .load_function("matmul_mma")
            .map_err(driver_err("finding matmul_mma"))?;
        // Decode waits for one short launch at a time: spinning answers sooner than yielding.
        ctx.set_flags(cudarc::driver::sys::CUctx_flags::CU_CTX_SCHED_SPIN)
            .map_err(driver_err("setting the scheduling mode"))?;
        let glu = module
            .load_function("glu_quantize")
            .map_err(driver_err("finding glu_quantize"))?;
        let weighted_sum = module
            .load_function("weighted_sum")
            .map_err(driver_err("finding weighted_sum"))?;
        let stream = ctx.default_stream();
        Ok(CudaOffload {
            ordinal,
            name,
            ctx,
            stream,
            module,
            matmul,
            matmul_mma,
            glu,
            weighted_sum,
            regions: BTreeMap::new(),
            buffers: Vec::new(),
            owners: Vec::new(),
            uploaded: 0,
            scratch: Mutex::new(Scratch::default()),
            streaming: Streaming::default(),
            streaming_limit: None,
            streamed: std::sync::atomic::AtomicU64::new(0),
            read_over_link: std::sync::atomic::AtomicU64::new(0),
            locked_host: Vec::new(),
            host_read: crate::HostRead::Auto,
        })
    }

    pub fn info(&self) -> Result<DeviceInfo, GpuError> {
        let (free, total) = self.ctx.mem_get_info().map_err(|e| GpuError::Driver {
            ordinal: self.ordinal,
            what: "reading free memory",
            detail: e.to_string(),
        })?;
        let compute_capability = self.ctx.compute_capability().unwrap_or((0, 0));
        Ok(DeviceInfo {
            ordinal: self.ordinal,
            name: self.name.clone(),
            compute_capability,
            total_bytes: total as u64,
            free_bytes: free as u64,
        })
    }

    /// Bytes of weights copied to the device so far.
    pub fn uploaded_bytes(&self) -> u64 {
        self.uploaded
    }

    /// Copies `host` to the device; from now on products with weights inside it run there.
    /// `owner` keeps `host` mapped, unchanged, at its address for as long as the device is used.
    pub fn upload(
        &mut self,
        owner: Arc<dyn Any + Send + Sync>,
        host: &[u8],
    ) -> Result<(), GpuError> {
        self.upload_pieces(owner, &[host])
    }

    /// Copies disjoint host ranges into one device allocation, each at a
    /// [`crate::streaming::STREAM_ALIGN`]ed offset, as [`CudaOffload::upload`] would one by
    /// one: a layer's experts chosen by hotness lie scattered in their stacks, and an
    /// allocation each would round every piece up to the driver's granularity.
    pub fn upload_pieces(
        &mut self,
        owner: Arc<dyn Any + Send + Sync>,
        pieces: &[&[u8]],
    ) -> Result<(), GpuError> {
        let align = crate::streaming::STREAM_ALIGN;
        let mut offsets = Vec::with_capacity(pieces.len());
        let mut total = 0usize;
        for host in pieces.iter().filter(|h| !h.is_empty()) {
            let start = host.as_ptr() as usize;
            let overlaps = self
                .regions
                .range(..start + host.len())
                .next_back()
                .is_some_and(|(&s, r)| s + r.len > start)
                || offsets.iter().any(|(other, _): &(&[u8], usize)| {
                    let o = other.as_ptr() as usize;
                    o < start + host.len() && start < o + other.len()
                });
            if overlaps {
                return Err(GpuError::Memory {
                    ordinal: self.ordinal,
                    detail: format!(
                        "{} bytes at {start:#x} overlap an uploaded range",
                        host.len()
                    ),
                });
            }
            offsets.push((*host, total));
            total = (total + host.len()).next_multiple_of(align);
        }
        if offsets.is_empty() {
            return Ok(());
        }
        let mem_err = |e: cudarc::driver::DriverError| GpuError::Memory {
            ordinal: self.ordinal,
            detail: format!("copying {total} bytes of weights: {e}"),
        };
        // SAFETY: every byte is written by the copies below before any kernel reads it; the
        // padding between pieces is never read.
        let buf = unsafe { self.stream.alloc::<u8>(total) }.map_err(mem_err)?;
        let (base, _) = buf.device_ptr(&self.stream);
        let cu = self.stream.cu_stream();
        for &(host, offset) in &offsets {
            // SAFETY: the piece lies inside the allocation (offsets counted above); the host
            // range is the caller's, kept by `owner`; the stream is synchronized below, before
            // the pieces can be released.
            unsafe { cudarc::driver::result::memcpy_htod_async(base + offset as u64, host, cu) }
                .map_err(mem_err)?;
        }
        self.stream.synchronize().map_err(mem_err)?;
        for &(host, offset) in &offsets {
            self.regions.insert(
                host.as_ptr() as usize,
                Region {
                    len: host.len(),
                    dev: base + offset as u64,
                },
            );
            self.uploaded += host.len() as u64;
        }
        self.buffers.push(buf);
        self.owners.push(owner);
        Ok(())
    }

    /// Lets routed experts the device will not hold run on it when each serves at least `from`
    /// of a step's rows (a prompt's), their weights copied in for the call through a buffer
    /// that [`crate::upload_model`] takes from its budget: at most `limit` bytes, or, with
    /// `None`, a size it chooses (one layer's routed experts where whole layers can run on the
    /// device). Call before `upload_model`; `from` = `None` turns streaming off.
    pub fn stream_experts(&mut self, from: Option<usize>, limit: Option<usize>) {
        self.streaming = Streaming { from, capacity: 0 };
        self.streaming_limit = limit;
    }

    /// In a whole step of one row (decode), lets the device compute up to `per_row` of the
    /// row's routed experts that stay on the host, their weights copied over the link once the
    /// routing is known, while the CPU computes the others (`Fixed(0)`: the CPU computes them
    /// all; `Auto`, the default: as many as balance the link against the CPU, measured).
    pub fn read_host_experts(&mut self, per_row: crate::HostRead) {
        self.host_read = per_row;
    }

    pub(crate) fn host_read(&self) -> crate::HostRead {
        self.host_read
    }

    /// Whether experts are streamed at all, and the buffer's limit if one was given.
    pub(crate) fn streaming_limit(&self) -> Option<Option<usize>> {
        self.streaming.from.map(|_| self.streaming_limit)
    }

    /// The streaming buffer for a whole-model step: its device address (allocated now, at
    /// the capacity `upload_model` set, which does not change after), its capacity, and the
    /// rows an expert serves from which it is copied in. `None` when nothing is streamed.
    pub(crate) fn staging_buffer(&self) -> Result<Option<(u64, usize, usize)>, MatmulError> {
        let Some(from) = self.streams_experts_from() else {
            return Ok(None);
        };
        let mut scratch = self.lock()?;
        let addr = self.streaming_buffer(&mut scratch)?;
        Ok(Some((addr, self.streaming.capacity, from)))
    }

    pub(crate) fn set_streaming_capacity(&mut self, capacity: usize) {
        self.streaming.capacity = capacity;
    }

    /// Bytes of expert weights copied in by expert FFN calls so far.
    pub fn streamed_bytes(&self) -> u64 {
        self.streamed.load(std::sync::atomic::Ordering::Relaxed)
    }

    /// Host routed experts that whole decode steps copied over the link and computed on the
    /// device ([`CudaOffload::read_host_experts`]), so far.
    pub fn experts_read_over_link(&self) -> u64 {
        self.read_over_link
            .load(std::sync::atomic::Ordering::Relaxed)
    }

    /// Page-locks the whole pages `pages` (start and end multiples of the host's page size,
    /// inside memory that `owner` keeps mapped for as long as the device lives) so that copies
    /// from them are DMA at the link's speed rather than staged through a driver buffer. The
    /// range must not overlap an earlier one. Returns the bytes locked.
    pub fn lock_host(
        &mut self,
        owner: Arc<dyn Any + Send + Sync>,
        pages: std::ops::Range<usize>,
    ) -> Result<usize, GpuError> {
        let page = crate::streaming::host_page_size();
        let (start, end) = (pages.start, pages.end);
        if start >= end || start % page != 0 || end % page != 0 {
            return Err(GpuError::Memory {
                ordinal: self.ordinal,
                detail: format!(
                    "host range {start:#x}..{end:#x} is not whole pages of {page} bytes"
                ),
            });
        }
        if self.locked_host.iter().any(|&(s, e)| s < end && start < e) {
            return Err(GpuError::Memory {
                ordinal: self.ordinal,
                detail: format!("host range {start:#x}..{end:#x} overlaps a locked one"),
            });
        }
        self.ctx.bind_to_thread().map_err(|e| GpuError::Driver {
            ordinal: self.ordinal,
            what: "binding the context to this thread",
            detail: e.to_string(),
        })?;
        // SAFETY: the caller names pages that `owner` keeps mapped while the device lives
        // (`owner` is kept below); the driver only pins them (READ_ONLY: the device only reads
        // them, which lets it pin a read-only file mapping). Nothing here dereferences them.
        let r = unsafe {
            cudarc::driver::sys::cuMemHostRegister_v2(
                start as *mut std::ffi::c_void,
                end - start,
                cudarc::driver::sys::CU_MEMHOSTREGISTER_READ_ONLY,
            )
        };
        if r != cudarc::driver::sys::CUresult::CUDA_SUCCESS {
            return Err(GpuError::Memory {
                ordinal: self.ordinal,
                detail: format!("page-locking {} bytes of weights: {r:?}", end - start),
            });
        }
        self.locked_host.push((start, end));
        self.owners.push(owner);
        Ok(end - start)
    }

    /// The streaming buffer's device address, allocated at its capacity on first use.
    fn streaming_buffer(&self, scratch: &mut Scratch) -> Result<u64, MatmulError> {
        let cap = self.streaming.capacity;
        if scratch.dev_stream.as_ref().is_none_or(|b| b.len() < cap) {
            scratch.dev_stream = None;
            // SAFETY: every byte a kernel reads is copied in before it, in stream order.
            scratch.dev_stream = Some(
                unsafe { self.stream.alloc::<u8>(cap.max(1)) }
                    .map_err(|e| self.device_error("allocating the streaming buffer", e))?,
            );
        }
        let buf = scratch.dev_stream.as_ref().expect("allocated above");
        Ok(buf.device_ptr(&self.stream).0)
    }

    /// Whether `bytes` lie inside one range page-locked by [`CudaOffload::lock_host`].
    pub(crate) fn is_page_locked(&self, bytes: &[u8]) -> bool {
        let (start, end) = (
            bytes.as_ptr() as usize,
            bytes.as_ptr() as usize + bytes.len(),
        );
        self.locked_host
            .iter()
            .any(|&(s, e)| s <= start && end <= e)
    }

    /// The device address of `bytes`, when they lie inside one uploaded region.
    pub(crate) fn device_address(&self, bytes: &[u8]) -> Option<u64> {
        let p = bytes.as_ptr() as usize;
        let (&start, r) = self.regions.range(..=p).next_back()?;
        (p + bytes.len() <= start + r.len).then(|| r.dev + (p - start) as u64)
    }

    pub(crate) fn device_error(&self, what: &str, e: impl std::fmt::Display) -> MatmulError {
        MatmulError::Device {
            device: format!("GPU {} ({})", self.ordinal, self.name),
            detail: format!("{what}: {e}"),
        }
    }

    /// Grows `slot` to at least `len` elements.
    fn ensure<T: cudarc::driver::DeviceRepr + cudarc::driver::ValidAsZeroBits>(
        &self,
        slot: &mut Option<CudaSlice<T>>,
        len: usize,
    ) -> Result<(), MatmulError> {
        if slot.as_ref().is_none_or(|s| s.len() < len) {
            *slot = None;
            let grown = len.next_power_of_two().max(1 << 16);
            *slot = Some(
                self.stream
                    .alloc_zeros::<T>(grown)
                    .map_err(|e| self.device_error("allocating scratch", e))?,
            );
        }
        Ok(())
    }
}

/// Grows the page-locked host buffer `slot` to at least `len` elements and returns its start.
pub(crate) fn ensure_pinned<T: cudarc::driver::DeviceRepr + cudarc::driver::ValidAsZeroBits>(
    ctx: &Arc<CudaContext>,
    slot: &mut Option<PinnedHostSlice<T>>,
    len: usize,
) -> Result<*mut T, cudarc::driver::DriverError> {
    ensure_pinned_with_flags(ctx, slot, len, 0)
}

/// [`ensure_pinned`], allocated with `cuMemHostAlloc`'s `flags` (`CU_MEMHOSTALLOC_DEVICEMAP`:
/// kernels address the memory too).
pub(crate) fn ensure_pinned_with_flags<
    T: cudarc::driver::DeviceRepr + cudarc::driver::ValidAsZeroBits,
>(
    ctx: &Arc<CudaContext>,
    slot: &mut Option<PinnedHostSlice<T>>,
    len: usize,
    flags: u32,
) -> Result<*mut T, cudarc::driver::DriverError> {
    if slot.as_ref().is_none_or(|s| s.len() < len) {
        *slot = None;
        let grown = len.next_power_of_two().max(1 << 16);
        // SAFETY: the memory is written before it is read (the table and activations are
        // filled, and outputs are copied in, before any read of them).
        *slot = Some(unsafe { ctx.alloc_pinned_with_flags::<T>(grown, flags) }?);
    }
    slot.as_mut().expect("allocated above").as_mut_ptr()
}

/// Bytes of one activation row for weights of `w`'s format.
pub(crate) fn act_row_bytes(w: &Weights) -> Result<usize, MatmulError> {
    let fmt = kernels::format(w.dtype).ok_or(MatmulError::UnsupportedType(w.dtype))?;
    Ok(fmt.act.row_bytes(w.cols))
}

/// Where one call's data goes: bytes copied in (job tables, activations), bytes that stay on
/// the device, and floats copied out. Offsets are the same on both sides of each copy.
#[derive(Default)]
struct Layout {
    input: usize,
    device: usize,
    output: usize,
}

impl Layout {
    fn input(&mut self, len: usize) -> usize {
        let at = self.input;
        self.input = (at + len).next_multiple_of(16);
        at
    }

    fn device(&mut self, len: usize) -> usize {
        let at = self.device;
        self.device = (at + len).next_multiple_of(256);
        at
    }

    fn output(&mut self, len: usize) -> usize {
        let at = self.output;
        self.output = (at + len).next_multiple_of(4);
        at
    }
}

/// A call's buffers, sized for its layout: the page-locked host sides and the device bases.
struct Staged<'s> {
    host_in: &'s mut [u8],
    host_out: &'s mut [f32],
    in_base: u64,
    tmp_base: u64,
    out_base: u64,
}

impl CudaOffload {
    fn staged<'s>(&self, scratch: &'s mut Scratch, l: &Layout) -> Result<Staged<'s>, MatmulError> {
        self.ensure(&mut scratch.dev_in, l.input.max(16))?;
        self.ensure(&mut scratch.dev_tmp, l.device.max(256))?;
        self.ensure(&mut scratch.dev_out, l.output.max(1))?;
        let base = |s: &Option<CudaSlice<u8>>| s.as_ref().map(|s| s.device_ptr(&self.stream).0);
        let (Some(in_base), Some(tmp_base), Some(out_base)) = (
            base(&scratch.dev_in),
            base(&scratch.dev_tmp),
            scratch
                .dev_out
                .as_ref()
                .map(|s| s.device_ptr(&self.stream).0),
        ) else {
            unreachable!("ensured above");
        };
        let pin_in = ensure_pinned(&self.ctx, &mut scratch.host_in, l.input.max(16))
            .map_err(|e| self.device_error("allocating page-locked memory", e))?;
        let pin_out = ensure_pinned(&self.ctx, &mut scratch.host_out, l.output.max(1))
            .map_err(|e| self.device_error("allocating page-locked memory", e))?;
        // SAFETY: both buffers hold at least l.input / l.output elements (ensured above),
        // nothing else refers to them while the scratch lock (which `scratch` borrows from) is
        // held, and no copy into or out of them is in flight: every call ends by synchronizing
        // the stream.
        let (host_in, host_out) = unsafe {
            (
                std::slice::from_raw_parts_mut(pin_in, l.input),
                std::slice::from_raw_parts_mut(pin_out, l.output),
            )
        };
        Ok(Staged {
            host_in,
            host_out,
            in_base,
            tmp_base,
            out_base,
        })
    }

    fn launch_matmul(
        &self,
        table: u64,
        n_jobs: usize,
        grids: Grids,
        mma_min: usize,
    ) -> Result<(), MatmulError> {
        let (n_jobs, mma_min) = (n_jobs as i32, mma_min as i32);
        for (f, grid, name) in [
            (&self.matmul, grids.dp4a, "launching matmul"),
            (&self.matmul_mma, grids.mma, "launching matmul_mma"),
        ] {
            if grid == 0 {
                continue;
            }
            // Launched in order after the table's copy: nothing to fetch ahead of a wait.
            let early = 0i32;
            let mut launch = self.stream.launch_builder(f);
            launch.arg(&table).arg(&n_jobs).arg(&mma_min).arg(&early);
            let cfg = LaunchConfig {
                grid_dim: (grid, 1, 1),
                block_dim: (THREADS_PER_BLOCK, 1, 1),
                shared_mem_bytes: 0,
            };
            // SAFETY: matmul_grouped / matmul_mma(table, n_jobs, mma_min, early) read a device
            // table of n_jobs records (copied in before this launch, in stream order) whose
            // weight addresses lie in uploaded regions (`device_address` checked each job's
            // whole weight slice), or in the streaming buffer where expert_ffn copied them in
            // before this launch in stream order, and whose activations and outputs lie in this call's buffers,
            // sized from the checked lengths; the blocks stride over the jobs' blocks.
            unsafe { launch.launch(cfg) }.map_err(|e| self.device_error(name, e))?;
        }
        Ok(())
    }

    /// Copies the call's input in, runs `launches`, copies the output back and waits.
    fn round_trip(
        &self,
        st: &mut Staged,
        launches: impl FnOnce() -> Result<(), MatmulError>,
    ) -> Result<(), MatmulError> {
        let cu_stream = self.stream.cu_stream();
        // SAFETY: host_in is page-locked and stays untouched until the synchronize below;
        // dev_in holds at least its length at in_base.
        unsafe {
            cudarc::driver::result::memcpy_htod_async(st.in_base, &st.host_in[..], cu_stream)
        }
        .map_err(|e| self.device_error("copying activations", e))?;
        launches()?;
        // SAFETY: host_out is page-locked and read only after the synchronize; dev_out holds
        // at least its length at out_base.
        unsafe {
            cudarc::driver::result::memcpy_dtoh_async(&mut st.host_out[..], st.out_base, cu_stream)
        }
        .map_err(|e| self.device_error("copying results", e))?;
        self.stream
            .synchronize()
            .map_err(|e| self.device_error("waiting for the GPU", e))
    }

    fn weight_address(&self, w: &Weights) -> Result<u64, MatmulError> {
        if !supports(w.dtype) {
            return Err(MatmulError::UnsupportedType(w.dtype));
        }
        self.device_address(w.data)
            .ok_or_else(|| self.device_error("matmul", "weights not on the device"))
    }

    /// The scratch buffers, with the context made current on this thread (a hybrid step calls
    /// from a thread of its own, where no context is current yet).
    /// The device's scratch buffers (the streaming buffer among them), for one call at a time.
    pub(crate) fn lock(&self) -> Result<std::sync::MutexGuard<'_, Scratch>, MatmulError> {
        self.ctx
            .bind_to_thread()
            .map_err(|e| self.device_error("binding the context to this thread", e))?;
        self.scratch
            .lock()
            .map_err(|_| self.device_error("scratch", "poisoned by an earlier panic"))
    }
}

impl Drop for CudaOffload {
    fn drop(&mut self) {
        // The locked pages go back before the files that hold them are unmapped (`owners`
        // drop after this).
        if self.locked_host.is_empty() || self.ctx.bind_to_thread().is_err() {
            return;
        }
        for &(start, _) in &self.locked_host {
            // SAFETY: `start` was registered by lock_host in this context and not since.
            unsafe { cudarc::driver::sys::cuMemHostUnregister(start as *mut std::ffi::c_void) };
        }
    }
}

pub(crate) fn weights_key(w: &Weights) -> (usize, usize, usize, u64) {
    (w.row_stride(), w.rows, w.cols, w.dtype as u64)
}

fn shape_error(
    what: &'static str,
    w: &Weights,
    n: usize,
    acts: usize,
    need: usize,
    out: usize,
) -> MatmulError {
    MatmulError::Shape {
        what,
        detail: format!(
            "{}×{} {} weights, {n} tokens: {acts} activation bytes (need {need}), {out} outputs",
            w.rows, w.cols, w.dtype
        ),
    }
}

impl Offload for CudaOffload {
    fn name(&self) -> &str {
        &self.name
    }

    fn holds(&self, w: &Weights) -> bool {
        supports(w.dtype) && self.device_address(w.data).is_some()
    }

    fn matmul_batch(&self, jobs: &mut [MatmulJob]) -> Result<(), MatmulError> {
        if jobs.is_empty() {
            return Ok(());
        }
        let mut guard = self.lock()?;
        let mut l = Layout::default();
        let table = l.input(jobs.len() * JOB_FIELDS * 8);
        // Each distinct input once (q, k and v share theirs): (ptr, len, offset, first job).
        let mut inputs: Vec<(usize, usize, usize, usize)> = Vec::new();
        let mut act_at = Vec::with_capacity(jobs.len());
        let mut out_at = Vec::with_capacity(jobs.len());
        for (i, job) in jobs.iter().enumerate() {
            let arb = act_row_bytes(&job.w)?;
            if job.acts.len() != arb * job.n || job.out.len() != job.n * job.w.rows {
                return Err(shape_error(
                    "GPU matmul",
                    &job.w,
                    job.n,
                    job.acts.len(),
                    arb * job.n,
                    job.out.len(),
                ));
            }
            let key = (job.acts.as_ptr() as usize, job.acts.len());
            let off = match inputs.iter().find(|&&(p, len, _, _)| (p, len) == key) {
                Some(&(_, _, off, _)) => off,
                None => {
                    let off = l.input(key.1);
                    inputs.push((key.0, key.1, off, i));
                    off
                }
            };
            act_at.push(off);
            out_at.push(l.output(job.out.len()));
        }
        let mut st = self.staged(&mut guard, &l)?;
        let mut records = Vec::with_capacity(jobs.len());
        for (i, job) in jobs.iter().enumerate() {
            records.push(MatRecord {
                w: self.weight_address(&job.w)?,
                acts: st.in_base + act_at[i] as u64,
                out: st.out_base + 4 * out_at[i] as u64,
                weights: weights_key(&job.w),
                act_stride: act_row_bytes(&job.w)?,
                n: job.n,
                accumulate: false,
            });
        }
        // The batch's threshold by its longest job (a step of that many rows).
        let mma_min = step_mma_min(jobs.iter().map(|j| j.n).max().unwrap_or(0));
        let Some(grid) = write_matmul_table(&mut st.host_in[table..], &records, mma_min) else {
            return Err(self.device_error("matmul", "too many rows or tokens for one launch"));
        };
        if grid.is_empty() {
            return Ok(());
        }
        for &(_, len, off, i) in &inputs {
            st.host_in[off..off + len].copy_from_slice(jobs[i].acts);
        }
        let table_dev = st.in_base + table as u64;
        self.round_trip(&mut st, || {
            self.launch_matmul(table_dev, jobs.len(), grid, mma_min)
        })?;
        for (job, &off) in jobs.iter_mut().zip(&out_at) {
            let len = job.out.len();
            job.out.copy_from_slice(&st.host_out[off..off + len]);
        }
        Ok(())
    }

    fn streams_experts_from(&self) -> Option<usize> {
        self.streaming.from.filter(|_| self.streaming.capacity > 0)
    }

    fn can_stream(&self, w: &Weights) -> bool {
        // An expert's three matrices must fit the buffer together, one pass of the call.
        supports(w.dtype) && 3 * (w.data.len() + STREAM_ALIGN) <= self.streaming.capacity
    }

    fn expert_ffn(&self, jobs: &[ExpertFfnJob], out: &mut [f32]) -> Result<bool, MatmulError> {
        self.run_expert_ffn(jobs, out).map(|()| true)
    }
}
