"""From raw runs to the report: a summary table per configuration (JSON + Markdown) and PNG plots.

The output folder is checked before any work (:func:`check_out_dir`): new, empty, or a previous bench output (its
``results.json`` has the shape :func:`write_results` writes), and writable. Every file is written to a temporary
name beside it and renamed into place, so a reader (or an interruption) sees the old file or the new one, whole.
"""

from __future__ import annotations

import json
import os
import tempfile
from collections import defaultdict
from pathlib import Path
from typing import Any, Callable

from ..errors import OptionError
from ..manifest import MANIFEST_NAME, format_layers
from .analysis import best_k, ideal_speedup, paired_speedups, round_cost_in_plain_steps, spread

RESULTS = "results.json"


def _width_time(costs: dict, n: int) -> float:
    """Seconds of the smallest declared width that takes n tokens (widths in JSON come back as strings)."""
    fits = sorted((int(t), s) for t, s in costs.items() if int(t) >= n)
    return fits[0][1] if fits else float("nan")


def summarize(raw: dict[str, Any]) -> dict[str, Any]:
    """Aggregate raw runs per (suite, drafter, k, temperature) and attach the cost model and best k."""
    runs, steps = raw["runs"], raw["step_costs_s"]
    t1 = _width_time(steps["target"], 1)
    c_model = _width_time(steps["draft"], 1) / t1 if "draft" in steps else None
    rows: list[dict[str, Any]] = []
    by_suite: dict[str, list[dict]] = defaultdict(list)
    for r in runs:
        by_suite[r["suite"]].append(r)
    speedup_med: dict[tuple, float] = {}
    for suite, rs in by_suite.items():
        dec_pairs, e2e_pairs = paired_speedups(rs), paired_speedups(rs, "e2e_tok_s")
        plain_ids = {(r["prompt_id"], r["repeat"], r["temperature"]): r["token_ids"] for r in rs if r["drafter"] == "none"}
        groups: dict[tuple, list[dict]] = defaultdict(list)
        for r in rs:
            groups[(r["drafter"], r["k"], r["temperature"])].append(r)
        for (drafter, k, temp), g in sorted(groups.items(), key=lambda kv: (kv[0][0] != "none", kv[0])):
            drafted, accepted = sum(r["drafted"] for r in g), sum(r["accepted"] for r in g)
            alpha = accepted / drafted if drafted else 0.0
            hist: list[int] = []
            for r in g:
                for m, cnt in enumerate(r["accept_hist"]):
                    hist += [0] * (m + 1 - len(hist))
                    hist[m] += cnt
            tot = {p: sum(r[f"time_{p}_s"] for r in g) for p in ("draft", "verify", "host")}
            round_time = sum(tot.values()) or float("nan")
            row = {"suite": suite, "drafter": drafter, "k": k, "temperature": temp, "runs": len(g),
                   "prompt_tokens": spread(r["prompt_tokens"] for r in g)["median"],
                   "new_tokens": spread(r["new_tokens"] for r in g)["median"],
                   "ttft_s": spread(r["ttft_s"] for r in g), "decode_tok_s": spread(r["decode_tok_s"] for r in g),
                   "e2e_tok_s": spread(r["e2e_tok_s"] for r in g), "acceptance": alpha,
                   "accepted_per_round": spread(r["mean_accepted_per_round"] for r in g)["median"],
                   "accept_hist": hist, "time_split": {p: v / round_time for p, v in tot.items()},
                   "peak_rss_mb": max(r["peak_rss_mb"] for r in g)}
            if drafter != "none":
                row["speedup"] = spread(dec_pairs.get((drafter, k, temp), []))
                row["e2e_speedup"] = spread(e2e_pairs.get((drafter, k, temp), []))
                strategies: dict[str, int] = defaultdict(int)
                for r in g:
                    for name, n in (r.get("strategies") or {}).items():
                        strategies[name] += n
                row["strategies"] = dict(strategies)
                shapes: dict[str, int] = defaultdict(int)
                for r in g:
                    for name, n in (r.get("tree_shapes") or {}).items():
                        shapes[name] += n
                row["trees"] = {"rounds": sum(shapes.values()), "branched": sum(r.get("branched", 0) for r in g),
                                "shapes": dict(sorted(shapes.items(), key=lambda kv: -kv[1]))}
                rounds = sum(r["rounds"] for r in g) or 1
                # one plain decode step of this suite, from the plain runs (same prompts, same process)
                plain_step = spread(r["decode_s"] / max(r["new_tokens"] - 1, 1) for r in rs
                                    if r["drafter"] == "none" and r["temperature"] == temp)["median"]
                row["tokens_per_round"] = 1 + accepted / rounds
                row["round_cost"] = {p: round_cost_in_plain_steps(tot[p] / rounds, plain_step) for p in tot}
                if drafter in ("model", "prompt-lookup"):  # fixed drafters: the ideal of the cost-model formula
                    c = c_model if drafter == "model" else 0.0
                    row["cost_ratio_c"] = c
                    row["ideal_speedup"] = ideal_speedup(alpha, c, k) if c is not None else None
                    row["vs_ideal"] = row["speedup"]["median"] / row["ideal_speedup"] if row["ideal_speedup"] else None
                speedup_med[(suite, drafter, temp, k)] = row["speedup"]["median"]
            # greedy: speculation must reproduce plain token for token; sampled (same seed as the plain run,
            # position-keyed sampler): the seed must fix the text whatever the drafter
            same = [r["token_ids"] == plain_ids.get((r["prompt_id"], r["repeat"], temp)) for r in g]
            row["identical_to_plain"] = f"{sum(same)}/{len(same)}"
            rows.append(row)
    best = [{"suite": s, "drafter": d, "temperature": t, "best_k": k, "speedup": v}
            for (s, d, t), (k, v) in sorted(best_k(speedup_med).items())]
    return {"rows": rows, "best_k": best, "step_costs_s": steps, "verify_cost_vs_decode":
            {str(t): s / t1 for t, s in steps["target"].items()}, "cost_ratio_c": c_model}


def _f(x: float | None, fmt: str = ".2f") -> str:
    return "—" if x is None or x != x else format(x, fmt)


def _round_cost(r: dict[str, Any]) -> str:
    c = r["round_cost"]
    return f"{sum(c.values()):.2f} ({c['draft']:.2f} + {c['verify']:.2f} + {c['host']:.3f})"


def _trees(t: dict[str, Any] | None) -> str:
    if not t or not t["rounds"]:
        return "—"
    shapes = ", ".join(f"{s}: {n}" for s, n in list(t["shapes"].items())[:4])
    return f"{t['rounds']} ({t['branched']}): {shapes}" + (", …" if len(t["shapes"]) > 4 else "")


def to_markdown(raw: dict[str, Any], summary: dict[str, Any]) -> str:
    m, b, plan = raw["meta"]["machine"], raw["meta"]["bundle"], raw["meta"]["plan"]
    models = "; ".join(f"{role}: {x['family']} {x['layers']}L/{x['hidden']} {x['precision']} "
                       + (f"(the target's layers {format_layers(x['self_layers'])}, its weights and KV)"
                          if x.get("self_layers") else
                          f"({x['weights_bytes'] / 1e9:.2f} GB weights, {x['kv_bytes'] / 1e6:.0f} MB KV)")
                       for role, x in b["models"].items())
    steps = summary["step_costs_s"]
    out = [
        f"Machine: {m['cpu']} ({m.get('cpu_flags', 'flags not recorded')}), {m['cpus']} CPUs, {m['memory_gb']} GB RAM, copy bandwidth {m['copy_bandwidth_gbs']} GB/s; "
        f"Python {m['python']}, numpy {m['numpy']}, onnxruntime {m['onnxruntime']}, specedge {m['specedge']}.",
        f"Bundle: `{b['path']}`, backend {b['backend']} ({b.get('precision', 'fp32')}), K={b['K']}, S_max={b['max_context']}, P={b['prefill_chunk']}, "
        f"kv_mode {b['kv_mode']}; {models}.",
        f"Plan: max_new_tokens {plan['max_new_tokens']}, ignore_eos {plan['ignore_eos']}, repeats {plan['repeats']}, "
        f"temperatures {plan['temperatures']}; {raw['meta']['seconds']:.0f} s; peak RSS {raw['meta']['peak_rss_mb']:.0f} MB.",
        f"Step costs (one step per declared width, at {raw['meta'].get('step_costs_depth', '?')} positions of "
        "context): " + "; ".join(
            f"{role} " + ", ".join(f"T={t}: {s * 1000:.1f} ms" for t, s in sorted(c.items(), key=lambda kv: int(kv[0])))
            for role, c in steps.items()) + f"; draft/target cost ratio c = {_f(summary['cost_ratio_c'], '.3f')}.",
        "",
        "| suite | drafter | k | temp | decode tok/s (min–max) | speedup vs plain (min–max) | e2e speedup | TTFT ms "
        "| acceptance α | tokens/round | round cost in plain steps (draft + verify + host) | ideal | measured/ideal "
        "| same as plain | rounds per strategy | tree rounds (branch taken): shapes |",
        "|" + "---|" * 16,
    ]
    for r in summary["rows"]:
        d = r["decode_tok_s"]
        sp = r.get("speedup")
        spd = f"**{sp['median']:.2f}×** ({sp['min']:.2f}–{sp['max']:.2f})" if sp else "1 (baseline)"
        out.append(
            f"| {r['suite']} | {r['drafter']} | {r['k']} | {r['temperature']:g} | {d['median']:.1f} ({d['min']:.1f}–{d['max']:.1f}) "
            f"| {spd} | {_f(r['e2e_speedup']['median']) + '×' if sp else '—'} | {r['ttft_s']['median'] * 1000:.0f} "
            f"| {_f(r['acceptance']) if sp else '—'} | {_f(r['tokens_per_round']) if sp else '1'} "
            f"| {_round_cost(r) if sp else '1'} "
            f"| {_f(r.get('ideal_speedup')) if sp else '—'} | {_f(r.get('vs_ideal'), '.0%') if sp else '—'} "
            f"| {r.get('identical_to_plain', '—')} "
            f"| {', '.join(f'{n}: {c}' for n, c in sorted(r.get('strategies', {}).items())) or '—'} "
            f"| {_trees(r.get('trees'))} |")
    out += ["", "Speedup: median over prompts × repeats of (speculative decode tok/s) / (plain decode tok/s on the same "
            "prompt, measured back to back). Speedup ≈ tokens/round ÷ round cost, the round cost measured in plain "
            "decode steps of the same suite and split into drafting, verifying and host work (sampling, acceptance, "
            "bookkeeping, detokenization). ideal = (1−α^(k+1)) / ((1−α)(1+c·k)) with the measured α and c "
            "(c: draft step / target step from the step costs above); it assumes a round costs 1 + c·k plain steps, "
            "so the round-cost column shows where measured and ideal part.",
            "", "Best k per suite and drafter (median paired decode speedup):", "",
            "| suite | drafter | temp | best k | speedup |", "|---|---|---|---|---|"]
    out += [f"| {x['suite']} | {x['drafter']} | {x['temperature']:g} | {x['best_k']} | {x['speedup']:.2f}× |"
            for x in summary["best_k"]]
    out += ["", "Per suite: the plain baseline, the best fixed configuration chosen in hindsight, and the adaptive modes "
            "(median paired decode speedup):", "",
            "| suite | temp | plain tok/s | best fixed (drafter, k) | best fixed speedup | auto | hybrid | auto / best fixed |",
            "|---|---|---|---|---|---|---|---|"]
    out += [f"| {suite} | {temp:g} | {line} |" for suite, temp, line in _suite_overview(summary)]
    return "\n".join(out) + "\n"


def _suite_overview(summary: dict[str, Any]) -> list[tuple[str, float, str]]:
    rows = summary["rows"]
    out = []
    for suite, temp in sorted({(r["suite"], r["temperature"]) for r in rows}):
        sel = [r for r in rows if r["suite"] == suite and r["temperature"] == temp]
        plain = next((r for r in sel if r["drafter"] == "none"), None)
        fixed = [r for r in sel if r["drafter"] in ("model", "prompt-lookup")]
        best = max(fixed, key=lambda r: r["speedup"]["median"], default=None)
        adaptive = {r["drafter"]: r["speedup"]["median"] for r in sel if r["drafter"] in ("auto", "hybrid")}
        b = best["speedup"]["median"] if best else float("nan")
        out.append((suite, temp, " | ".join([
            f"{plain['decode_tok_s']['median']:.1f}" if plain else "—",
            f"{best['drafter']}, {best['k']}" if best else "—", f"{b:.2f}×",
            _f(adaptive.get("auto")) + ("×" if "auto" in adaptive else ""),
            _f(adaptive.get("hybrid")) + ("×" if "hybrid" in adaptive else ""),
            f"{adaptive['auto'] / b:.2f}" if "auto" in adaptive and best else "—"])))
    return out


def write_plots(summary: dict[str, Any], out: Path) -> list[Path]:
    """speedup_vs_k.png, acceptance_hist.png, time_split.png. Needs matplotlib (the bench extra)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in summary["rows"] if r["drafter"] != "none"]
    suites = sorted({r["suite"] for r in summary["rows"]})
    paths = []
    fig, axes = plt.subplots(1, len(suites), figsize=(4 * len(suites), 3.4), squeeze=False, sharey=True)
    for ax, suite in zip(axes[0], suites):
        for key in sorted({(r["drafter"], r["temperature"]) for r in rows if r["suite"] == suite
                           and "ideal_speedup" in r}):
            sel = sorted((r for r in rows if r["suite"] == suite and (r["drafter"], r["temperature"]) == key),
                         key=lambda r: r["k"])
            ax.plot([r["k"] for r in sel], [r["speedup"]["median"] for r in sel], "o-", label=f"{key[0]} t={key[1]:g}")
            ax.plot([r["k"] for r in sel], [r["ideal_speedup"] or float("nan") for r in sel], ":",
                    color=ax.lines[-1].get_color())
        for r in rows:
            if r["suite"] == suite and "ideal_speedup" not in r:  # auto / hybrid: one line each
                ax.axhline(r["speedup"]["median"], ls="--", lw=1.2, color="black" if r["drafter"] == "auto" else "purple",
                           label=f"{r['drafter']} t={r['temperature']:g}")
        ax.axhline(1.0, color="grey", lw=0.8)
        ax.set_title(suite)
        ax.set_xlabel("draft length k")
    axes[0][0].set_ylabel("speedup vs plain\n(dotted: ideal formula)")
    axes[0][-1].legend(fontsize=7)
    paths.append(_save(fig, out / "speedup_vs_k.png", plt))

    fig, axes = plt.subplots(1, len(suites), figsize=(4 * len(suites), 3.2), squeeze=False, sharey=True)
    for ax, suite in zip(axes[0], suites):
        sel = [r for r in rows if r["suite"] == suite]
        kmax = max((r["k"] for r in sel), default=0)
        for j, r in enumerate(r for r in sel if r["k"] == kmax):
            h = r["accept_hist"]
            tot = sum(h) or 1
            ax.bar([m + 0.4 * j for m in range(len(h))], [c / tot for c in h], width=0.4,
                   label=f"{r['drafter']} t={r['temperature']:g}")
        ax.set_title(f"{suite}, k={kmax}")
        ax.set_xlabel("draft tokens accepted per round")
    axes[0][0].set_ylabel("fraction of rounds")
    axes[0][-1].legend(fontsize=7)
    paths.append(_save(fig, out / "acceptance_hist.png", plt))

    allrows = summary["rows"]
    fig, ax = plt.subplots(figsize=(max(6, 0.35 * len(allrows)), 3.6))
    labels = [f"{r['suite']} {r['drafter'][:6]} k{r['k']} t{r['temperature']:g}" for r in allrows]
    bottom = [0.0] * len(allrows)
    for part in ("draft", "verify", "host"):
        vals = [r["time_split"][part] for r in allrows]
        ax.bar(range(len(allrows)), vals, bottom=bottom, label=part)
        bottom = [b + v for b, v in zip(bottom, vals)]
    ax.set_xticks(range(len(allrows)), labels, rotation=90, fontsize=6)
    ax.set_ylabel("share of round time")
    ax.legend(fontsize=7)
    paths.append(_save(fig, out / "time_split.png", plt))
    return paths


def _save(fig: Any, path: Path, plt: Any) -> Path:
    fig.tight_layout()
    _write_atomic(path, lambda tmp: fig.savefig(tmp, dpi=110, format="png"))
    plt.close(fig)
    return path


def is_bench_output(folder: Path) -> bool:
    """Whether ``folder`` holds a results.json that a benchmark wrote (complete or not)."""
    try:
        r = json.loads((folder / RESULTS).read_text(encoding="utf-8"))
    except (OSError, ValueError, RecursionError):
        return False
    return (isinstance(r, dict) and isinstance(r.get("meta"), dict) and isinstance(r.get("runs"), list)
            and isinstance(r.get("step_costs_s"), dict))


def check_out_dir(out_dir: str | Path) -> Path:
    """Refuse, before any work, an output folder the benchmark must not write into; create it if new. Allowed: a
    new or empty folder, or one holding a previous benchmark's results (whose files are replaced)."""
    out = Path(out_dir)
    if out.is_symlink():
        try:
            out.resolve(strict=True)
        except (RuntimeError, OSError) as e:  # a loop (RuntimeError up to Python 3.12) or a link to nowhere
            raise OptionError(f"--out {out} is a symbolic link that loops or points nowhere ({e}); choose "
                              f"another --out") from None
    if out.exists():
        if not out.is_dir():
            raise OptionError(f"--out {out} exists and is not a folder; choose another --out")
        if (out / MANIFEST_NAME).exists():
            raise OptionError(f"--out {out} is a bundle; write the benchmark's results to a folder of their own")
        try:  # (a results.json temporary left by an interrupted write counts as nothing)
            empty = not any(p for p in out.iterdir() if not p.name.startswith(f".{RESULTS}.tmp-"))
        except OSError as e:
            raise OptionError(f"--out {out}: cannot read the folder ({e.strerror})") from None
        if not empty and not is_bench_output(out):
            raise OptionError(f"--out {out} is a folder that is not empty and holds no spec-run bench results "
                              f"({RESULTS}); choose a new or empty folder, or a previous bench output")
    try:
        out.mkdir(parents=True, exist_ok=True)
        fd, probe = tempfile.mkstemp(prefix=".write-test-", dir=out)
        os.close(fd)
        os.unlink(probe)
    except OSError as e:
        raise OptionError(f"--out {out}: cannot write there ({e.strerror or e}); choose a folder you can "
                          f"write to") from None
    return out


def _write_atomic(path: Path, data: str | bytes | Callable[[Path], None]) -> None:
    """Write ``path`` through a temporary file beside it and a rename; ``data`` may be a function writing a path."""
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        if callable(data):
            data(tmp)
        else:
            with open(tmp, "wb") as f:
                f.write(data.encode("utf-8") if isinstance(data, str) else data)
                f.flush()
                os.fsync(f.fileno())
        os.replace(tmp, path)
    except OSError as e:
        try:
            tmp.unlink()
        except OSError:
            pass
        raise OptionError(f"cannot write {path}: {e.strerror or e}") from None


def write_results(raw: dict[str, Any], out_dir: str | Path) -> Path:
    """Write the raw results (complete or so far) as ``OUT/results.json``, atomically."""
    path = Path(out_dir) / RESULTS
    _write_atomic(path, json.dumps(raw, indent=1))
    return path


def write_report(raw: dict[str, Any], out_dir: str | Path, plots: bool = True,
                 say: Callable[[str], None] = lambda s: None) -> dict[str, Path]:
    """Write results.json (raw runs + summary), report.md and, if matplotlib is installed, the plots, each
    atomically, into a folder :func:`check_out_dir` accepts."""
    out = check_out_dir(out_dir)
    summary = summarize(raw)
    files = {"json": out / RESULTS, "markdown": out / "report.md"}
    _write_atomic(files["json"], json.dumps({**raw, "summary": summary}, indent=1))
    _write_atomic(files["markdown"], to_markdown(raw, summary))
    if plots:
        try:
            for p in write_plots(summary, out):
                files[p.stem] = p
        except ImportError:
            say("matplotlib is not installed: plots skipped (pip install 'specedge[bench]')")
    return files
