#!/usr/bin/env python3
"""Compile the GPU kernels here, without a GPU: NVRTC turns crates/gpu's CUDA source into PTX
(as `--gpu` does when it opens the device) and ptxas assembles that PTX for sm_90, so a syntax
error, a bad inline-asm operand or a register spill shows before device time is spent.

    python3 -m venv .cache/cudatools/venv
    .cache/cudatools/venv/bin/pip install -r tools/gpu/requirements.txt
    .cache/cudatools/venv/bin/python tools/gpu/check_kernels.py [--arch sm_90] [-v] [-D NAME=VALUE ...]
"""
import argparse
import ctypes
import pathlib
import subprocess
import sys
import tempfile

ROOT = pathlib.Path(__file__).resolve().parents[2]


def kernel_source() -> str:
    """The text `--gpu` hands NVRTC (lookup tables written from the CPU kernels' tables, then
    crates/gpu's .cu files), as `gpu::kernel_source` builds it."""
    r = subprocess.run(
        ["cargo", "run", "-q", "-p", "gpu", "--example", "kernel_source"],
        cwd=ROOT, capture_output=True, text=True,
    )
    if r.returncode or not r.stdout:
        sys.exit(f"cargo run --example kernel_source failed:\n{r.stderr}")
    return r.stdout


def nvrtc_library():
    import nvidia.cuda_nvrtc

    lib_dir = pathlib.Path(list(nvidia.cuda_nvrtc.__path__)[0]) / "lib"
    return ctypes.CDLL(str(sorted(lib_dir.glob("libnvrtc.so*"))[0]))


def compile_ptx(source: str, arch: str, defines: list[str] = ()) -> str:
    nvrtc = nvrtc_library()
    prog = ctypes.c_void_p()
    rc = nvrtc.nvrtcCreateProgram(ctypes.byref(prog), source.encode(), b"matmul.cu", 0, None, None)
    if rc:
        sys.exit(f"nvrtcCreateProgram failed: {rc}")
    opts = [f"--gpu-architecture={arch}".encode()] + [f"-D{d}".encode() for d in defines]
    arr = (ctypes.c_char_p * len(opts))(*opts)
    rc = nvrtc.nvrtcCompileProgram(prog, len(opts), arr)
    size = ctypes.c_size_t()
    nvrtc.nvrtcGetProgramLogSize(prog, ctypes.byref(size))
    log = ctypes.create_string_buffer(size.value)
    nvrtc.nvrtcGetProgramLog(prog, log)
    if log.value.strip():
        print(log.value.decode(), file=sys.stderr)
    if rc:
        sys.exit(f"NVRTC failed ({rc})")
    nvrtc.nvrtcGetPTXSize(prog, ctypes.byref(size))
    ptx = ctypes.create_string_buffer(size.value)
    nvrtc.nvrtcGetPTX(prog, ptx)
    return ptx.value.decode()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--arch", default="sm_90")
    ap.add_argument("-v", action="store_true", help="ptxas's register and spill report")
    ap.add_argument("-D", dest="defines", action="append", default=[], metavar="NAME=VALUE",
                    help="a compile-time choice, as `--gpu` passes them (matmul_table.rs "
                         "kernel_compile_options), e.g. -D ONE_MIN_BLOCKS=8")
    ap.add_argument("--cubin", metavar="PATH",
                    help="keep the assembled cubin there (for nvdisasm/cuobjdump -sass)")
    args = ap.parse_args()
    import nvidia.cuda_nvcc

    source = kernel_source()
    ptx = compile_ptx(source, args.arch, args.defines)
    ptxas = pathlib.Path(list(nvidia.cuda_nvcc.__path__)[0]) / "bin" / "ptxas"
    with tempfile.TemporaryDirectory() as tmp:
        path = pathlib.Path(tmp) / "kernels.ptx"
        path.write_text(ptx)
        cmd = [str(ptxas), f"-arch={args.arch}", str(path), "-o", str(path.with_suffix(".cubin"))]
        if args.v:
            cmd.insert(1, "-v")
        r = subprocess.run(cmd, capture_output=True, text=True)
        sys.stderr.write(r.stdout + r.stderr)
        if r.returncode:
            sys.exit(f"ptxas failed ({r.returncode})")
        if args.cubin:
            pathlib.Path(args.cubin).write_bytes(path.with_suffix(".cubin").read_bytes())
    print(f"ok: {len(ptx)} bytes of PTX assemble for {args.arch}")


if __name__ == "__main__":
    main()
