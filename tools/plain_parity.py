#!/usr/bin/env python3
"""Our plain decoding against native llama.cpp's llama-bench, interleaved over several rounds (one number per
engine per round, medians at the end): the plain-parity check of issue 16 with the VM's noise averaged out.

    python tools/plain_parity.py BUNDLE GGUF [--rounds 3] [--max-new-tokens 96] [--threads 2]

Per round: ``llama-bench -p 0 -n N -t T -r 2`` on the GGUF (tg N, no prompt: llama.cpp's own speed figure), then our
plain greedy decode (drafter none, so rounds carry only the free guess) of each suite's first prompt, fresh
(no prefix reuse); ours is the median decode tok/s over the prompts. llama-bench comes from
tools/build_llama_cpp.sh (``--llama-bench`` to point elsewhere). Prints the CPU flags first.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
from pathlib import Path

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
    ours, llama = [], []
    for r in range(a.rounds):
        out = subprocess.run([a.llama_bench, "-m", a.gguf, "-p", "0", "-n", str(a.max_new_tokens), "-t",
                              str(a.threads), "-r", "2", "-o", "json"], capture_output=True, text=True, check=True)
        llama.append(json.loads(out.stdout)[0]["avg_ts"])
        per = []
        for p in prompts:
            text, chat = p.as_request()
            per.append(dec.generate(text, params, drafter="none", chat=chat, reuse_prefix=False).stats.decode_tok_s)
        ours.append(statistics.median(per))
        print(f"round {r}: llama-bench tg{a.max_new_tokens} {llama[-1]:.2f} tok/s | ours plain, median of "
              f"{len(per)} prompts {ours[-1]:.2f} ({', '.join(f'{x:.1f}' for x in per)})", flush=True)
    lo, ou = statistics.median(llama), statistics.median(ours)
    print(f"median over rounds: llama.cpp {lo:.2f}, ours {ou:.2f} tok/s: ours / llama.cpp {ou / lo:.2f}x")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
