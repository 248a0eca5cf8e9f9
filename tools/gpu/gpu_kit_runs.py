"""How the GPU kit's device checks run: step-by-step parity with the goldens, greedy speculative == plain,
ONNX Runtime CUDA on a NaN-poisoned allocator, `spec-export validate --goldens`, the CUDA binding vs CuPy. Each
takes the check context (gpu_kit_checks.Ctx) and returns a result dict whose `passed` is the verdict; each
``*_plan`` says what its check would do, for a report where it is skipped. The CPU variants (ort-cpu) run the
same functions."""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import gpu_kit_goldens as gg
import numpy as np

TOOLS = Path(__file__).resolve().parent
LOGIT_SCALE = 5.0  # the kit models' logit magnitude: greedy near-tie bound = 2 x (rel x scale + atol)
Ctx = Any  # gpu_kit_checks.Ctx (not imported: that module imports this one)


class Skip(Exception):
    """Raised by a check that finds at run time that it cannot run here (the message says why)."""


# ------------------------------------------------------------------ parity and greedy
@dataclass(frozen=True)
class Config:
    """One way of running a bundle: backend, precision (None: the fp32 or int4 graphs), tolerance name."""

    name: str
    backend: str
    precision: str | None
    tol: str
    graphs: bool | None = None  # TensorRT CUDA graphs (None: the backend's default, option not passed)
    tf32_off: bool = False  # ONNX Runtime CUDA with use_tf32=0 (runners opened directly)

    def api(self, bundle: str) -> str:
        if self.tf32_off:
            return (f"OrtRunner(WORK/bundles/{bundle}, manifest, role, device='cuda', providers="
                    f"[('CUDAExecutionProvider', {{'device_id': 0, 'use_tf32': 0}}), 'CPUExecutionProvider'])")
        kw = f", precision={self.precision!r}" if self.precision else ""
        kw += f", cuda_graphs={self.graphs}" if self.graphs is not None else ""
        return f"SpecDecoder.load(WORK/bundles/{bundle}, backend={self.backend!r}{kw}, verify='size')"


def open_runners(ctx: Ctx, bundle: str, cfg: Config) -> tuple[dict[str, Any], Callable[[], None], dict]:
    notes: dict[str, Any] = {}
    if cfg.tf32_off:
        from specedge.runtime.backends.ort import OrtRunner
        from specedge.runtime.manifest import read_manifest

        m = read_manifest(ctx.bundle(bundle), verify="size")
        prov = [("CUDAExecutionProvider", {"device_id": 0, "use_tf32": 0}), "CPUExecutionProvider"]
        try:
            runners = {r: OrtRunner(ctx.bundle(bundle), m, r, device="cuda", providers=prov) for r in m.models}
        except Exception as e:  # noqa: BLE001 - an ONNX Runtime that does not know the option
            notes["use_tf32"] = f"not accepted ({str(e)[:200]}): default CUDA options, TF32 tolerance"
            prov = [("CUDAExecutionProvider", {"device_id": 0}), "CPUExecutionProvider"]
            runners = {r: OrtRunner(ctx.bundle(bundle), m, r, device="cuda", providers=prov) for r in m.models}
        return runners, lambda: [r.close() for r in runners.values()], notes
    dec = ctx.load_decoder(bundle, cfg.backend, cfg.precision, cfg.graphs)
    dec.target.min_width = 1  # the script runs every declared width, the target's decode width 1 included
    runners = {"target": dec.target, **({"draft": dec.draft_runner} if dec.draft_runner is not None else {})}
    return runners, dec.close, notes


def _session_providers(runners: dict[str, Any]) -> dict[str, list[str]]:
    return {r: run.session.get_providers() for r, run in runners.items() if getattr(run, "session", None)}


def parity(ctx: Ctx, bundle: str, cfg: Config) -> dict:
    runners, close, notes = open_runners(ctx, bundle, cfg)
    tol = gg.TOLERANCES["tf32" if "use_tf32" in notes else cfg.tol]
    try:
        providers = _session_providers(runners)
        if cfg.backend == "ort-trt" and "TensorrtExecutionProvider" not in providers.get("target", []):
            raise Skip(f"ONNX Runtime lists TensorrtExecutionProvider but the session runs on "
                       f"{providers.get('target')} (TensorRT libraries not loadable?)")
        t0 = time.perf_counter()
        res = gg.replay(ctx.goldens(bundle), runners, tol)
        res["seconds"] = round(time.perf_counter() - t0, 2)
        res["graph_status"] = {r: getattr(run, "graph_status", None) for r, run in runners.items()}
    finally:
        close()
    worst = max(p["max_reldiff"] for p in res["parts"].values())
    res.update(providers=providers, notes=notes, summary=(
        f"{res['steps_passed']}/{res['steps']} steps within {cfg.tol if 'use_tf32' not in notes else 'tf32'} "
        f"tolerance; max |d| / max|ref| {worst:.3g}; argmax mismatches "
        f"{sum(p['argmax_mismatch'] for p in res['parts'].values())}, near-ties "
        f"{sum(p['near_ties'] for p in res['parts'].values())}"
        + (f"; CUDA graphs: {graphs_line(res['graph_status'])}" if cfg.graphs is not None else "")))
    return res


def graphs_line(status: dict[str, Any]) -> str:
    """{role: {T: "captured" | "plain execute: why"}} -> "target 6/6 captured, draft 1/2 captured (T=16: why)"."""
    out = []
    for role, st in status.items():
        if not isinstance(st, dict):
            out.append(f"{role} {st!r}")
            continue
        bad = {T: v for T, v in st.items() if v != "captured"}
        out.append(f"{role} {len(st) - len(bad)}/{len(st)} captured"
                   + (" (" + "; ".join(f"T={T}: {v}" for T, v in bad.items()) + ")" if bad else ""))
    return ", ".join(out)


def parity_plan(ctx: Ctx, bundle: str, cfg: Config) -> dict:
    meta, _ = gg.load(ctx.goldens(bundle))
    s = gg.script_summary(meta)
    tol = gg.TOLERANCES[cfg.tol]
    return {"what": f"replay {ctx.meta['bundles'][bundle]['goldens']} ({s['steps']} steps: "
                    + ", ".join(f"{k} x{v}" for k, v in s["per_part"].items())
                    + ") and compare every step's logits with the ONNX Runtime CPU goldens; target and draft "
                      "interleaved on one decoder (TensorRT: one stream, shared scratch)",
            "api": [cfg.api(bundle),
                    "runner.min_width = 1; runner.step(tokens, past_len, all_logits) per recorded step"],
            "widths": s["widths_T"], "tolerance": f"{cfg.tol}: {tol.text()} ({tol.why})"}


def greedy(ctx: Ctx, bundle: str, cfg: Config) -> dict:
    gold = ctx.greedy[bundle]
    n, K = gold["max_new_tokens"], ctx.meta["layout"]["k"]
    tol = gg.TOLERANCES[cfg.tol]
    tie = 2 * (tol.rel * LOGIT_SCALE + tol.atol)
    dec = ctx.load_decoder(bundle, cfg.backend, cfg.precision, cfg.graphs)
    drafters = ["prompt-lookup", *(["model"] if dec.draft_runner is not None else [])]
    rows, spec_same, spec_total = [], 0, 0
    drafted = {d: [0, 0] for d in drafters}  # drafter -> [drafted, accepted] over all its runs
    try:
        for p in gold["prompts"]:
            ids_same = dec.encode_prompt(p["text"], chat=True) == p["ids"]
            plain = gg.greedy_tokens(dec, p["text"], n)
            vs_golden = gg.greedy_match(p["tokens"], p["gaps"], plain, tie)
            differ = []
            for d in drafters:
                for k in range(1, K + 1):
                    res = gg.greedy_run(dec, p["text"], n, d, k)
                    spec = list(res.token_ids)
                    drafted[d][0] += res.stats.drafted
                    drafted[d][1] += res.stats.accepted
                    spec_total += 1
                    if spec == plain:
                        spec_same += 1
                        continue
                    j = next((i for i, (a, b) in enumerate(zip(spec, plain)) if a != b), min(len(spec), len(plain)))
                    same_as_golden = plain[:j + 1] == p["tokens"][:j + 1]
                    differ.append({"drafter": d, "k": k, "first_difference": j,
                                   "golden_top2_gap_there": p["gaps"][j] if same_as_golden and j < len(p["gaps"])
                                   else None})
            rows.append({"prompt": p["text"][:40], "ids_match_golden": ids_same, "plain_vs_golden": vs_golden,
                         "spec_differs": differ})
    finally:
        dec.close()
    eq = sum(r["plain_vs_golden"]["equal"] for r in rows)
    ties = all(r["plain_vs_golden"]["passed"] for r in rows)
    passed = spec_same == spec_total and all(r["ids_match_golden"] for r in rows) and ties
    return {"passed": passed, "drafters": ["none", *drafters], "k": list(range(1, K + 1)), "tokens": n,
            "near_tie_bound": tie, "drafted_accepted": drafted, "prompts": rows,
            "summary": f"speculative == plain (bitwise tokens): {spec_same}/{spec_total} runs (drafted/accepted "
                       + ", ".join(f"{d} {a}/{b}" for d, (a, b) in drafted.items())
                       + f"); plain == CPU golden tokens: {eq}/{len(rows)} prompts"
                       + ("" if eq == len(rows) else f", the others diverge at a near-tie (gap < {tie:.3g}): {ties}")
                       + ("" if all(r["ids_match_golden"] for r in rows) else "; PROMPT IDS DIFFER from the golden")}


def greedy_plan(ctx: Ctx, bundle: str, cfg: Config) -> dict:
    gold = ctx.greedy[bundle]
    K = ctx.meta["layout"]["k"]
    drafters = "none, prompt-lookup" + (", model" if ctx.meta["bundles"][bundle]["drafter"] == "model" else "")
    tol = gg.TOLERANCES[cfg.tol]
    return {"what": f"{len(gold['prompts'])} chat prompts x {gold['max_new_tokens']} greedy tokens: drafters "
                    f"{drafters} at k = 1..{K}; every speculative run must equal the plain run bit for bit, the plain "
                    "run must equal the CPU golden tokens (or first diverge where the golden top-2 gap < "
                    f"{2 * (tol.rel * LOGIT_SCALE + tol.atol):.3g}), prompt ids must match",
            "api": [cfg.api(bundle), "dec.generate(prompt, SamplingParams(max_new_tokens=N, ignore_eos=True), "
                                     "drafter=D, k=k, chat=True)"],
            "reference": "goldens/greedy.json"}


# ------------------------------------------------------------------ single GPU checks
def nan_cache(ctx: Ctx, bundle: str, precision: str | None) -> dict:
    """ort-cuda on an allocator poisoned with NaN (0xFF bytes freed just before): the runner must zero its
    cache, so a step at past_len 0 gives finite logits equal to the golden; then the control: the cache itself
    set to NaN makes that step NaN (so the check can see what it guards against)."""
    from specedge.runtime.backends.cuda_rt import CudaRuntime

    c = CudaRuntime()
    free, _ = c.mem_info()
    nbytes = int(min(1 << 30, free // 4))
    ptr = c.malloc(nbytes)
    c.memset(ptr, 0xFF, nbytes)
    c.synchronize()
    c.free(ptr)
    meta, ref = gg.load(ctx.goldens(bundle))
    i = max((j for j, o in enumerate(meta["ops"]) if o["role"] == "target" and o["past_len"] == 0 and o["all_logits"]),
            key=lambda j: len(meta["ops"][j]["tokens"]))
    op = meta["ops"][i]
    dec = ctx.load_decoder(bundle, "ort-cuda", precision)
    try:
        r = dec.target
        r.min_width = 1
        values = getattr(r, "_kv_values", None)
        zeroed = None if values is None else all(not np.any(v.numpy()) for v in values)
        got = np.array(r.step(op["tokens"], 0, True))
        cmp = gg.compare({**meta, "ops": [op]}, [ref[i]], [got], gg.TOLERANCES["tf32" if precision is None else "fp16"])
        control = None
        if values is not None:
            for v in values:
                c.memset(v.data_ptr(), 0xFF, int(np.prod(v.shape())) * (2 if precision == "fp16" else 4))
            c.synchronize()
            control = not bool(np.isfinite(np.array(r.step(op["tokens"], 0, True))).all())
    finally:
        dec.close()
    finite = bool(np.isfinite(got).all())
    return {"passed": finite and cmp["passed"] and zeroed is not False, "poisoned_bytes": nbytes,
            "cache_zero_after_open": zeroed, "finite": finite, "vs_golden": cmp,
            "control_nan_cache_gives_nan": control,
            "summary": f"cache zero after open: {zeroed}; step at past_len 0 (T={len(op['tokens'])}) finite: {finite}, "
                       f"matches golden: {cmp['passed']}; control (cache = NaN) poisons logits: {control}"}


def nan_cache_plan(ctx: Ctx, bundle: str, precision: str | None) -> dict:
    return {"what": "cudaMalloc 1 GiB (at most free/4), fill it with 0xFF (NaN), cudaFree; open ort-cuda: every cache "
                    "tensor must read back zero, a target step at past_len 0 must be finite and match the golden; "
                    "control: the cache set to NaN must poison that step",
            "api": [Config("", "ort-cuda", precision, "").api(bundle),
                    "OrtValue.numpy() of every cache tensor; runner.step(tokens, 0, all_logits=True)"],
            "tolerance": f"{'tf32' if precision is None else 'fp16'}: "
                         f"{gg.TOLERANCES['tf32' if precision is None else 'fp16'].text()}"}


def validate(ctx: Ctx, bundle: str, candidate: str) -> dict:
    g = ctx.kit / ctx.meta["bundles"][bundle]["validate_goldens"]
    out = ctx.work / f"validate-{candidate}-{bundle}.json"
    cmd = ctx.spec_export("validate", ctx.bundle(bundle), "--candidate", candidate, "--goldens", g, "--report", out)
    p = ctx.sh(cmd, timeout=240)
    if not out.is_file():
        return {"passed": False, "command": ctx.show(cmd), "exit": p.returncode,
                "output_tail": (p.stdout + p.stderr)[-3000:], "summary": f"exit {p.returncode}, no report"}
    rep = json.loads(out.read_text())
    worst = max((c["logits"]["max_absdiff"] for c in rep["cases"]), default=None)
    cases = f"{sum(c['passed'] for c in rep['cases'])}/{len(rep['cases'])}"
    summary = (f"{'PASSED' if rep['passed'] else 'FAILED'}: {cases} graph cases (logits max|d| {worst:.3g}), greedy "
               + ", ".join(f"{r} {100 * a['fraction']:.0f} %" for r, a in rep["greedy"].items()))
    notes = [line for line in p.stderr.splitlines() if "[gpu-kit]" in line]
    return {"passed": p.returncode == 0 and rep["passed"], "command": ctx.show(cmd), "report": str(out),
            "cases": rep["cases"], "greedy": rep["greedy"], "tolerances": rep["tolerances"], "notes": notes,
            "summary": summary}


def validate_plan(ctx: Ctx, bundle: str, candidate: str) -> dict:
    g = ctx.meta["bundles"][bundle].get("validate_goldens", "?")
    return {"what": "polygraphy per-graph comparison (prefill, verify, decode inputs recorded on the CPU) + "
                    "teacher-forced greedy agreement, against the kit's saved fp32 reference",
            "commands": [f"spec-export validate WORK/bundles/{bundle} --candidate {candidate} --goldens KIT/{g} "
                         f"--report WORK/validate-{candidate}-{bundle}.json"],
            "tolerance": "validate's fp16 defaults: logits atol 0.5 / rtol 0.05; present.* atol 0.05 + 2^-9 x "
                         "max|ref|, rtol 0.05; greedy top-1 agreement >= 95 %"}


def cuda_binding_plan(ctx: Ctx) -> dict:
    return {"what": "specedge's libcudart binding vs CuPy: device name, CC, memory, pinned round trip; the TensorRT "
                    "backend's KV commit (cudaMemcpy2DAsync) vs CuPy slices, fp16/fp32, several L/H/D/S/T/past_len",
            "commands": ["python tools/gpu/gpu_kit.py exec tools/gpu/gpu_check_cuda.py"]}


def runner_graphs_plan(ctx: Ctx) -> dict:
    return {"what": "TrtRunner with real libcudart and CUDA graphs around a stand-in engine whose contexts launch CuPy "
                    "kernels on the bound tensors: target + draft interleaved on one stream and scratch, rollbacks, "
                    "all-rows / last-row logits, device argmax; bit-equal to a numpy model, with and without graphs, "
                    "every width captured",
            "commands": ["python tools/gpu/gpu_kit.py exec tools/gpu/gpu_check_graphs.py"]}


def script_check(ctx: Ctx, script: str) -> dict:
    """Run one of the `ok  ` / `FAIL` line-per-check scripts (tools/gpu/gpu_check_cuda.py, gpu_check_graphs.py)."""
    cmd = ctx.kit_cmd("exec", TOOLS / script)
    p = ctx.sh(cmd, timeout=120)
    lines = p.stdout.splitlines()
    fails = [line for line in lines if line.startswith("FAIL")]
    return {"passed": p.returncode == 0, "command": ctx.show(cmd), "checks": sum(line[:4] in ("ok  ", "FAIL")
                                                                                 for line in lines),
            "failed": fails, "output_tail": (p.stdout + p.stderr)[-2000:],
            "summary": lines[-1] if lines else f"exit {p.returncode}: {p.stderr[-300:]}"}


# Every way the kit runs a bundle: name -> (backend, precision, tolerance name, CUDA graphs, TF32 off)
CONFIGS = {c.name: c for c in (
    Config("ort-cpu/fp32", "ort-cpu", None, "fp32"),
    Config("ort-cpu/fp16", "ort-cpu", "fp16", "fp16"),
    Config("ort-cpu/int4", "ort-cpu", None, "fp32"),
    Config("ort-cuda/fp32", "ort-cuda", None, "fp32", tf32_off=True),
    Config("ort-cuda/tf32", "ort-cuda", None, "tf32"),
    Config("ort-cuda/fp16", "ort-cuda", "fp16", "fp16"),
    Config("ort-cuda/int4", "ort-cuda", None, "int4"),
    Config("trt/fp16", "trt", "fp16", "fp16", graphs=False),
    Config("trt-graphs/fp16", "trt", "fp16", "fp16", graphs=True),
    Config("ort-trt/fp32", "ort-trt", None, "tf32"),
    # the int4-qdq bundle's fp16 graph (INT4 DequantizeLinear) / its weight-only INT4 engines vs its int4 goldens
    Config("ort-cpu/int4-fp16", "ort-cpu", "fp16", "int4-fp16"),
    Config("ort-cuda/int4-fp16", "ort-cuda", "fp16", "int4-fp16"),
    Config("trt/int4", "trt", "fp16", "int4-fp16"),
)}
