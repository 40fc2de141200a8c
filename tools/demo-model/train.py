#!/usr/bin/env python3
"""Train the demo Qwen3-MoE model on the Shakespeare corpus, on CPU, deterministically.

Inputs: data dir from prepare_data.py (train.txt, val.txt) and the tokenizer from
train_tokenizer.py (in --out, which becomes the HF checkpoint directory).

Every training window is [<|endoftext|>] + 255 corpus tokens starting at a random offset; the
offsets of step s come from numpy's default_rng([SEED, s]), so a resumed run sees the same data.
Loss = cross-entropy + router_aux_loss_coef * Switch-style load-balancing loss computed PER LAYER
(transformers' load_balancing_loss_func on each layer's router logits, averaged over layers; the
model's built-in aux loss concatenates all layers first, which only balances experts summed over
layers and, in our first run, left single layers with dead experts). AdamW, linear warm-up then
cosine decay to 10 %.

Writes (in --out): config.json, model.safetensors, generation_config.json, the tokenizer files;
checkpoints (ckpt.pt) every --ckpt-every seconds; and next to this script: loss.csv (one row
per logged step) and train_log.json (summary). Resumes from --out/ckpt.pt when present.

Usage: nice -n 10 train.py [--steps N] [--threads 2]
"""
import argparse
import csv
import json
import math
import os
import time
from pathlib import Path

import numpy as np
import torch
from tokenizers import Tokenizer
from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM
from transformers.models.qwen3_moe.modeling_qwen3_moe import load_balancing_loss_func

HERE = Path(__file__).resolve().parent
REPO = HERE.parent.parent
CACHE = Path(os.environ.get("MOESHARD_CACHE", REPO / ".cache"))
SEED = 1234
SEQ = 256  # tokens per window, BOS included

MODEL = dict(
    vocab_size=6144,
    hidden_size=256,
    num_hidden_layers=6,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=64,
    intermediate_size=1024,  # unused: every layer is MoE (decoder_sparse_step=1, no mlp_only_layers)
    moe_intermediate_size=256,
    num_experts=8,
    num_experts_per_tok=2,
    norm_topk_prob=True,
    decoder_sparse_step=1,
    mlp_only_layers=[],
    router_aux_loss_coef=0.05,
    output_router_logits=True,
    max_position_embeddings=512,
    rope_theta=10000.0,
    rms_norm_eps=1e-6,
    tie_word_embeddings=False,
    attention_bias=False,
    use_sliding_window=False,
    bos_token_id=0,
    eos_token_id=0,
    pad_token_id=0,
    initializer_range=0.02,
)


def encode_file(tok: Tokenizer, path: Path) -> np.ndarray:
    text = path.read_text(encoding="utf-8")
    # one call over the whole text (no BOS): exactly what the engine's tokenizer does with it
    ids = tok.encode(text, add_special_tokens=False).ids
    return np.asarray(ids, dtype=np.int32)


def lr_at(step, steps, lr, warmup):
    if step < warmup:
        return lr * (step + 1) / warmup
    p = (step - warmup) / max(1, steps - warmup)
    return lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, p))))


def batch_at(data: np.ndarray, step: int, batch: int) -> torch.Tensor:
    rng = np.random.default_rng([SEED, step])
    starts = rng.integers(0, len(data) - (SEQ - 1), size=batch)
    x = np.stack([np.concatenate([[0], data[s:s + SEQ - 1]]) for s in starts])
    return torch.from_numpy(x.astype(np.int64))


def val_windows(val: np.ndarray) -> torch.Tensor:
    """Non-overlapping windows [BOS] + 255 tokens covering the validation text."""
    n = (len(val) // (SEQ - 1))
    x = np.stack([np.concatenate([[0], val[i * (SEQ - 1):(i + 1) * (SEQ - 1)]]) for i in range(n)])
    return torch.from_numpy(x.astype(np.int64))


@torch.no_grad()
def evaluate(model, windows: torch.Tensor, bs=16):
    """Mean CE over the windows, and the coefficient of variation of each layer's expert shares."""
    model.eval()
    dev = next(model.parameters()).device
    E, K = model.config.num_experts, model.config.num_experts_per_tok
    counts = torch.zeros(model.config.num_hidden_layers, E, dtype=torch.float64)
    tot, cnt = 0.0, 0
    for i in range(0, len(windows), bs):
        x = windows[i:i + bs].to(dev)
        out = model(input_ids=x, output_router_logits=True)
        for layer, rl in enumerate(out.router_logits):
            sel = torch.topk(rl.float(), K, dim=-1).indices.reshape(-1).cpu()
            counts[layer] += torch.bincount(sel, minlength=E).double()
        logits = out.logits[:, :-1].float()
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), x[:, 1:].reshape(-1),
                                                 reduction="sum")
        tot += loss.item()
        cnt += x[:, 1:].numel()
    model.train()
    share = counts / counts.sum(dim=1, keepdim=True)
    cv = (share.std(dim=1, unbiased=False) / share.mean(dim=1)).tolist()
    return tot / cnt, cv


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", default=str(CACHE / "demo-model" / "data"))
    ap.add_argument("--out", default=str(CACHE / "demo-model" / "hf"))
    ap.add_argument("--steps", type=int, default=1000)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--warmup", type=int, default=100)
    ap.add_argument("--wd", type=float, default=0.1)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--device", default="cpu", help="cpu (the reference) or cuda")
    ap.add_argument("--log-every", type=int, default=10)
    ap.add_argument("--eval-every", type=int, default=100)
    ap.add_argument("--eval-windows", type=int, default=261, help="val windows for periodic evals")
    ap.add_argument("--ckpt-every", type=float, default=300.0)
    ap.add_argument("--bench", type=int, default=0, help="only time this many steps and exit")
    ap.add_argument("--csv", default=str(HERE / "loss.csv"))
    ap.add_argument("--aux-coef", type=float, default=MODEL["router_aux_loss_coef"])
    args = ap.parse_args()
    MODEL["router_aux_loss_coef"] = args.aux_coef

    torch.set_num_threads(args.threads)
    torch.manual_seed(SEED)
    np.random.seed(SEED)
    out = Path(args.out)
    tok = Tokenizer.from_file(str(out / "tokenizer.json"))
    assert tok.get_vocab_size() == MODEL["vocab_size"]
    train = encode_file(tok, Path(args.data) / "train.txt")
    val = encode_file(tok, Path(args.data) / "val.txt")
    vwin = val_windows(val)
    print(f"train tokens {len(train)}  val tokens {len(val)}  val windows {len(vwin)}", flush=True)

    config = Qwen3MoeConfig(**MODEL)
    model = Qwen3MoeForCausalLM(config).float()
    if args.device != "cpu":
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
        model = model.to(args.device)
    n_params = sum(p.numel() for p in model.parameters())
    n_expert = sum(p.numel() for n, p in model.named_parameters() if ".experts." in n)
    n_active = n_params - n_expert + n_expert * MODEL["num_experts_per_tok"] // MODEL["num_experts"]
    print(f"params {n_params}  (experts {n_expert}, active/token {n_active})", flush=True)

    decay = [p for n, p in model.named_parameters() if p.dim() >= 2 and "embed" not in n]
    no_decay = [p for n, p in model.named_parameters() if not (p.dim() >= 2 and "embed" not in n)]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": args.wd},
                             {"params": no_decay, "weight_decay": 0.0}],
                            lr=args.lr, betas=(0.9, 0.95), eps=1e-8)

    step, elapsed_prev, rows = 0, 0.0, []
    ckpt = out / "ckpt.pt"
    if ckpt.exists() and not args.bench:
        st = torch.load(ckpt, weights_only=False, map_location=args.device)
        model.load_state_dict(st["model"])
        opt.load_state_dict(st["opt"])
        step, elapsed_prev, rows = st["step"], st["elapsed"], st["rows"]
        torch.set_rng_state(st["torch_rng"].cpu())
        print(f"resumed at step {step} ({elapsed_prev:.0f}s)", flush=True)

    def save_ckpt():
        tmp = out / "ckpt.pt.tmp"
        torch.save({"model": model.state_dict(), "opt": opt.state_dict(), "step": step,
                    "elapsed": elapsed_prev + time.time() - t0, "rows": rows,
                    "torch_rng": torch.get_rng_state()}, tmp)
        os.replace(tmp, ckpt)

    def write_csv():
        with open(args.csv, "w", newline="") as f:
            w = csv.writer(f)
            w.writerow(["step", "tokens", "elapsed_s", "lr", "train_loss", "aux_loss", "val_loss",
                        "router_cv_max"])
            for r in rows:
                w.writerow(r)

    model.train()
    t0 = time.time()
    last_ckpt = t0
    acc_loss, acc_aux, acc_n = 0.0, 0.0, 0
    total = args.bench or args.steps
    while step < total:
        lr = lr_at(step, args.steps, args.lr, args.warmup)
        for g in opt.param_groups:
            g["lr"] = lr
        x = batch_at(train, step, args.batch).to(args.device)
        out_ = model(input_ids=x, labels=x, output_router_logits=True)
        ce = out_.loss - config.router_aux_loss_coef * out_.aux_loss  # drop the built-in (all-layer) aux
        aux = torch.stack([load_balancing_loss_func((rl,), config.num_experts, config.num_experts_per_tok)
                           for rl in out_.router_logits]).mean()
        loss = ce + config.router_aux_loss_coef * aux
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        step += 1
        acc_loss += ce.item()
        acc_aux += aux.item()
        acc_n += 1
        if args.bench:
            el = time.time() - t0
            print(f"bench step {step} {el:.1f}s  {step * args.batch * SEQ / el:.0f} tok/s  loss {ce.item():.3f}",
                  flush=True)
            continue
        if step % args.log_every == 0 or step == total:
            val_loss, cv = "", ""
            if step % args.eval_every == 0 or step == total:
                val_loss, cvs = evaluate(model, vwin[:args.eval_windows] if step != total else vwin)
                cv = round(max(cvs), 4)
            el = elapsed_prev + time.time() - t0
            rows.append([step, step * args.batch * SEQ, round(el, 1), lr, round(acc_loss / acc_n, 4),
                         round(acc_aux / acc_n, 4), "" if val_loss == "" else round(val_loss, 4), cv])
            print(f"step {step}/{total}  {el:.0f}s  lr {lr:.2e}  loss {acc_loss / acc_n:.4f}  "
                  f"aux {acc_aux / acc_n:.4f}" + (f"  val {val_loss:.4f}  router cv max {cv}" if val_loss != "" else ""),
                  flush=True)
            acc_loss, acc_aux, acc_n = 0.0, 0.0, 0
            write_csv()
        if time.time() - last_ckpt > args.ckpt_every:
            save_ckpt()
            last_ckpt = time.time()
    if args.bench:
        return
    save_ckpt()
    final_val = rows[-1][6]
    model.config.output_router_logits = False
    model.generation_config.bos_token_id = 0
    model.generation_config.eos_token_id = 0
    model.generation_config.pad_token_id = 0
    model.to("cpu").save_pretrained(out, safe_serialization=True)
    summary = {
        "seed": SEED, "seq": SEQ, "steps": args.steps, "batch": args.batch, "lr": args.lr,
        "warmup": args.warmup, "weight_decay": args.wd, "threads": args.threads, "device": args.device,
        "train_tokens_seen": args.steps * args.batch * SEQ, "train_corpus_tokens": int(len(train)),
        "val_tokens": int(vwin[:, 1:].numel()),
        "params": n_params, "expert_params": n_expert, "active_params_per_token": n_active,
        "wall_s": rows[-1][2], "final_train_loss": rows[-1][4], "final_val_loss": final_val,
        "final_val_ppl": math.exp(final_val), "final_router_cv_max": rows[-1][7],
        "torch": torch.__version__, "model": MODEL,
    }
    (Path(args.csv).with_name("train_log.json")).write_text(json.dumps(summary, indent=1))
    print(json.dumps(summary, indent=1), flush=True)


if __name__ == "__main__":
    main()
