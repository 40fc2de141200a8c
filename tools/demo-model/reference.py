#!/usr/bin/env python3
"""Reference numbers of the trained checkpoint, computed with transformers (CPU, float32).

Writes:
  crates/cli/tests/data/demo/fixture.json   fixture prompt, its token ids (BOS included), the
                                             positions whose logits are stored, transformers'
                                             greedy continuation of the run-test prompt
  crates/cli/tests/data/demo/hf_logits.npy  float32 [len(positions), n_vocab]: transformers'
                                             logits at those positions of the fixture tokens
  tools/demo-model/eval.json                validation loss / perplexity of the checkpoint and
                                             router balance on the validation split
Prints a markdown table of the router balance (pasted into models/README.md).

Usage: reference.py [--hf DIR] [--data DIR]
"""
import argparse
import json
import math
import os
import sys
from pathlib import Path

import numpy as np
import torch
from tokenizers import Tokenizer
from transformers import Qwen3MoeForCausalLM

HERE = Path(__file__).resolve().parent
REPO = HERE.parent.parent
CACHE = Path(os.environ.get("MOESHARD_CACHE", REPO / ".cache"))
TESTDATA = REPO / "crates" / "cli" / "tests" / "data" / "demo"
sys.path.insert(0, str(HERE))
from train import SEQ, val_windows  # noqa: E402

FIXTURE_PROMPT = "ROMEO:\nBut soft, what light through yonder window breaks?\n\nJULIET:\n"
RUN_PROMPT = "ROMEO:"
RUN_TOKENS = 32


@torch.no_grad()
def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--hf", default=str(CACHE / "demo-model" / "hf"))
    ap.add_argument("--data", default=str(CACHE / "demo-model" / "data"))
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    tok = Tokenizer.from_file(str(Path(args.hf) / "tokenizer.json"))
    model = Qwen3MoeForCausalLM.from_pretrained(args.hf, torch_dtype=torch.float32).eval()
    cfg = model.config
    TESTDATA.mkdir(parents=True, exist_ok=True)

    # 1. logits fixture (tokenizer.json adds the BOS, as the GGUF's add_bos_token does)
    ids = tok.encode(FIXTURE_PROMPT).ids
    assert ids[0] == 0
    logits = model(input_ids=torch.tensor([ids])).logits[0].float().numpy()
    n = len(ids)
    positions = sorted(set([0, 1, 2, n // 3, n // 2, (2 * n) // 3, n - 2, n - 1]))
    np.save(TESTDATA / "hf_logits.npy", logits[positions].astype(np.float32))

    # 2. greedy continuation of the run prompt (no KV-cache subtleties: full recompute each step)
    run_ids = tok.encode(RUN_PROMPT).ids
    cur = list(run_ids)
    for _ in range(RUN_TOKENS):
        nxt = int(model(input_ids=torch.tensor([cur])).logits[0, -1].argmax())
        cur.append(nxt)
        if nxt == cfg.eos_token_id:
            break
    gen = cur[len(run_ids):]
    fixture = {
        "about": "tools/demo-model/reference.py: transformers 4.57.6 float32 on the trained checkpoint",
        "prompt": FIXTURE_PROMPT, "tokens": ids, "positions": positions,
        "pieces": [tok.id_to_token(i) for i in ids], "n_vocab": int(logits.shape[1]),
        "hf_top1": [int(logits[p].argmax()) for p in positions],
        "run_prompt": RUN_PROMPT, "run_prompt_tokens": run_ids, "run_n": RUN_TOKENS,
        "hf_greedy_tokens": gen, "hf_greedy_text": tok.decode(gen, skip_special_tokens=False),
    }
    (TESTDATA / "fixture.json").write_text(json.dumps(fixture, indent=1) + "\n")

    # 3. validation loss and router balance
    val = np.asarray(tok.encode((Path(args.data) / "val.txt").read_text(encoding="utf-8"),
                                add_special_tokens=False).ids, dtype=np.int32)
    win = val_windows(val)
    E, K, L = cfg.num_experts, cfg.num_experts_per_tok, cfg.num_hidden_layers
    counts = np.zeros((L, E), dtype=np.int64)
    top1 = np.zeros((L, E), dtype=np.int64)
    tot, cnt = 0.0, 0
    for i in range(0, len(win), 16):
        x = win[i:i + 16]
        out = model(input_ids=x, output_router_logits=True)
        lg = out.logits[:, :-1].float()
        tot += torch.nn.functional.cross_entropy(lg.reshape(-1, lg.shape[-1]), x[:, 1:].reshape(-1),
                                                 reduction="sum").item()
        cnt += x[:, 1:].numel()
        for layer, rl in enumerate(out.router_logits):
            sel = torch.topk(rl.float(), K, dim=-1).indices  # [tokens, K]
            counts[layer] += np.bincount(sel.reshape(-1).numpy(), minlength=E)
            top1[layer] += np.bincount(sel[:, 0].numpy(), minlength=E)
    share = counts / counts.sum(axis=1, keepdims=True)
    cv = share.std(axis=1) / share.mean(axis=1)
    val_loss = tot / cnt
    ev = {
        "val_tokens_scored": cnt, "val_windows": int(len(win)), "window": SEQ,
        "val_loss": round(val_loss, 4), "val_ppl": round(math.exp(val_loss), 2),
        "val_bits_per_byte": None,
        "router_share_top2": [[round(float(v), 4) for v in row] for row in share],
        "router_share_min": [round(float(v), 4) for v in share.min(axis=1)],
        "router_share_max": [round(float(v), 4) for v in share.max(axis=1)],
        "router_share_cv": [round(float(v), 4) for v in cv],
        "router_tokens_per_layer": int(counts[0].sum() // K),
    }
    nbytes = len((Path(args.data) / "val.txt").read_bytes())
    scored_frac = cnt / len(val)
    ev["val_bits_per_byte"] = round(val_loss * cnt / math.log(2) / (nbytes * scored_frac), 4)
    (HERE / "eval.json").write_text(json.dumps(ev, indent=1) + "\n")
    print(json.dumps({k: v for k, v in ev.items() if k != "router_share_top2"}, indent=1))
    print("| layer | min share | max share | CV | shares of experts 0–7 (%) |")
    print("|---|---|---|---|---|")
    for layer in range(L):
        print(f"| {layer} | {share[layer].min() * 100:.1f} % | {share[layer].max() * 100:.1f} % | {cv[layer]:.3f} | "
              + " ".join(f"{v * 100:.1f}" for v in share[layer]) + " |")
    print("fixture:", json.dumps({k: fixture[k] for k in ("tokens", "positions", "hf_greedy_tokens", "hf_greedy_text")}))


if __name__ == "__main__":
    main()
