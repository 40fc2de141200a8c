#!/usr/bin/env python3
"""Load generator for `moeshard serve` (standard library only).

For each concurrency N it streams N completions at once (distinct prompts, greedy, past EOS,
no prefix reuse) and prints the aggregate decode speed; then it measures the time to first
token of a chat's second turn with the first turn's KV cached versus evaluated cold.

    tools/server-tests/load.py --url http://127.0.0.1:8080 -n 1,2,4,8 --max-tokens 64

Aggregate decode t/s = sum over streams of (tokens - 1) / (last stream end - first stream's
first token): the first token of each stream comes from its prefill, the rest from decode steps.
"""

import argparse
import http.client
import json
import statistics
import threading
import time
import urllib.parse

PROMPTS = [
    "The history of the printing press begins",
    "In the middle of the ocean there was a small island where",
    "A good cup of coffee needs three things:",
    "The first law of thermodynamics states that",
    "Once upon a time, a fox and a crow",
    "To build a wooden chair, you start by",
    "The city at night was quiet, except for",
    "Here is a short poem about the autumn wind:",
    "The main causes of the French Revolution were",
    "When the train finally arrived at the station,",
    "The recipe calls for two eggs, flour and",
    "Mountains form when tectonic plates",
    "The old lighthouse keeper looked at the sea and",
    "A brief explanation of how vaccines work:",
    "The robot opened its eyes for the first time and",
    "Learning a new language is easier when",
]


def stream(url, path, body, timeout=600):
    """POSTs a streaming request; returns (t_start, t_first_token, t_end, usage)."""
    u = urllib.parse.urlsplit(url)
    conn = http.client.HTTPConnection(u.hostname, u.port, timeout=timeout)
    t0 = time.perf_counter()
    conn.request("POST", path, json.dumps(body), {"Content-Type": "application/json"})
    resp = conn.getresponse()
    if resp.status != 200:
        raise RuntimeError(f"{resp.status}: {resp.read()[:300]!r}")
    first = None
    usage = None
    for raw in resp:
        line = raw.decode("utf-8", "replace").strip()
        if not line.startswith("data: "):
            continue
        data = line[len("data: "):]
        if data == "[DONE]":
            break
        chunk = json.loads(data)
        if "error" in chunk:
            raise RuntimeError(chunk["error"])
        if chunk.get("usage"):
            usage = chunk["usage"]
        ch = chunk.get("choices") or []
        text = ch[0].get("text") or (ch[0].get("delta") or {}).get("content") if ch else None
        if text and first is None:
            first = time.perf_counter()
    end = time.perf_counter()
    conn.close()
    return t0, first or end, end, usage


def run_concurrent(args, n):
    results = [None] * n
    errors = []

    def one(i):
        body = {
            "model": args.model, "prompt": PROMPTS[i % len(PROMPTS)] + f" (#{i})",
            "max_tokens": args.max_tokens, "temperature": 0, "ignore_eos": True,
            "cache_prompt": False, "stream": True, "stream_options": {"include_usage": True},
        }
        try:
            results[i] = stream(args.url, "/v1/completions", body)
        except Exception as e:  # reported below
            errors.append(e)

    threads = [threading.Thread(target=one, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise SystemExit(f"N={n}: {errors[0]}")
    tokens = sum(r[3]["completion_tokens"] for r in results)
    decode_tokens = sum(r[3]["completion_tokens"] - 1 for r in results)
    start = min(r[0] for r in results)
    first = min(r[1] for r in results)
    end = max(r[2] for r in results)
    per_stream = [(r[3]["completion_tokens"] - 1) / max(r[2] - r[1], 1e-9) for r in results]
    ttft = [r[1] - r[0] for r in results]
    print(
        f"N={n}: aggregate decode {decode_tokens / max(end - first, 1e-9):7.1f} t/s | "
        f"end-to-end {tokens / (end - start):7.1f} t/s | per stream {statistics.mean(per_stream):6.1f} t/s | "
        f"TTFT mean {statistics.mean(ttft):.3f} s | {tokens} tokens in {end - start:.2f} s",
        flush=True,
    )


def ttft_cached_vs_cold(args):
    system = " ".join(["You are a patient assistant who explains things step by step."] * args.system_repeat)
    msgs = [{"role": "system", "content": system}, {"role": "user", "content": "Describe a sunrise."}]
    body = {"model": args.model, "messages": msgs, "max_tokens": 16, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}}
    t0, t1, _, usage = stream(args.url, "/v1/chat/completions", body)
    print(f"turn 1 (cold): {usage['prompt_tokens']} prompt tokens, TTFT {t1 - t0:.3f} s")
    # The reply text is not needed for the prefix: a second user turn after an assistant turn.
    msgs2 = msgs + [{"role": "assistant", "content": "The sky turns orange."},
                    {"role": "user", "content": "And a sunset?"}]
    for cache in (True, False):
        b = dict(body, messages=msgs2, cache_prompt=cache)
        t0, t1, _, usage = stream(args.url, "/v1/chat/completions", b)
        cached = usage["prompt_tokens_details"]["cached_tokens"]
        label = "cached prefix" if cache else "cold (cache_prompt false)"
        print(f"turn 2, {label}: {usage['prompt_tokens']} prompt tokens, {cached} cached, TTFT {t1 - t0:.3f} s")


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--url", default="http://127.0.0.1:8080")
    p.add_argument("--model", default=None, help="model id (default: the server's first model)")
    p.add_argument("-n", "--concurrency", default="1,2,4,8")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--system-repeat", type=int, default=20, help="length of the turn-2 test's system prompt")
    p.add_argument("--no-ttft", action="store_true")
    args = p.parse_args()
    if args.model is None:
        u = urllib.parse.urlsplit(args.url)
        conn = http.client.HTTPConnection(u.hostname, u.port, timeout=30)
        conn.request("GET", "/v1/models")
        args.model = json.loads(conn.getresponse().read())["data"][0]["id"]
    print(f"server {args.url}, model {args.model}, {args.max_tokens} tokens per stream")
    # Warm-up: fault in weights and caches.
    stream(args.url, "/v1/completions", {"model": args.model, "prompt": "Hello", "max_tokens": 4, "stream": True})
    for n in [int(x) for x in args.concurrency.split(",")]:
        run_concurrent(args, n)
    if not args.no_ttft:
        ttft_cached_vs_cold(args)


if __name__ == "__main__":
    main()
