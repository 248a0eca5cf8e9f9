#!/usr/bin/env python3
"""What a decode step costs as the context grows, and how long a long prompt takes to its first token, beside
llama.cpp's own llama-bench on the same GGUF, in one run.

    python tools/long_context.py engines/qwen32k [--depths 128,2048,4096,8192,16384,32000] [--ttft 2048,8192]
        [--llama-bin DIR --gguf FILE [--llama-depths 128,2048,8192]] [--repeats 5] [--verify]

Ours: the target's plain step (one row, one logits row) at each depth D, stepped at past_len D over the bundle's own
KV buffers, the median of ``repeats`` bursts of 3 after an untimed one; with --verify also its widest verify step.
The rows a step reads are first written with random values of the cache's type (a step's cost does not depend on
what they hold, but it does on their being in memory: rows never written are the operating system's shared zero
page, which a step would read from cache rather than from memory). TTFT: a prompt of about N tokens (the project's
own source text) decoded to its first token with drafter none, as `spec-run` would (``Stats.ttft_s``).
llama.cpp: ``llama-bench -p 0 -n 16 -d D`` (tg after D context tokens: its prefill of D tokens is not timed but takes
as long as pp D) and ``llama-bench -p N -n 0`` (prefill of N tokens), one repetition each, the same threads.
Prints the machine (CPU flags), the bundle's KV dtype and context, and a markdown table of both.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

from specedge.runtime import SamplingParams, SpecDecoder
from specedge.runtime.bench.runner import machine_info
from specedge.runtime.cpu import physical_cores
from specedge.runtime.manifest import KV_INT8_SCALE_BYTES

ROOT = Path(__file__).resolve().parents[1]


def _ints(s: str) -> list[int]:
    if s.strip().lower() == "none":
        return []
    try:
        out = [int(x) for x in s.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{s!r}: a comma-separated list of token counts, e.g. 128,2048") from None
    if not out or min(out) < 1:
        raise argparse.ArgumentTypeError(f"{s!r}: token counts are positive")
    return out


def fill_cache(dec: SpecDecoder, rows: int, seed: int = 0) -> None:
    """Writes the target's cache rows 0 .. rows-1 of slot 0, every layer and head, with random values of its type
    (an int8 row: random levels and a scale of 1/127), so those pages are the step's to read from memory."""
    kv = getattr(dec.target, "kv", None)
    if not isinstance(kv, np.ndarray):
        raise SystemExit("the target's KV cache is not host memory (a GPU runner): this tool times CPU bundles")
    rng = np.random.default_rng(seed)
    for layer in kv:
        for part in layer:
            view = part[0, :, :rows]
            if view.dtype == np.int8:
                d = view.shape[-1] - KV_INT8_SCALE_BYTES
                view[..., :d] = rng.integers(-127, 128, size=view[..., :d].shape, dtype=np.int8)
                view[..., d:] = np.full(view.shape[:-1], 1 / 127, dtype="<f4")[..., None].view(np.int8)
            else:
                view[...] = rng.standard_normal(view.shape, dtype=np.float32).astype(view.dtype)


def step_ms(dec: SpecDecoder, depth: int, width: int, repeats: int) -> float:
    """Median ms of the target's step of `width` rows at past_len `depth` (bursts of 3 after one untimed) over cache
    rows fill_cache has written."""
    t = dec.target
    ids = np.full(width, 100, dtype=np.int64)
    every = width > 1
    times = []
    for _ in range(repeats):
        for i in range(4):
            t0 = time.perf_counter()
            t.step(ids, depth, all_logits=every)
            if i:
                times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3


def long_prompt(dec: SpecDecoder, tokens: int) -> str:
    """About `tokens` tokens of text: the project's Python sources, one after another, cut at a line."""
    text, n = [], 0
    files = sorted((ROOT / "runtime").rglob("*.py")) + sorted((ROOT / "export").rglob("*.py"))
    while n < tokens:
        for f in files:
            for line in f.read_text(encoding="utf-8").splitlines(keepends=True):
                text.append(line)
                n += len(dec.encode_prompt(line, chat=False))
                if n >= tokens:
                    return "".join(text)
    return "".join(text)


def ttft_s(dec: SpecDecoder, prompt: str) -> tuple[float, int]:
    """(seconds to the first token, prompt tokens) of one plain request, nothing of it cached before."""
    r = dec.generate(prompt, SamplingParams(max_new_tokens=1, ignore_eos=True), drafter="none", chat=False,
                     reuse_prefix=False)
    return r.stats.ttft_s, len(dec.encode_prompt(prompt, chat=False))


def llama_bench(bench: Path, gguf: str, threads: int, *, depth: int = 0, pp: int = 0, tg: int = 0) -> dict:
    out = subprocess.run([str(bench), "-m", gguf, "-t", str(threads), "-p", str(pp), "-n", str(tg), "-d", str(depth),
                          "-r", "1", "-o", "json"], capture_output=True, text=True, check=True)
    return json.loads(out.stdout)[0]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("bundle")
    ap.add_argument("--depths", type=_ints, default=[128, 2048, 4096, 8192, 16384, 32000])
    ap.add_argument("--ttft", type=_ints, default=[2048, 8192], help="prompt lengths whose TTFT is measured "
                    "('none': no TTFT)")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--verify", action="store_true", help="also time the widest verify step at each depth")
    ap.add_argument("--llama-bin", type=Path, default=None, help="llama.cpp's bin directory "
                    "(tools/build_llama_cpp.sh prints it); with --gguf, llama-bench runs beside ours")
    ap.add_argument("--gguf", default=None, help="the GGUF the bundle's target came from (llama-bench's model)")
    ap.add_argument("--llama-depths", type=_ints, default=None,
                    help="depths llama-bench runs at (default: --depths up to 8192; each prefills its depth first)")
    ap.add_argument("--threads", type=int, default=None, help="threads for both (default: the physical cores)")
    a = ap.parse_args()
    if (a.llama_bin is None) != (a.gguf is None):
        ap.error("--llama-bin and --gguf go together (llama-bench needs both)")
    threads = a.threads or physical_cores()
    dec = SpecDecoder.load(a.bundle, threads=threads)
    m = dec.manifest
    over = [d for d in a.depths + a.ttft if d + m.k + 1 > m.max_context]
    if over:
        ap.error(f"{over} do not fit the bundle's context S_max={m.max_context} (export with --max-context)")
    info = machine_info()
    print(f"Machine: {info['cpu']} ({info.get('cpu_flags', '')}), {info['cpus']} CPUs, {threads} threads; "
          f"onnxruntime {info['onnxruntime']}")
    print(f"Bundle: {a.bundle}: KV {m.kv_dtype}, S_max {m.max_context}, kv_mode {m.kv_mode}, K={m.k}")
    bench = a.llama_bin / "llama-bench" if a.llama_bin else None
    llama_depths = a.llama_depths or [d for d in a.depths if d <= 8192]
    verify_w = m.k + 1
    ours = {}
    fill_cache(dec, max(a.depths) + verify_w)
    for d in a.depths:
        ours[d] = (step_ms(dec, d, 1, a.repeats), step_ms(dec, d, verify_w, a.repeats) if a.verify else None)
        print(f"  ours: depth {d}: step {ours[d][0]:.1f} ms", file=sys.stderr, flush=True)
    peer = {}
    for d in llama_depths if bench else []:
        r = llama_bench(bench, a.gguf, threads, depth=d, tg=16)
        peer[d] = 1e3 / r["avg_ts"]
        print(f"  llama-bench: depth {d}: tg {r['avg_ts']:.2f} tok/s", file=sys.stderr, flush=True)
    if not a.depths:
        ap.error("--depths: at least one depth")
    base, pbase = ours[a.depths[0]][0], peer.get(a.depths[0])
    print(f"\n| depth | ours: step ms | vs depth {a.depths[0]} |"
          + (f" ours: verify T={verify_w} ms |" if a.verify else "")
          + (f" llama-bench tg ms | vs depth {a.depths[0]} | ours / llama.cpp (speed) |" if bench else ""))
    print("|---|---|---|" + ("---|" if a.verify else "") + ("---|---|---|" if bench else ""))
    for d in a.depths:
        row = f"| {d} | {ours[d][0]:.1f} | {ours[d][0] / base:.2f}× |"
        if a.verify:
            row += f" {ours[d][1]:.1f} |"
        if bench:
            p = peer.get(d)
            row += (f" {p:.1f} | {p / pbase:.2f}× | {p / ours[d][0]:.2f}× |" if p and pbase else " – | – | – |")
        print(row)
    if a.ttft:
        print("\n| prompt tokens | ours: TTFT s |"
              + (" llama-bench pp s | ours / llama.cpp (speed) |" if bench else ""))
        print("|---|---|" + ("---|---|" if bench else ""))
    for n in a.ttft:
        s, got = ttft_s(dec, long_prompt(dec, n))
        row = f"| {got} | {s:.3f} |"
        if bench:
            r = llama_bench(bench, a.gguf, threads, pp=got)
            row += f" {r['avg_ns'] / 1e9:.2f} | {r['avg_ns'] / 1e9 / s:.2f}× |"
        print(row, flush=True)
    dec.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
