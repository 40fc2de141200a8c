#!/usr/bin/env python3
"""Export the trained HF checkpoint to GGUF with llama.cpp's own converter.

The converter is the one vendored in the PyPI sdist llama-cpp-python==0.3.36 (llama.cpp
0c1e57098bba43ac29e6e3b677cdceebdd22334f): convert_hf_to_gguf.py + conversion/ + gguf-py/ are
unpacked from $MOESHARD_CACHE/downloads/llama_cpp_python-0.3.36.tar.gz (fetched, sha256-checked,
by tools/fetch_test_data.py) into $MOESHARD_CACHE/demo-model/llama.cpp-convert/. Nothing in the
cache's other copies is modified.

Our vocabulary is new, so the converter does not know the hash of its pre-tokenizer; this script
monkeypatches `TextModel.get_vocab_base_pre` (in-process, at import time) to answer "gpt-2",
which is exactly the pre-tokenizer train_tokenizer.py trained with.

Outputs:
  models/shakespeare-moe.gguf                          Q8_0 (the converter's own Q8_0 quantizer;
                                                       norms and the router stay F32, as llama.cpp does)
  $MOESHARD_CACHE/demo-model/shakespeare-moe-f32.gguf  F32 (reference; not committed)

Usage: export.py [--hf DIR]   (default $MOESHARD_CACHE/demo-model/hf)
"""
import argparse
import os
import subprocess
import sys
import tarfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent.parent
CACHE = Path(os.environ.get("MOESHARD_CACHE", REPO / ".cache"))
SDIST = CACHE / "downloads" / "llama_cpp_python-0.3.36.tar.gz"
CONV = CACHE / "demo-model" / "llama.cpp-convert"
PREFIX = "llama_cpp_python-0.3.36/vendor/llama.cpp/"
PRE = "gpt-2"


def ensure_converter() -> Path:
    if (CONV / "convert_hf_to_gguf.py").exists() and (CONV / "conversion").is_dir():
        return CONV
    subprocess.check_call([sys.executable, str(REPO / "tools" / "fetch_test_data.py"), "llama-cpp-python"])
    CONV.mkdir(parents=True, exist_ok=True)
    with tarfile.open(SDIST) as tf:
        for m in tf.getmembers():
            if not m.isfile() or not m.name.startswith(PREFIX):
                continue
            rel = m.name[len(PREFIX):]
            if rel == "convert_hf_to_gguf.py" or rel.startswith("conversion/") or rel.startswith("gguf-py/"):
                dest = CONV / rel
                dest.parent.mkdir(parents=True, exist_ok=True)
                dest.write_bytes(tf.extractfile(m).read())
    return CONV


def convert_inner(argv):
    """Runs inside a child process: patch the pre-tokenizer lookup, then the converter's main()."""
    conv = ensure_converter()
    sys.path.insert(0, str(conv))
    sys.path.insert(1, str(conv / "gguf-py"))
    import conversion.base as base

    def forced_pre(self, tokenizer):
        return PRE

    base.TextModel.get_vocab_base_pre = forced_pre
    import convert_hf_to_gguf
    sys.argv = ["convert_hf_to_gguf.py"] + argv
    convert_hf_to_gguf.main()


def main():
    if len(sys.argv) > 1 and sys.argv[1] == "_convert":
        convert_inner(sys.argv[2:])
        return
    ap = argparse.ArgumentParser()
    ap.add_argument("--hf", default=str(CACHE / "demo-model" / "hf"))
    ap.add_argument("--out", default=str(REPO / "models" / "shakespeare-moe.gguf"))
    ap.add_argument("--f32-out", default=str(CACHE / "demo-model" / "shakespeare-moe-f32.gguf"))
    args = ap.parse_args()
    ensure_converter()
    common = ["--model-name", "shakespeare-moe"]
    for outtype, out in (("f32", args.f32_out), ("q8_0", args.out)):
        Path(out).parent.mkdir(parents=True, exist_ok=True)
        subprocess.check_call([sys.executable, __file__, "_convert", args.hf, "--outtype", outtype,
                               "--outfile", out] + common)
        print(f"wrote {out} ({os.path.getsize(out) / 1e6:.2f} MB)")


if __name__ == "__main__":
    main()
