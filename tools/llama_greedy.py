#!/usr/bin/env python3
"""Greedy text against native llama.cpp on the same GGUF: our plain greedy tokens beside llama-server's, prompt by
prompt, from the same prompt token ids.

    python tools/llama_greedy.py BUNDLE GGUF [--suites code,edit,chat,summarize,json] [--per-suite 2]
                                             [--max-new-tokens 96] [--threads 2]

GGUF: the bundle's own source (a name `spec-export fetch` knows, or a path). Each prompt is encoded by the bundle's
tokenizer (a suite's prompts through its chat template; the text alone where the file has none) and sent to
llama-server's ``/completion`` as those token ids, with ``temperature 0`` (greedy, llama.cpp's own sampler),
``n_predict`` new tokens and ``ignore_eos`` (which gives every end-of-generation token a logit of -inf there: where
our greedy text ends, the two count as the same up to that end). llama-server's ``/tokenize`` of the prompt's text
alone is set beside our encoding of it too (a tokenizer difference is reported, not hidden). Where the two texts
part, our top-2 logit gap at that token says whether it is a near-tie (< 1: two kernels' rounding can pick either).
llama-server comes from tools/build_llama_cpp.sh (or SPECEDGE_LLAMA_BIN). Prints the CPU flags.
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np
from bench_concurrency import ServerProcess, free_port  # tools/ is this script's directory

from specedge.export.fetch import resolve_model
from specedge.runtime import SamplingParams, SpecDecoder
from specedge.runtime.bench.runner import machine_info
from specedge.runtime.bench.suites import suite_prompts
from specedge.runtime.drafters import feed

NEAR_TIE = 1.0


def post(port: int, path: str, body: dict) -> dict:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=900)
    conn.request("POST", path, json.dumps(body), {"Content-Type": "application/json"})
    resp = conn.getresponse()
    data = resp.read()
    if resp.status != 200:
        raise RuntimeError(f"{path}: HTTP {resp.status}: {data[:300]!r}")
    return json.loads(data)


def top2_gap(dec: SpecDecoder, ids: list[int]) -> float:
    logits = feed(dec.target, np.array(ids), 0, dec.manifest.prefill_chunk)
    a, b = np.sort(np.asarray(logits, np.float64))[-2:]
    return float(b - a)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("bundle")
    ap.add_argument("gguf")
    ap.add_argument("--suites", default="code,edit,chat,summarize,json")
    ap.add_argument("--per-suite", type=int, default=2)
    ap.add_argument("--max-new-tokens", type=int, default=96)
    ap.add_argument("--threads", type=int, default=2)
    a = ap.parse_args()
    print(machine_info())
    dec = SpecDecoder.load(a.bundle)
    prompts = suite_prompts([s.strip() for s in a.suites.split(",")], a.per_suite)
    bin_dir = Path(os.environ.get("SPECEDGE_LLAMA_BIN") or subprocess.run(
        ["bash", str(Path(__file__).with_name("build_llama_cpp.sh"))], check=True, capture_output=True,
        text=True).stdout.strip())
    gguf = str(resolve_model(a.gguf))
    port = free_port()
    ctx = dec.manifest.max_context
    log = Path(tempfile.mkdtemp()) / "llama-server.log"
    server = ServerProcess([str(bin_dir / "llama-server"), "-m", gguf, "--port", str(port), "--host", "127.0.0.1",
                            "-t", str(a.threads), "-tb", str(a.threads), "-np", "1", "-c", str(ctx), "--no-webui"],
                           port, "llama-server", log)
    same = 0
    rows = []
    eos = set(dec.manifest.tokenizer.eos_ids)
    try:
        for p in prompts:
            prompt, chat = p.as_request(bool(dec.manifest.tokenizer.chat_template))
            text = p.as_request(False)[0]
            ids = dec.encode_prompt(prompt, chat=chat)
            n = min(a.max_new_tokens, ctx - len(ids) - 1)
            ours = dec.generate(prompt, SamplingParams(max_new_tokens=n, ignore_eos=True), drafter="none",
                                chat=chat).token_ids
            theirs = post(port, "/completion", {"prompt": ids, "n_predict": n, "temperature": 0, "top_k": 1,
                                                "ignore_eos": True, "cache_prompt": False,
                                                "return_tokens": True})["tokens"]
            tok = post(port, "/tokenize", {"content": text, "add_special": True})["tokens"]
            mine = dec.encode_prompt(text, chat=False)
            i = next((j for j in range(min(len(ours), len(theirs))) if ours[j] != theirs[j]),
                     min(len(ours), len(theirs)))
            if ours == theirs:
                same += 1
                verdict = "same"
            elif i < len(ours) and ours[i] in eos:
                # llama-server's ignore_eos bans every end-of-generation token (its logit -inf), so where ours is
                # the greedy choice, llama.cpp takes the runner-up: the answers agree up to their end
                same += 1
                verdict = f"same up to our end of text at token {i} (ignore_eos bans it in llama-server)"
            else:
                gap = top2_gap(dec, ids + ours[:i])
                kind = "near-tie" if gap < NEAR_TIE else "NOT a tie"
                verdict = f"part at token {i} (our top-2 gap {gap:.3f}: {kind})"
            first = next((j for j in range(len(tok) + 1) if tok[j:j + 1] != mine[j:j + 1]), None)
            tok_note = ("" if tok == mine else f"; the text alone: llama.cpp's tokenizer gives {len(tok)} ids, ours "
                        f"{len(mine)}, first difference at {first}")
            rows.append(f"| {p.id} | {len(ids)} | {len(ours)} | {verdict}{tok_note} |")
    finally:
        server.stop()
    print(f"bundle {a.bundle}, GGUF {gguf}, {a.max_new_tokens} new tokens, greedy")
    print("| prompt | prompt tokens | new tokens | ours against llama-server |\n|---|---|---|---|")
    print("\n".join(rows))
    print(f"same greedy text on {same} of {len(prompts)} prompts")
    return 0


if __name__ == "__main__":
    sys.exit(main())
