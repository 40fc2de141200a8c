//! Platforms built without the CUDA backend (macOS): opening a device says so. The type has
//! no values, so nothing else here can run.

use std::any::Any;
use std::convert::Infallible;
use std::sync::Arc;

use kernels::{MatmulError, MatmulJob, Offload, Weights};

use crate::{DeviceInfo, GpuError};

pub struct CudaOffload(Infallible);

impl CudaOffload {
    pub fn open(_ordinal: usize) -> Result<CudaOffload, GpuError> {
        Err(GpuError::Unavailable(format!(
            "moeshard is built without the CUDA backend on {}",
            std::env::consts::OS
        )))
    }

    pub fn info(&self) -> Result<DeviceInfo, GpuError> {
        match self.0 {}
    }

    pub fn uploaded_bytes(&self) -> u64 {
        match self.0 {}
    }

    pub fn upload(
        &mut self,
        _owner: Arc<dyn Any + Send + Sync>,
        _host: &[u8],
    ) -> Result<(), GpuError> {
        match self.0 {}
    }

    pub fn upload_pieces(
        &mut self,
        _owner: Arc<dyn Any + Send + Sync>,
        _pieces: &[&[u8]],
    ) -> Result<(), GpuError> {
        match self.0 {}
    }

    pub fn stream_experts(&mut self, _from: Option<usize>, _limit: Option<usize>) {
        match self.0 {}
    }

    pub fn read_host_experts(&mut self, _per_row: crate::HostRead) {
        match self.0 {}
    }

    pub fn experts_read_over_link(&self) -> u64 {
        match self.0 {}
    }

    pub fn streamed_bytes(&self) -> u64 {
        match self.0 {}
    }

    pub fn lock_host(
        &mut self,
        _owner: Arc<dyn Any + Send + Sync>,
        _pages: std::ops::Range<usize>,
    ) -> Result<usize, GpuError> {
        match self.0 {}
    }

    pub(crate) fn streaming_limit(&self) -> Option<Option<usize>> {
        match self.0 {}
    }

    pub(crate) fn set_streaming_capacity(&mut self, _capacity: usize) {
        match self.0 {}
    }
}

impl Offload for CudaOffload {
    fn name(&self) -> &str {
        match self.0 {}
    }

    fn holds(&self, _w: &Weights) -> bool {
        match self.0 {}
    }

    fn matmul_batch(&self, _jobs: &mut [MatmulJob]) -> Result<(), MatmulError> {
        match self.0 {}
    }
}
