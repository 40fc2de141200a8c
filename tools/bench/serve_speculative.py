#!/usr/bin/env python3
"""Aggregate decode speed of a running `moeshard serve` with C concurrent greedy completions of
one prompt, and what speculative decoding drafted and kept (the responses' `usage`).

    python3 tools/bench/serve_speculative.py --url http://127.0.0.1:8080 \
        --prompt-file tools/bench/code_edit_prompt.txt -n 256 -c 1 -c 4 -r 3

Each repetition sends C requests at once and times them until the last one is done (prefill
included: the slots' prefix cache holds the prompt from the first repetition on). Standard
library only.
"""

import argparse
import json
import statistics
import threading
import time
import urllib.request


def complete(url, prompt, n, out, i):
    body = json.dumps(
        {"prompt": prompt, "max_tokens": n, "temperature": 0, "ignore_eos": True}
    ).encode()
    req = urllib.request.Request(
        url + "/v1/completions", body, {"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(req, timeout=600) as r:
        out[i] = json.load(r)["usage"]


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--url", default="http://127.0.0.1:8080")
    ap.add_argument("--prompt-file")
    ap.add_argument("--prompt", default="ROMEO:")
    ap.add_argument("-n", type=int, default=256, help="tokens per completion")
    ap.add_argument("-c", type=int, action="append", help="concurrent requests (repeatable)")
    ap.add_argument("-r", type=int, default=3, help="repetitions")
    a = ap.parse_args()
    prompt = open(a.prompt_file).read() if a.prompt_file else a.prompt
    # Warm-up: the model's pages and the prefix cache.
    complete(a.url, prompt, 8, [None], 0)
    for c in a.c or [1]:
        tps, drafted, accepted = [], 0, 0
        for _ in range(a.r):
            usage = [None] * c
            threads = [
                threading.Thread(target=complete, args=(a.url, prompt, a.n, usage, i))
                for i in range(c)
            ]
            t0 = time.perf_counter()
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            secs = time.perf_counter() - t0
            if any(u is None for u in usage):
                raise SystemExit("a request failed")
            tps.append(sum(u["completion_tokens"] for u in usage) / secs)
            for u in usage:
                d = u.get("completion_tokens_details") or {}
                accepted += d.get("accepted_prediction_tokens", 0)
                drafted += d.get("accepted_prediction_tokens", 0) + d.get(
                    "rejected_prediction_tokens", 0
                )
        sd = statistics.stdev(tps) if len(tps) > 1 else 0.0
        line = f"concurrency {c}: {statistics.mean(tps):.1f} ± {sd:.1f} t/s aggregate over {a.r} repetitions"
        if drafted:
            line += f", drafted {drafted}, accepted {accepted} ({100 * accepted / drafted:.1f} %)"
        print(line, flush=True)


if __name__ == "__main__":
    main()
