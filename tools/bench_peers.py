#!/usr/bin/env python3
"""Our runtime next to Hugging Face transformers on the same models and prompts, in one run.

    pip install -e '.[export,peers]'
    python tools/bench_peers.py engines/qwen-coder --suite code,chat --per-suite 2 --max-new-tokens 64 \\
           --drafter model --k 4 --out bench/peers-qwen

For every prompt (token ids from the bundle's tokenizer, fed identically to both):
ours plain and ours speculative (--drafter, --k), then transformers plain and transformers
speculative — assisted generation with the bundle's draft model (``assistant_model``), or
prompt lookup (``prompt_lookup_num_tokens``) for --drafter prompt-lookup — all greedy, torch on
CPU at fp32, the same GGUF/HF weights the bundle was exported from. Reports decode tok/s
(tokens after the first / time after the first; transformers' first-token time is measured
with a separate max_new_tokens=1 call), end-to-end tok/s, and whether every output is
token-identical to our plain greedy output. Ours runs first and is freed before transformers
loads, so both fit in memory on a small machine.

The benchmark environment only: torch and transformers are never imported by the runtime.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import sys
import time
from pathlib import Path

from specedge.runtime import SamplingParams, SpecDecoder
from specedge.runtime.bench import suite_prompts
from specedge.runtime.bench.runner import machine_info


def say(s: str) -> None:
    print(s, file=sys.stderr, flush=True)


def run_ours(bundle: str, prompts, drafter: str, k: int, max_new: int):
    dec = SpecDecoder.load(bundle, verify="size")
    params = SamplingParams(max_new_tokens=max_new)
    ids = [dec.encode_prompt(*p.as_request()) for p in prompts]
    dec.generate("Hello", SamplingParams(max_new_tokens=8), drafter=drafter, k=k)  # warm-up
    out = []
    for p, prompt_ids in zip(prompts, ids):
        text, chat = p.as_request()
        row = {"id": p.id, "prompt_tokens": len(prompt_ids)}
        for name, d, kk in (("ours_plain", "none", 0), ("ours_spec", drafter, k)):
            r = dec.generate(text, params, drafter=d, k=kk, chat=chat)
            s = r.stats
            row[name] = {"decode_tok_s": s.decode_tok_s, "e2e_tok_s": s.new_tokens / (s.ttft_s + s.decode_s),
                         "ttft_s": s.ttft_s, "new_tokens": s.new_tokens, "acceptance": s.acceptance_rate,
                         "ids": r.token_ids}
            say(f"{p.id} {name}: {s.decode_tok_s:.2f} tok/s, {s.new_tokens} tokens")
        out.append(row)
    manifest = dec.manifest
    dec.close()
    del dec
    gc.collect()
    return ids, out, manifest


def load_hf(entry):
    import torch
    from transformers import AutoModelForCausalLM

    src = Path(entry.source["path"])
    kw = {"gguf_file": src.name} if src.suffix == ".gguf" else {}
    model = AutoModelForCausalLM.from_pretrained(src.parent if src.suffix == ".gguf" else src,
                                                 torch_dtype=torch.float32, **kw).eval()
    return model


def hf_generate(model, ids: list[int], max_new: int, eos: list[int], **kw) -> tuple[list[int], float]:
    import torch

    x = torch.tensor([ids])
    t0 = time.perf_counter()
    with torch.inference_mode():
        y = model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=max_new, do_sample=False,
                           eos_token_id=eos, pad_token_id=eos[0], **kw)
    dt = time.perf_counter() - t0
    return y[0, len(ids):].tolist(), dt


def run_hf(manifest, prompts, ids_list, rows, drafter: str, k: int, max_new: int) -> dict:
    import torch
    import transformers

    torch.set_num_threads(os.cpu_count() or 1)
    say("loading transformers models …")
    target = load_hf(manifest.target)
    spec_kw: dict = {}
    if drafter == "model":
        assistant = load_hf(manifest.draft)
        assistant.generation_config.num_assistant_tokens = k
        assistant.generation_config.num_assistant_tokens_schedule = "constant"
        spec_kw = {"assistant_model": assistant}
    elif drafter == "prompt-lookup":
        spec_kw = {"prompt_lookup_num_tokens": k}
    eos = list(manifest.tokenizer.eos_ids)
    hf_generate(target, ids_list[0][:8], 4, eos)  # warm-up
    for p, ids, row in zip(prompts, ids_list, rows):
        _, ttft = hf_generate(target, ids, 1, eos)
        for name, kw in (("hf_plain", {}), ("hf_spec", spec_kw)):
            out, dt = hf_generate(target, ids, max_new, eos, **kw)
            n = len(out)
            row[name] = {"decode_tok_s": (n - 1) / (dt - ttft) if n > 1 and dt > ttft else 0.0,
                         "e2e_tok_s": n / dt, "ttft_s": ttft, "new_tokens": n, "ids": out}
            say(f"{p.id} {name}: {row[name]['decode_tok_s']:.2f} tok/s, {n} tokens")
    return {"transformers": transformers.__version__, "torch": torch.__version__,
            "hf_spec": "assisted generation, constant num_assistant_tokens=k" if drafter == "model"
            else f"prompt_lookup_num_tokens={k}"}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("bundle")
    ap.add_argument("--suite", default="code,chat")
    ap.add_argument("--per-suite", type=int, default=2)
    ap.add_argument("--drafter", default="model", choices=["model", "prompt-lookup"])
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--out", default="bench/peers")
    a = ap.parse_args()
    prompts = suite_prompts(a.suite.split(","), a.per_suite)
    machine = machine_info()
    ids_list, rows, manifest = run_ours(a.bundle, prompts, a.drafter, a.k, a.max_new_tokens)
    versions = run_hf(manifest, prompts, ids_list, rows, a.drafter, a.k, a.max_new_tokens)
    names = ("ours_plain", "ours_spec", "hf_plain", "hf_spec")
    for row in rows:
        ref = row["ours_plain"]["ids"]
        for n in names:
            row[n]["identical_to_ours_plain"] = row[n]["ids"] == ref
    med = {n: statistics.median(r[n]["decode_tok_s"] for r in rows) for n in names}
    lines = [
        f"Machine: {machine['cpu']}, {machine['cpus']} CPUs, copy bandwidth {machine['copy_bandwidth_gbs']} GB/s; "
        f"onnxruntime {machine['onnxruntime']}, transformers {versions['transformers']}, torch {versions['torch']}.",
        f"Bundle `{a.bundle}`; greedy; max_new_tokens {a.max_new_tokens}; ours: {a.drafter} k={a.k}; "
        f"transformers speculative: {versions['hf_spec']}.", "",
        "| prompt | ours plain | ours spec | HF plain | HF spec | ours plain / HF plain | ours spec / HF spec "
        "| token-identical (ours spec, HF plain, HF spec) |",
        "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        d = {n: r[n]["decode_tok_s"] for n in names}
        same = ", ".join("yes" if r[n]["identical_to_ours_plain"] else "no" for n in names[1:])
        lines.append(f"| {r['id']} | {d['ours_plain']:.2f} | {d['ours_spec']:.2f} | {d['hf_plain']:.2f} | "
                     f"{d['hf_spec']:.2f} | {d['ours_plain'] / d['hf_plain']:.2f}× | {d['ours_spec'] / d['hf_spec']:.2f}× "
                     f"| {same} |")
    lines.append(f"| **median** | {med['ours_plain']:.2f} | {med['ours_spec']:.2f} | {med['hf_plain']:.2f} | "
                 f"{med['hf_spec']:.2f} | {med['ours_plain'] / med['hf_plain']:.2f}× | "
                 f"{med['ours_spec'] / med['hf_spec']:.2f}× | |")
    md = "\n".join(lines) + "\n\nDecode tok/s: tokens after the first per second after the first token.\n"
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "peers.json").write_text(json.dumps({"machine": machine, "versions": versions, "args": vars(a),
                                                 "rows": rows}, indent=1))
    (out / "peers.md").write_text(md)
    print(md)


if __name__ == "__main__":
    main()
