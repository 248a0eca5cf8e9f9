"""The measurement loop: every configuration on the same prompt back to back, plain included.

Order: one warm-up generation per drafter, then for each prompt, repeat and temperature the
plain baseline followed by every speculative configuration — interleaved, so slow drifts of
the machine (thermal, other load) hit baseline and speculation alike. Nothing here is timed
that the decoder's own :class:`Stats` do not time; this module only orders and records.
"""

from __future__ import annotations

import os
import platform
import resource
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable

import numpy as np

from ..cpu import cpu_flags, cpu_name
from ..decoder import SpecDecoder
from ..errors import ContextLengthError, PromptError, SamplingParamsError
from ..manifest import Manifest, kv_row_bytes
from ..request import check_fits
from ..sampling import SamplingParams
from ..text import TextCodec
from ..step_costs import cost_depth
from .suites import BenchPrompt, suite_prompts

DRAFTERS = ("model", "prompt-lookup", "none", "auto", "hybrid")  # auto/hybrid run once, at the bundle's K


@dataclass(frozen=True)
class BenchPlan:
    suites: tuple[str, ...] = ("code", "edit", "chat", "summarize", "json")
    ks: tuple[int, ...] = (2, 4, 6, 8)  # k larger than the bundle's K is dropped (and reported)
    drafters: tuple[str, ...] = ("model", "prompt-lookup", "none")
    temperatures: tuple[float, ...] = (0.0,)
    repeats: int = 1
    max_new_tokens: int = 128
    per_suite: int = 0  # 0: every prompt of each suite
    ignore_eos: bool = False  # True: always generate max_new_tokens (same length for every config)
    seed: int = 0  # sampled runs use seed + repeat, the same for plain and speculative
    prompts: tuple[BenchPrompt, ...] = field(default=())  # if given, used instead of the suites
    # tree branch rows for every drafter but plain (None: each one's default; 0: chains), one config each
    trees: tuple[int | None, ...] = (None,)

    def __post_init__(self) -> None:
        bad = [d for d in self.drafters if d not in DRAFTERS]
        if bad:
            raise SamplingParamsError(f"unknown drafter(s) {bad}; choose from {list(DRAFTERS)}")
        if self.repeats < 1 or self.max_new_tokens < 2:
            raise SamplingParamsError("repeats must be >= 1 and max_new_tokens >= 2")
        if any(k < 1 for k in self.ks):
            raise SamplingParamsError(f"k values must be >= 1, got {list(self.ks)}")
        if self.per_suite < 0:
            raise SamplingParamsError(f"per_suite must be >= 0 (0: every prompt of each suite), got {self.per_suite}")
        for name, values in (("suites", self.suites), ("ks", self.ks), ("drafters", self.drafters),
                             ("temperatures", self.temperatures)):
            if not values and (name != "suites" or not self.prompts):
                raise SamplingParamsError(f"{name} is empty: give at least one")
        from ..trees import TREE_BRANCHES_MAX

        if not self.trees or any(t is not None and not 0 <= t <= TREE_BRANCHES_MAX for t in self.trees):
            raise SamplingParamsError(f"trees must be branch rows in 0..{TREE_BRANCHES_MAX}, got {list(self.trees)}")
        for t in self.temperatures:  # refused here, not at the first prompt after the models are loaded and timed
            SamplingParams(max_new_tokens=self.max_new_tokens, temperature=t)

    def prompt_list(self) -> list[BenchPrompt]:
        return list(self.prompts) if self.prompts else suite_prompts(self.suites, self.per_suite)

    def configs(self, dec: SpecDecoder) -> list[tuple[str, int, int | None]]:
        """[(drafter, k, tree)] runnable on this bundle; plain ("none", 0, None) first. Every tree of ``trees`` for
        every drafter but plain (``trees`` default to (None,): each drafter's own choice)."""
        K = dec.manifest.k
        drafters = [d for d in self.drafters if d != "none" and (d != "model" or dec.draft_runner is not None)]
        trees = list(dict.fromkeys(self.trees))
        return [("none", 0, None)] + [(d, k, t) for d in drafters if d in ("model", "prompt-lookup")
                                      for k in sorted(set(self.ks)) if k <= K
                                      for t in trees] + \
            [(d, K, t) for d in drafters if d in ("auto", "hybrid") for t in trees]


def config_name(drafter: str, tree: int | None) -> str:
    """A configuration's name in the results: the drafter, with the tree it was asked for ("auto:tree0")."""
    return drafter if tree is None else f"{drafter}:tree{tree}"


def mem_total_gb() -> float:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemTotal:"):
                    return int(line.split()[1]) / 1024 ** 2
    except OSError:
        pass
    return float("nan")


def copy_bandwidth_gbs(mb: int = 512) -> float:
    """Best of 3 large copies, bytes read + written per second: the ceiling decode runs against.

    Runs in a child process where fork exists, so its 2 x ``mb`` buffers never count in this
    process's peak RSS (which the benchmark reports)."""
    import multiprocessing as mp

    if "fork" in mp.get_all_start_methods():
        with mp.get_context("fork").Pool(1) as pool:
            return pool.apply(_copy_bandwidth_gbs, (mb,))
    return _copy_bandwidth_gbs(mb)


def _copy_bandwidth_gbs(mb: int) -> float:
    src = np.ones(mb * 1024 * 1024 // 8)
    dst = np.empty_like(src)
    best = 0.0
    for _ in range(3):
        t0 = time.perf_counter()
        np.copyto(dst, src)
        best = max(best, 2 * src.nbytes / (time.perf_counter() - t0) / 1e9)
    return best


def peak_rss_mb() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return r / 1024 ** 2 if sys.platform == "darwin" else r / 1024


def machine_info() -> dict[str, Any]:
    import onnxruntime

    from .. import __version__

    return {"cpu": cpu_name(), "cpu_flags": cpu_flags(), "cpus": os.cpu_count(), "memory_gb": round(mem_total_gb(), 1),
            "copy_bandwidth_gbs": round(copy_bandwidth_gbs(), 1), "platform": platform.platform(),
            "python": platform.python_version(), "numpy": np.__version__, "onnxruntime": onnxruntime.__version__,
            "specedge": __version__}


def bundle_info(dec: SpecDecoder) -> dict[str, Any]:
    m = dec.manifest
    models = {}
    for role, e in (("target", m.target), ("draft", m.draft)):
        if e is None:
            continue
        d = e.dims
        kv_bytes = d.n_layers * 2 * d.n_kv_heads * m.max_context * kv_row_bytes(d.head_dim, m.kv_dtype)
        models[role] = {"family": e.family, "layers": d.n_layers, "hidden": d.hidden, "vocab": d.vocab,
                        "precision": e.precision,
                        # a self draft's weights and cache are the target's: nothing of its own
                        "weights_bytes": 0 if e.is_self else m.files.get(e.weights, {}).get("bytes", 0),
                        "kv_bytes": 0 if e.is_self else kv_bytes, "widths": [w.T for w in e.widths],
                        "self_layers": list(e.layers),
                        "source": str(e.source.get("path", "")) if isinstance(e.source, dict) else ""}
    return {"path": str(dec.bundle_dir), "backend": dec.backend, "precision": dec.precision, "K": m.k, "max_context": m.max_context,
            "prefill_chunk": m.prefill_chunk, "kv_mode": m.kv_mode, "drafter": m.drafter, "models": models}


def check_prompts(prompts: list[BenchPrompt], manifest: Manifest, codec: TextCodec, max_new_tokens: int) -> None:
    """Every prompt encodes (roles, chat template, text) and fits the bundle's context with ``max_new_tokens``;
    the error names the prompt's file and line (or suite)."""
    params = SamplingParams(max_new_tokens=max_new_tokens)
    for bp in prompts:
        prompt, chat = bp.as_request(bool(manifest.tokenizer.chat_template))
        try:
            check_fits(manifest, len(codec.encode_prompt(prompt, chat)), params)
        except (PromptError, ContextLengthError) as e:
            raise type(e)(f"{bp.origin()}: {e}") from None


def check_bundle_prompts(bundle: str | Path, plan: BenchPlan) -> None:
    """:func:`check_prompts` with the bundle's manifest and tokenizer only: no model is loaded."""
    from ..manifest import read_manifest

    m = read_manifest(bundle, verify="none")
    check_prompts(plan.prompt_list(), m, TextCodec(Path(bundle), m.tokenizer), plan.max_new_tokens)


def run_bench(dec: SpecDecoder, plan: BenchPlan,
              progress: Callable[[str], None] = lambda s: print(s, file=sys.stderr, flush=True),
              on_run: Callable[[dict[str, Any]], None] | None = None) -> dict[str, Any]:
    """Run the plan; return the raw results (JSON-able): meta, step costs and one record per generation.
    ``on_run(raw)`` is called after each generation with the results so far (``"complete": False``), e.g. to save
    them (:func:`~specedge.runtime.bench.report.write_results`) so that an interruption keeps what was measured."""
    prompts = plan.prompt_list()
    check_prompts(prompts, dec.manifest, dec.codec, plan.max_new_tokens)  # before any timing
    configs = plan.configs(dec)
    dropped = sorted({k for k in plan.ks if k > dec.manifest.k})
    if len(configs) == 1 and any(d != "none" for d in plan.drafters):
        raise SamplingParamsError(
            f"nothing to compare with plain decoding: drafters {', '.join(plan.drafters)} at k {list(plan.ks)} on a "
            f"bundle with K={dec.manifest.k}" + ("" if dec.draft_runner is not None else " and no draft model")
            + f"; choose k in 1..{dec.manifest.k}")
    if dropped:
        progress(f"k {dropped} > the bundle's K={dec.manifest.k}: skipped (re-export with a larger --k)")
    total = len(prompts) * plan.repeats * len(plan.temperatures) * len(configs)
    progress("measuring machine and step costs …")
    meta = {"machine": machine_info(), "bundle": bundle_info(dec), "plan": _plan_dict(plan),
            "started": time.strftime("%Y-%m-%d %H:%M:%S")}
    steps = dec.time_steps()
    meta["step_costs_depth"] = cost_depth(dec.manifest.max_context)
    # warm-up: first use of every graph width, drafter and tree (a tree this bundle cannot verify is refused here)
    for drafter, tree in sorted({(d, t) for d, _, t in configs}, key=str):
        dec.generate("Hello", SamplingParams(max_new_tokens=8), drafter=drafter,
                     k=dec.manifest.k if drafter != "none" else 0, tree=tree)
    runs: list[dict[str, Any]] = []
    t_start, i = time.perf_counter(), 0
    for bp in prompts:
        prompt, chat = bp.as_request(bool(dec.manifest.tokenizer.chat_template))
        for rep in range(plan.repeats):
            for temp in plan.temperatures:
                params = SamplingParams(max_new_tokens=plan.max_new_tokens, temperature=temp,
                                        seed=plan.seed + rep if temp > 0 else None, ignore_eos=plan.ignore_eos)
                for drafter, k, tree in configs:
                    i += 1
                    # a new request each time (nothing cached: the run before it had the same prompt)
                    res = dec.generate(prompt, params, drafter=drafter, k=k, chat=chat, reuse_prefix=False, tree=tree)
                    s = res.stats.as_dict()
                    name = config_name(drafter, tree)
                    runs.append({"suite": bp.suite, "prompt_id": bp.id, "repeat": rep, "temperature": temp,
                                 "drafter": name, "k": k, "tree": tree, **{x: s[x] for x in _STAT_KEYS},
                                 "e2e_tok_s": s["new_tokens"] / (s["ttft_s"] + s["decode_s"]),
                                 "peak_rss_mb": peak_rss_mb(), "token_ids": res.token_ids})
                    if on_run is not None:
                        on_run({"meta": meta, "step_costs_s": steps, "runs": runs, "complete": False})
                    eta = (time.perf_counter() - t_start) / i * (total - i)
                    progress(f"[{i}/{total}] {bp.id} t={temp:g} {name:13} k={k} "
                             f"{s['decode_tok_s']:6.1f} tok/s acc={s['acceptance_rate']:.2f} "
                             f"new={s['new_tokens']} (eta {eta / 60:.1f} min)")
    meta["seconds"] = round(time.perf_counter() - t_start, 1)
    meta["peak_rss_mb"] = round(peak_rss_mb(), 1)
    return {"meta": meta, "step_costs_s": steps, "runs": runs, "complete": True}


_STAT_KEYS = ("prompt_tokens", "new_tokens", "ttft_s", "decode_s", "decode_tok_s", "rounds", "drafted", "accepted",
              "acceptance_rate", "mean_accepted_per_round", "accept_hist", "time_draft_s", "time_verify_s",
              "time_host_s", "finish_reason", "strategies", "tree_shapes", "tree_rounds", "branched")


def _plan_dict(plan: BenchPlan) -> dict[str, Any]:
    d = asdict(plan)
    d["prompts"] = [p.id for p in plan.prompts]
    return d
