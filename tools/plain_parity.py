#!/usr/bin/env python3
"""Our plain decoding against native llama.cpp's llama-bench, interleaved over several rounds (one number per
engine per round, medians at the end): plain decoding against the native peer with a shared machine's noise averaged
out.

    python tools/plain_parity.py BUNDLE GGUF [--rounds 3] [--max-new-tokens 96] [--threads 2]

Per round and prompt (each suite's first), side by side, the order swapped every prompt: ``llama-bench -p 0 -n N -d D
-t T -r 1`` on the GGUF (tg N after D context tokens, D = the prompt's length: llama.cpp's own speed figure at that
depth) and our plain greedy decode of the prompt, fresh (no prefix reuse). Each engine's round figure is its median
over the prompts; the ratio is also given as the median of the per-prompt ratios, the figure least moved by this
VM's drift (a quarter within minutes: engines timed in blocks minutes apart measure the drift). llama-bench comes
from tools/build_llama_cpp.sh (``--llama-bench`` to point elsewhere). Prints the CPU flags first.
"""

from __future__ import annotations

import argparse
import statistics
from pathlib import Path

from bench_peers import llama_bench_tg  # tools/ is this script's directory

from specedge.runtime import SamplingParams, SpecDecoder
from specedge.runtime.bench.runner import machine_info
from specedge.runtime.bench.suites import suite_prompts

DEFAULT_BENCH = Path.home() / ".cache/specedge/llama.cpp/0.3.36/build/bin/llama-bench"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("bundle")
    ap.add_argument("gguf")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--max-new-tokens", type=int, default=96)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--llama-bench", default=str(DEFAULT_BENCH))
    a = ap.parse_args()
    if not Path(a.llama_bench).is_file():
        raise SystemExit(f"llama-bench not found at {a.llama_bench}: build it with tools/build_llama_cpp.sh")
    m = machine_info()
    print(f"Machine: {m['cpu']} ({m['cpu_flags']}), {m['cpus']} CPUs; onnxruntime {m['onnxruntime']}; "
          f"bundle {a.bundle}; {a.threads} threads each; tg{a.max_new_tokens}")
    dec = SpecDecoder.load(a.bundle, threads=a.threads)
    prompts = suite_prompts(["code", "edit", "chat", "summarize", "json"], 1)
    params = SamplingParams(max_new_tokens=a.max_new_tokens)
    dec.generate("warm up", SamplingParams(max_new_tokens=8), drafter="none")
    ours, llama, ratios = [], [], []
    for r in range(a.rounds):
        per_o, per_l = [], []
        for i, p in enumerate(prompts):
            text, chat = p.as_request(bool(dec.manifest.tokenizer.chat_template))
            depth = len(dec.encode_prompt(text, chat))
            for engine in (("ours", "llama") if (i + r) % 2 == 0 else ("llama", "ours")):
                if engine == "llama":
                    per_l.append(llama_bench_tg(a.llama_bench, a.gguf, a.max_new_tokens, depth, a.threads))
                else:
                    per_o.append(dec.generate(text, params, drafter="none", chat=chat,
                                              reuse_prefix=False).stats.decode_tok_s)
            ratios.append(per_o[-1] / per_l[-1])
        ours.append(statistics.median(per_o))
        llama.append(statistics.median(per_l))
        print(f"round {r}: llama-bench tg{a.max_new_tokens} at each prompt's depth {llama[-1]:.2f} tok/s "
              f"({', '.join(f'{x:.1f}' for x in per_l)}) | ours plain {ours[-1]:.2f} "
              f"({', '.join(f'{x:.1f}' for x in per_o)})", flush=True)
    lo, ou = statistics.median(llama), statistics.median(ours)
    print(f"median over rounds: llama.cpp {lo:.2f}, ours {ou:.2f} tok/s: ours / llama.cpp {ou / lo:.2f}x; "
          f"median of the {len(ratios)} per-prompt ratios {statistics.median(ratios):.2f}x "
          f"({min(ratios):.2f}-{max(ratios):.2f})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
