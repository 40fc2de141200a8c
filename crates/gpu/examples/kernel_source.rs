//! Prints the CUDA source `--gpu` compiles (lookup tables and kernels), for
//! `tools/gpu/check_kernels.py` and `tools/gpu/emulate_rows.py`, which work without a GPU.

fn main() {
    #[cfg(any(target_os = "linux", target_os = "windows"))]
    print!("{}", gpu::kernel_source());
    #[cfg(not(any(target_os = "linux", target_os = "windows")))]
    eprintln!("no CUDA kernels are built for this platform");
}
