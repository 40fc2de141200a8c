#!/usr/bin/env python3
"""Plot tools/demo-model/loss.csv (written by train.py) to tools/demo-model/loss.png."""
import csv
import sys
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

HERE = Path(__file__).resolve().parent
src = Path(sys.argv[1]) if len(sys.argv) > 1 else HERE / "loss.csv"
dst = Path(sys.argv[2]) if len(sys.argv) > 2 else HERE / "loss.png"
rows = list(csv.DictReader(open(src)))
tok = [int(r["tokens"]) / 1e6 for r in rows]
fig, ax = plt.subplots(figsize=(8, 4.5), dpi=100)
ax.plot(tok, [float(r["train_loss"]) for r in rows], label="train CE (mean of 10 steps)", lw=1)
vt = [(int(r["tokens"]) / 1e6, float(r["val_loss"])) for r in rows if r["val_loss"]]
ax.plot([t for t, _ in vt], [v for _, v in vt], "o-", label="validation CE (Julius Caesar + Comedy of Errors)")
ax.set_xlabel("training tokens (millions)")
ax.set_ylabel("cross-entropy (nats/token)")
ax.set_title("shakespeare-moe: Qwen3-MoE 13.8 M params, 8 experts top-2")
ax.set_ylim(3.0, 9.0)
ax.grid(alpha=0.3)
ax.legend()
ax2 = ax.twinx()
ax2.plot(tok, [float(r["aux_loss"]) for r in rows], color="gray", lw=0.6, alpha=0.6)
ax2.set_ylabel("per-layer load-balancing loss (2.0 = even)", color="gray")
ax2.set_ylim(1.9, 2.6)
fig.tight_layout()
fig.savefig(dst)
print(f"wrote {dst}")
