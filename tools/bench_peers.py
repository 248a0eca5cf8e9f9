#!/usr/bin/env python3
"""Our runtime next to other engines on the same models and prompts, in one run.

    pip install -e '.[export,peers]'                      # transformers + torch (CPU)
    pip install llama-cpp-python                           # llama.cpp (builds from source)
    python tools/bench_peers.py engines/qwen-coder --peers hf --spec model:4 --suite code,chat
    python tools/bench_peers.py engines/qwen-int4 --peers llamacpp --spec model:4,prompt-lookup:8

Every engine gets the same prompt token ids (from the bundle's tokenizer and chat template) and
decodes greedily from the weights the bundle was exported from (its GGUF or HF directory).

* ours: plain (drafter none) and each ``--spec drafter:k``.
* hf (transformers, torch CPU, fp32): plain; assisted generation with the bundle's draft model
  (``assistant_model``, constant ``num_assistant_tokens`` = k) for ``model:k``; prompt lookup
  (``prompt_lookup_num_tokens`` = k) for ``prompt-lookup:k``.
* llamacpp (llama-cpp-python, the GGUF as is): plain, and prompt lookup
  (``LlamaPromptLookupDecoding(num_pred_tokens=k)``) for ``prompt-lookup:k``; llama-cpp-python has
  no two-model speculation, so ``model:k`` has no llama.cpp counterpart here.

Decode tok/s = tokens after the first / time after the first token (HF: first-token time from a
separate max_new_tokens=1 call). Every output is compared with our plain greedy output. Engines
run one after another in this process, each freed before the next loads.
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


def _record(rows: list[dict], i: int, name: str, ids: list[int], ttft: float, total: float) -> None:
    n = len(ids)
    rows[i][name] = {"decode_tok_s": (n - 1) / (total - ttft) if n > 1 and total > ttft else 0.0,
                     "e2e_tok_s": n / total if total else 0.0, "ttft_s": ttft, "new_tokens": n, "ids": ids}
    say(f"{rows[i]['id']} {name}: {rows[i][name]['decode_tok_s']:.2f} tok/s, {n} tokens")


def run_ours(bundle: str, prompts, specs, max_new: int, rows: list[dict]):
    dec = SpecDecoder.load(bundle, verify="size")
    params = SamplingParams(max_new_tokens=max_new)
    dec.generate("Hello", SamplingParams(max_new_tokens=8))  # warm-up
    ids_list = []
    for i, p in enumerate(prompts):
        text, chat = p.as_request()
        ids_list.append(dec.encode_prompt(text, chat))
        rows.append({"id": p.id, "prompt_tokens": len(ids_list[-1])})
        for drafter, k in [("none", 0), *specs]:
            r = dec.generate(text, params, drafter=drafter, k=k, chat=chat)
            _record(rows, i, "ours plain" if drafter == "none" else f"ours {drafter}:{k}", r.token_ids,
                    r.stats.ttft_s, r.stats.ttft_s + r.stats.decode_s)
    manifest = dec.manifest
    dec.close()
    del dec
    gc.collect()
    return ids_list, manifest


def run_hf(manifest, ids_list, specs, max_new: int, rows: list[dict]) -> dict:
    import torch
    import transformers
    from transformers import AutoModelForCausalLM

    def load(entry):
        src = Path(entry.source["path"])
        if src.suffix == ".gguf":
            return AutoModelForCausalLM.from_pretrained(src.parent, gguf_file=src.name, torch_dtype=torch.float32).eval()
        return AutoModelForCausalLM.from_pretrained(src, torch_dtype=torch.float32).eval()

    torch.set_num_threads(os.cpu_count() or 1)
    say("transformers: loading …")
    target = load(manifest.target)
    assistant = load(manifest.draft) if manifest.draft is not None and any(d == "model" for d, _ in specs) else None
    eos = list(manifest.tokenizer.eos_ids)

    def gen(ids, n, **kw):
        x = torch.tensor([ids])
        t0 = time.perf_counter()
        with torch.inference_mode():
            y = target.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=n, do_sample=False,
                                eos_token_id=eos, pad_token_id=eos[0], **kw)
        return y[0, len(ids):].tolist(), time.perf_counter() - t0

    gen(ids_list[0][:8], 4)  # warm-up
    for i, ids in enumerate(ids_list):
        _, ttft = gen(ids, 1)
        out, dt = gen(ids, max_new)
        _record(rows, i, "hf plain", out, ttft, dt)
        for drafter, k in specs:
            if drafter == "model" and assistant is not None:
                assistant.generation_config.num_assistant_tokens = k
                assistant.generation_config.num_assistant_tokens_schedule = "constant"
                out, dt = gen(ids, max_new, assistant_model=assistant)
            elif drafter == "prompt-lookup":
                out, dt = gen(ids, max_new, prompt_lookup_num_tokens=k)
            else:
                continue
            _record(rows, i, f"hf {drafter}:{k}", out, ttft, dt)
    return {"transformers": transformers.__version__, "torch": torch.__version__}


def run_llamacpp(manifest, ids_list, specs, max_new: int, rows: list[dict]) -> dict:
    import llama_cpp
    from llama_cpp import Llama
    from llama_cpp.llama_speculative import LlamaPromptLookupDecoding

    path = manifest.target.source["path"]
    eos = set(manifest.tokenizer.eos_ids)
    threads = os.cpu_count() or 1
    configs = [("plain", None)] + [(f"{d}:{k}", k) for d, k in specs if d == "prompt-lookup"]
    for name, k in configs:
        say(f"llama.cpp {name}: loading {path} …")
        llm = Llama(model_path=path, n_ctx=manifest.max_context, n_threads=threads, n_threads_batch=threads,
                    n_batch=512, verbose=False,
                    draft_model=LlamaPromptLookupDecoding(num_pred_tokens=k) if k else None)
        for i, ids in enumerate(list(ids_list[:1]) + list(ids_list)):  # the first pass is a warm-up
            out: list[int] = []
            t0 = time.perf_counter()
            ttft = 0.0
            for tok in llm.generate(ids, top_k=1, top_p=1.0, temp=0.0, repeat_penalty=1.0, reset=True):
                if not out:
                    ttft = time.perf_counter() - t0
                if tok in eos:
                    break
                out.append(tok)
                if len(out) >= max_new:
                    break
            if i > 0:
                _record(rows, i - 1, f"llama.cpp {name}", out, ttft, time.perf_counter() - t0)
        del llm
        gc.collect()
    return {"llama_cpp_python": llama_cpp.__version__}


def parse_specs(s: str) -> list[tuple[str, int]]:
    out = []
    for item in filter(None, s.split(",")):
        d, _, k = item.partition(":")
        if d not in ("model", "prompt-lookup") or not k.isdigit():
            raise SystemExit(f"--spec items are drafter:k with drafter model or prompt-lookup, got {item!r}")
        out.append((d, int(k)))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("bundle")
    ap.add_argument("--peers", default="hf", help="comma list of hf, llamacpp")
    ap.add_argument("--spec", default="model:4", help="our (and the peers') speculative configs, drafter:k,...")
    ap.add_argument("--suite", default="code,chat")
    ap.add_argument("--per-suite", type=int, default=2)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--out", default="bench/peers")
    a = ap.parse_args()
    specs = parse_specs(a.spec)
    prompts = suite_prompts(a.suite.split(","), a.per_suite)
    machine = machine_info()
    rows: list[dict] = []
    ids_list, manifest = run_ours(a.bundle, prompts, specs, a.max_new_tokens, rows)
    versions = {}
    for peer in a.peers.split(","):
        versions.update({"hf": run_hf, "llamacpp": run_llamacpp}[peer](manifest, ids_list, specs, a.max_new_tokens, rows))
    names = [k for k in rows[0] if isinstance(rows[0][k], dict)]
    for row in rows:
        for n in names:
            row[n]["identical_to_ours_plain"] = row[n]["ids"] == row["ours plain"]["ids"]
    med = {n: statistics.median(r[n]["decode_tok_s"] for r in rows) for n in names}
    t = manifest.target
    lines = [
        f"Machine: {machine['cpu']}, {machine['cpus']} CPUs, copy bandwidth {machine['copy_bandwidth_gbs']} GB/s; "
        f"onnxruntime {machine['onnxruntime']}; " + ", ".join(f"{k} {v}" for k, v in versions.items()) + ".",
        f"Bundle `{a.bundle}` (target {t.precision}, kv_mode {manifest.kv_mode}); source "
        f"`{Path(t.source.get('path', '')).name}`; greedy; max_new_tokens {a.max_new_tokens}; "
        f"prompts {', '.join(r['id'] for r in rows)}.", "",
        "| engine / config | decode tok/s, median (per prompt) | vs ours plain | vs the same engine's plain "
        "| output identical to ours plain |", "|---|---|---|---|---|"]
    for n in names:
        engine = n.rsplit(" ", 1)[0]
        base = med.get(f"{engine} plain", float("nan"))
        same = sum(r[n]["identical_to_ours_plain"] for r in rows)
        per_prompt = ", ".join(f"{r[n]['decode_tok_s']:.1f}" for r in rows)
        lines.append(f"| {n} | **{med[n]:.2f}** ({per_prompt}) | "
                     f"{med[n] / med['ours plain']:.2f}× | {med[n] / base:.2f}× | {same}/{len(rows)} |")
    md = "\n".join(lines) + "\n"
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "peers.json").write_text(json.dumps({"machine": machine, "versions": versions, "args": vars(a),
                                                 "rows": rows}, indent=1))
    (out / "peers.md").write_text(md)
    print(md)


if __name__ == "__main__":
    main()
