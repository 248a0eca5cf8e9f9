#!/usr/bin/env python3
"""Greedy text against native llama.cpp on the same GGUF: our plain greedy tokens beside llama-server's, prompt by
prompt, from the same prompt token ids.

    python tools/llama_greedy.py BUNDLE GGUF [--suites code,edit,chat,summarize,json] [--per-suite 2]
                                             [--max-new-tokens 96] [--threads 2] [--long 2000,6000]
                                             [--transformers]

GGUF: the bundle's own source (a name `spec-export fetch` knows, or a path). Each prompt is encoded by the bundle's
tokenizer (a suite's prompts through its chat template; the text alone where the file has none) and sent to
llama-server's ``/completion`` as those token ids, with ``temperature 0`` (greedy, llama.cpp's own sampler),
``n_predict`` new tokens and ``ignore_eos`` (which gives every end-of-generation token a logit of -inf there: where
our greedy text ends, the two count as the same up to that end). llama-server's ``/tokenize`` of the prompt's text
alone is set beside our encoding of it too (a tokenizer difference is reported, not hidden). Where the two texts
part, our top-2 logit gap at that token says whether it is a near-tie (< 1: two kernels' rounding can pick either).
llama-server comes from tools/build_llama_cpp.sh (or SPECEDGE_LLAMA_BIN). ``--transformers`` sets both texts beside
transformers' greedy one from the same GGUF dequantized to fp32: which of the two engines a near-tie's parting
leaves nearer the model's own reference. Prints the CPU flags.
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
from long_context import long_prompt

from specedge.export.fetch import resolve_model
from specedge.runtime import SamplingParams, SpecDecoder
from specedge.runtime.bench.runner import machine_info
from specedge.runtime.bench.suites import BenchPrompt, suite_prompts
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


def compare(dec: SpecDecoder, ids: list[int], ours: list[int], theirs: list[int], eos: set[int], who: str,
            ours_side: bool = True) -> tuple[bool, str]:
    """Whether two greedy texts agree, and how they part: at a near-tie of our logits (ours_side: `ours` is the
    bundle's text, its top-2 gap at the parting says so) or not. A text that ends (an end-of-generation token of
    ours) where the other goes on agrees up to that end: llama-server's ignore_eos, and transformers'
    min_new_tokens, give those tokens a logit of -inf."""
    i = next((j for j in range(min(len(ours), len(theirs))) if ours[j] != theirs[j]), min(len(ours), len(theirs)))
    if ours == theirs:
        return True, "same"
    if i < len(ours) and ours[i] in eos:
        return True, f"same up to the end of text at token {i} ({who} bans it)"
    if not ours_side:
        return False, f"part at token {i}"
    gap = top2_gap(dec, ids + ours[:i])
    return False, f"part at token {i} (our top-2 gap {gap:.3f}: {'near-tie' if gap < NEAR_TIE else 'NOT a tie'})"


def transformers_greedy(gguf: str, runs: list[tuple[list[int], int]]) -> list[list[int]]:
    """transformers' greedy continuation of each (prompt ids, n) from the GGUF dequantized to fp32 (transformers'
    own GGUF reader and its model class): a reference neither engine's kernels wrote."""
    import torch
    from transformers import AutoModelForCausalLM

    path = Path(gguf)
    model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32).eval()
    out = []
    with torch.no_grad():
        for ids, n in runs:
            x = torch.tensor([ids])
            y = model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=n, min_new_tokens=n,
                               do_sample=False, pad_token_id=0)
            out.append(y[0, len(ids):].tolist())
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("bundle")
    ap.add_argument("gguf")
    ap.add_argument("--suites", default="code,edit,chat,summarize,json")
    ap.add_argument("--per-suite", type=int, default=2)
    ap.add_argument("--max-new-tokens", type=int, default=96)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--long", default="", help="also prompts of about these many tokens (comma-separated) of the "
                                                "project's sources: past a sliding window")
    ap.add_argument("--transformers", action="store_true",
                    help="also transformers' fp32 greedy text from the same GGUF (needs torch and transformers)")
    a = ap.parse_args()
    print(machine_info())
    dec = SpecDecoder.load(a.bundle)
    prompts = suite_prompts([s.strip() for s in a.suites.split(",") if s.strip()], a.per_suite)
    for n in (int(x) for x in a.long.split(",") if x):  # source code, then a line that asks for more of it
        prompts.append(BenchPrompt("long", f"long-{n}", long_prompt(dec, n) + "\n# The same module, continued:\n",
                                   raw=True))
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
    eos = set(dec.manifest.tokenizer.eos_ids)
    runs = []  # (prompt, ids, ours, llama.cpp's, tokenizer note)
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
            first = next((j for j in range(len(tok) + 1) if tok[j:j + 1] != mine[j:j + 1]), None)
            tok_note = ("" if tok == mine else f"; the text alone: llama.cpp's tokenizer gives {len(tok)} ids, ours "
                        f"{len(mine)}, first difference at {first}")
            runs.append((p, ids, ours, theirs, tok_note))
    finally:
        server.stop()
    hf = transformers_greedy(gguf, [(ids, len(ours)) for _, ids, ours, _, _ in runs]) if a.transformers else None
    same, hf_same, rows = 0, [0, 0], []
    for k, (p, ids, ours, theirs, tok_note) in enumerate(runs):
        agree, verdict = compare(dec, ids, ours, theirs, eos, "llama-server")
        same += agree
        row = f"| {p.id} | {len(ids)} | {len(ours)} | {verdict}{tok_note} |"
        if hf is not None:
            for j, other in enumerate((ours, theirs)):
                agree, verdict = compare(dec, ids, other, hf[k], eos, "transformers", ours_side=j == 0)
                hf_same[j] += agree
                row += f" {verdict} |"
        rows.append(row)
    print(f"bundle {a.bundle}, GGUF {gguf}, {a.max_new_tokens} new tokens, greedy")
    head = "| prompt | prompt tokens | new tokens | ours against llama-server |"
    if hf is not None:
        head += " ours against transformers (fp32) | llama.cpp against transformers (fp32) |"
    print(head + "\n" + "|---" * head.count(" | ") + "|---|")
    print("\n".join(rows))
    if hf is not None:
        print(f"transformers (the GGUF dequantized to fp32, greedy): the same text as ours on {hf_same[0]} of "
              f"{len(prompts)} prompts, as llama.cpp's on {hf_same[1]}")
    print(f"same greedy text on {same} of {len(prompts)} prompts")
    return 0


if __name__ == "__main__":
    sys.exit(main())
