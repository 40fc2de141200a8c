#!/usr/bin/env python3
"""The GPU's per-lane row arithmetic run on this CPU, format by format, against gguf-py's
dequantization: no GPU needed. The CUDA source `--gpu` compiles (printed by
`cargo run -p gpu --example kernel_source`) is cut before its kernels, the handful of CUDA
intrinsics the row code uses are defined for the host, and a driver runs `row_dot` for the 32
lanes of a warp and sums them, as `dp4a_rows` does with its shuffles. Weights are random
blocks with sane scales; activations are quantized here to Q8_0 or Q8_K; the reference is
float64 sum(dequantize(w) * dequantize(a)). A wrong bit offset, scale or sign shows as an error
of the order of the result; rounding stays below 1e-5 of the sum of |products|.

    tools/fixtures/quant/setup_venv.sh          # numpy + gguf 0.19.0 (pinned there)
    .cache/venv-quant/bin/python tools/gpu/emulate_rows.py [-v] [TYPE ...]

The device's GPU suite (crates/gpu/tests) compares the same kernels with the CPU's on a GPU.
"""
import argparse
import pathlib
import re
import struct
import subprocess
import sys
import tempfile

import numpy as np
from gguf import GGMLQuantizationType as Q
from gguf.constants import GGML_QUANT_SIZES
from gguf.quants import dequantize

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from check_kernels import kernel_source  # noqa: E402

# The formats the GPU computes, with the activation form their kernels read (crates/kernels
# formats::format) and the byte offsets of their f16 scales (kernels::blocks::f16_scale_fields).
FORMATS = {
    "Q4_0": ("q8_0", [0]), "Q4_1": ("q8_0", [0, 2]), "Q5_0": ("q8_0", [0]),
    "Q5_1": ("q8_0", [0, 2]), "Q8_0": ("q8_0", [0]), "IQ4_NL": ("q8_0", [0]),
    "MXFP4": ("q8_0", []), "Q2_K": ("q8_k", [80, 82]), "Q3_K": ("q8_k", [108]),
    "Q4_K": ("q8_k", [0, 2]), "Q5_K": ("q8_k", [0, 2]), "Q6_K": ("q8_k", [208]),
    "IQ4_XS": ("q8_k", [0]), "IQ2_XXS": ("q8_k", [0]), "IQ2_XS": ("q8_k", [0]),
    "IQ2_S": ("q8_k", [0]), "IQ3_XXS": ("q8_k", [0]), "IQ3_S": ("q8_k", [0]),
    "IQ1_S": ("q8_k", [0]), "IQ1_M": ("q8_k", []),
}

PRELUDE = r"""
#include <cstdint>
#include <cstdio>
#include <cstring>
#define __device__
#define __forceinline__ inline
#define __noinline__
#define __global__
#define __restrict__
static inline int __dp4a(int a, int b, int c) {
    for (int k = 0; k < 4; k++) c += (int)(signed char)(a >> (8 * k)) * (int)(signed char)(b >> (8 * k));
    return c;
}
static inline unsigned __byte_perm(unsigned x, unsigned y, unsigned s) {
    const unsigned long long v = ((unsigned long long)y << 32) | x;
    unsigned r = 0;
    for (int k = 0; k < 4; k++) r |= (unsigned)((v >> (8 * ((s >> (4 * k)) & 7))) & 0xFF) << (8 * k);
    return r;
}
static inline unsigned __vsub4(unsigned a, unsigned b) {
    unsigned r = 0;
    for (int k = 0; k < 4; k++) r |= (((a >> (8 * k)) - (b >> (8 * k))) & 0xFFu) << (8 * k);
    return r;
}
// hi:lo shifted right by shift % 32, the low word kept (CUDA's funnel shift).
static inline unsigned __funnelshift_r(unsigned lo, unsigned hi, unsigned shift) {
    return (unsigned)((((unsigned long long)hi << 32) | lo) >> (shift & 31));
}
static inline float __uint_as_float(unsigned u) { float f; memcpy(&f, &u, 4); return f; }
static inline float host_f16(unsigned short h) {
    const unsigned sign = (h >> 15) & 1, exp = (h >> 10) & 31, man = h & 1023;
    float v;
    if (exp == 0) v = man * (1.0f / 16777216.0f);
    else if (exp == 31) v = man ? __uint_as_float(0x7FC00000u) : __uint_as_float(0x7F800000u);
    else v = __uint_as_float(((exp + 112) << 23) | (man << 13));
    return sign ? -v : v;
}
"""

DRIVER = r"""
// stdin: type, cols, tokens, weight bytes, activation bytes per token; the weight row, then the
// tokens' activation rows. stdout: each token's sum, tile of eight, then token by token (NT=1),
// then token by token from a row 4 bytes past a 16-byte boundary.
int main() {
    int hdr[5];
    if (fread(hdr, 4, 5, stdin) != 5) return 2;
    const int type = hdr[0], cols = hdr[1], n = hdr[2], wlen = hdr[3], alen = hdr[4];
    alignas(16) static u8 w[1 << 20];
    static u8 acts[8 << 20];
    if ((int)fread(w, 1, wlen, stdin) != wlen || (int)fread(acts, 1, (size_t)alen * n, stdin) != alen * n) return 3;
    const bool other = other_format(type);
    for (int t0 = 0; t0 < n; t0 += TT) {
        const int nt = n - t0 < TT ? n - t0 : TT;
        const u8* arow[TT];
        for (int t = 0; t < TT; t++) arow[t] = acts + (size_t)(t0 + (t < nt ? t : nt - 1)) * alen;
        float total[TT] = {0};
        for (int lane = 0; lane < 32; lane++) {
            float acc[TT] = {0};
            if (other) row_dot<TT, true>(type, w, cols, lane, arow, nt, acc);
            else row_dot<TT, false>(type, w, cols, lane, arow, nt, acc);
            for (int t = 0; t < nt; t++) total[t] += acc[t];
        }
        for (int t = 0; t < nt; t++) printf("%.9g\n", total[t]);
    }
    // Token by token from weight row `row`.
    auto one_token_sums = [&](const u8* row) {
        for (int t = 0; t < n; t++) {
            const u8* arow[1] = {acts + (size_t)t * alen};
            float total = 0;
            for (int lane = 0; lane < 32; lane++) {
                float acc[1] = {0};
                if (other) row_dot<1, true>(type, row, cols, lane, arow, 1, acc);
                else row_dot<1, false>(type, row, cols, lane, arow, 1, acc);
                total += acc[0];
            }
            printf("%.9g\n", total);
        }
    };
    one_token_sums(w);
    // The row again at an address 4 bytes past a 16-byte boundary: a matrix's rows need not
    // start at one.
    alignas(16) static u8 w_off[(1 << 20) + 16];
    memcpy(w_off + 4, w, wlen);
    one_token_sums(w_off + 4);
    return 0;
}
"""


def host_program(workdir: pathlib.Path) -> pathlib.Path:
    src = kernel_source()
    cut = src.index("// The tensor-core path")
    src = src[:cut]
    f16 = 'asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h));'
    if f16 not in src:
        sys.exit("emulate_rows: f16_to_f32's asm changed; update the substitution here")
    src = src.replace(f16, "f = host_f16(h);")
    path = workdir / "rows.cpp"
    path.write_text(PRELUDE + src + DRIVER)
    exe = workdir / "rows"
    r = subprocess.run(["g++", "-O1", "-std=c++17", "-w", str(path), "-o", str(exe)],
                       capture_output=True, text=True)
    if r.returncode:
        sys.exit(f"g++ failed:\n{r.stderr[:4000]}")
    return exe


def random_blocks(name: str, n_blocks: int, rng) -> bytes:
    qtype = Q[name]
    _, size = GGML_QUANT_SIZES[qtype]
    raw = bytearray(rng.integers(0, 256, n_blocks * size, dtype=np.uint8).tobytes())
    _, f16_fields = FORMATS[name]
    for b in range(n_blocks):
        base = b * size
        for off in f16_fields:
            raw[base + off:base + off + 2] = np.float16(0.001 + 0.02 * rng.random()).tobytes()
        if name == "MXFP4":
            raw[base] = 118 + int(rng.integers(0, 12))
        if name == "IQ1_M":
            # The f16 scale is the top nibbles of the four scale words (bytes 49, 51, 53, 55).
            d = int(np.float16(0.001 + 0.015 * rng.random()).view(np.uint16))
            for i, o in enumerate([49, 51, 53, 55]):
                raw[base + o] = (raw[base + o] & 0x0F) | (((d >> (4 * i)) & 0xF) << 4)
    return bytes(raw)


def quantize_q8_0(x: np.ndarray) -> tuple[bytes, np.ndarray]:
    out, deq = bytearray(), []
    for blk in x.reshape(-1, 32):
        d = np.float16(np.abs(blk).max() / 127.0)
        q = np.clip(np.round(blk / np.float32(d)) if d else np.zeros(32), -127, 127).astype(np.int8)
        out += d.tobytes() + q.tobytes()
        deq.append(np.float64(d) * q.astype(np.float64))
    return bytes(out), np.concatenate(deq)


def quantize_q8_k(x: np.ndarray) -> tuple[bytes, np.ndarray]:
    out, deq = bytearray(), []
    for blk in x.reshape(-1, 256):
        d = np.float32(np.abs(blk).max() / 127.0)
        q = np.clip(np.round(blk / d), -127, 127).astype(np.int8)
        bsums = q.astype(np.int32).reshape(16, 16).sum(axis=1).astype(np.int16)
        out += struct.pack("<f", d) + q.tobytes() + bsums.tobytes()
        deq.append(np.float64(d) * q.astype(np.float64))
    return bytes(out), np.concatenate(deq)


def check(exe: pathlib.Path, name: str, cols: int, n: int, seed: int, verbose: bool) -> float:
    rng = np.random.default_rng(seed)
    qtype = Q[name]
    block, _ = GGML_QUANT_SIZES[qtype]
    w = random_blocks(name, cols // block, rng)
    wdeq = dequantize(np.frombuffer(w, dtype=np.uint8), qtype).astype(np.float64).reshape(-1)
    act_kind, _ = FORMATS[name]
    quant = quantize_q8_0 if act_kind == "q8_0" else quantize_q8_k
    rows = [quant(rng.standard_normal(cols).astype(np.float32)) for _ in range(n)]
    alen = len(rows[0][0])
    payload = struct.pack("<5i", int(qtype), cols, n, len(w), alen) + w + b"".join(r[0] for r in rows)
    r = subprocess.run([str(exe)], input=payload, capture_output=True)
    if r.returncode:
        sys.exit(f"{name}: the emulated rows failed ({r.returncode})")
    got = np.array([float(v) for v in r.stdout.split()])
    want = np.array([float(wdeq @ a) for _, a in rows])
    scale = np.array([float(np.abs(wdeq * a).sum()) for _, a in rows])
    err = np.abs(got - np.concatenate([want] * 3)) / np.concatenate([scale] * 3)
    if verbose:
        print(f"  {name}: want {want[:3]} got {got[:3]} (tile) {got[n:n + 3]} (one token) "
              f"{got[2 * n:2 * n + 3]} (unaligned row)")
    return float(err.max())


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("types", nargs="*", help="formats to check (default: all)")
    ap.add_argument("-v", action="store_true")
    args = ap.parse_args()
    names = args.types or list(FORMATS)
    bad = []
    with tempfile.TemporaryDirectory() as tmp:
        exe = host_program(pathlib.Path(tmp))
        for name in names:
            # 40 or 41 segments: lanes loop; 11 tokens: a full tile of eight and a partial one.
            cols = 1280 if GGML_QUANT_SIZES[Q[name]][0] == 32 else 2560
            worst = max(check(exe, name, cols, 11, seed, args.v) for seed in (1, 2, 3))
            ok = worst < 1e-5
            print(f"{name:8} max error {worst:.2e} of the sum of |products|  {'ok' if ok else 'WRONG'}")
            if not ok:
                bad.append(name)
    if bad:
        sys.exit(f"wrong: {', '.join(bad)}")


if __name__ == "__main__":
    main()
