"""The GPU kit's checks: one table (:func:`checks`), each entry with what it needs, what it would do (its plan,
printed when it is skipped) and how it runs. :func:`run_all` runs the table in order and builds the report.

Statuses: passed | failed | error (raised) | skipped (with the reason: no GPU, a missing library, a check it
depends on failed, the time budget, not selected). CPU checks run everywhere; GPU checks need a GPU the CUDA
runtime sees (and not --dry-run)."""

from __future__ import annotations

import inspect
import json
import shutil
import sys
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import gpu_kit_goldens as gg
import gpu_kit_trt as kt
from gpu_kit_runs import (
    CONFIGS,
    Config,
    Skip,
    cuda_binding_plan,
    greedy,
    greedy_plan,
    nan_cache,
    nan_cache_plan,
    parity,
    parity_plan,
    runner_graphs_plan,
    script_check,
    validate,
    validate_plan,
)

TOOLS = Path(__file__).resolve().parent


@dataclass
class Ctx:
    kit: Path
    work: Path
    meta: dict
    env: dict
    caps: dict[str, bool]
    why: dict[str, str]
    dry_run: bool
    deadline: float
    greedy: dict = field(default_factory=dict)
    results: dict[str, dict] = field(default_factory=dict)

    @classmethod
    def create(cls, kit: Path, work: Path, dry_run: bool, budget_s: float, libs: dict, specedge: str) -> Ctx:
        meta = json.loads((kit / "kit.json").read_text())
        shutil.rmtree(work / "bundles", ignore_errors=True)
        shutil.copytree(kit / "bundles", work / "bundles")  # builds write engines and manifests: not into the kit
        env, caps, why = probe(dry_run, libs)
        env["specedge"] = specedge
        greedy = json.loads((kit / "goldens" / "greedy.json").read_text())
        return cls(kit, work, meta, env, caps, why, dry_run, time.monotonic() + budget_s, greedy)

    # paths and commands
    def bundle(self, name: str) -> Path:
        return self.work / "bundles" / name

    def goldens(self, name: str) -> Path:
        return self.kit / self.meta["bundles"][name]["goldens"]

    def kit_cmd(self, *args: Any) -> list[str]:
        return [sys.executable, str(TOOLS / "gpu_kit.py"), *map(str, args)]

    def spec_export(self, *args: Any) -> list[str]:
        return self.kit_cmd("spec-export", *args)

    @staticmethod
    def show(cmd: list[str]) -> str:
        return " ".join(["python tools/gpu/gpu_kit.py", *cmd[2:]]) if cmd[1].endswith("gpu_kit.py") else " ".join(cmd)

    def sh(self, cmd: list[str], timeout: float) -> Any:
        import os

        left = max(10.0, min(timeout, self.deadline + 50 - time.monotonic()))
        return kt.run_capture(cmd, left, dict(os.environ))

    def load_decoder(self, bundle: str, backend: str, precision: str | None, cuda_graphs: bool | None = None) -> Any:
        from specedge.runtime import SpecDecoder

        kw = {} if cuda_graphs is None else {"cuda_graphs": cuda_graphs}
        return SpecDecoder.load(self.bundle(bundle), backend=backend, precision=precision, verify="size", **kw)


@dataclass(frozen=True)
class Check:
    id: str
    gpu: bool
    needs: tuple[str, ...]
    plan: Callable[[Ctx], dict]
    run: Callable[[Ctx], dict]
    after: tuple[str, ...] = ()  # checks that must have passed first
    na: str | None = None  # never runs in this kit: the reason reported (where it is checked instead)


# ------------------------------------------------------------------ environment
def probe(dry_run: bool, libs: dict[str, str]) -> tuple[dict, dict[str, bool], dict[str, str]]:
    """What this machine has (specedge's doctor report + CuPy, cuda-python, torch, the API this checkout offers)
    and, per capability a check may need, whether it is here and why not."""
    from importlib import metadata, util

    from specedge.runtime import SpecDecoder
    from specedge.runtime.backends import open_runner, tensorrt_version_problem
    from specedge.runtime.backends import ort as ort_backend
    from specedge.runtime.backends.trt import TrtRunner
    from specedge.runtime.doctor import report

    rep = report()
    caps, why = {}, {}
    cuda = rep["cuda"]
    caps["gpu"] = bool(cuda.get("ok")) and not dry_run
    why["gpu"] = "--dry-run" if cuda.get("ok") else str(cuda.get("why", "the CUDA runtime sees no GPU"))
    trt = rep["tensorrt"]
    problem = tensorrt_version_problem(trt) if trt and not trt.startswith("broken") else None
    caps["tensorrt"] = bool(trt) and not trt.startswith("broken") and problem is None
    why["tensorrt"] = problem or rep["backends"]["trt"]["why"]
    for b in ("ort-cuda", "ort-trt"):
        caps[b], why[b] = rep["backends"][b]["ok"], rep["backends"][b]["why"]
    env: dict[str, Any] = {"doctor": rep, "tensorrt_version_problem": problem, "libraries": libs}
    try:
        import cupy

        n = cupy.cuda.runtime.getDeviceCount()
        env["cupy"] = {"version": cupy.__version__, "devices": n}
        caps["cupy"], why["cupy"] = n > 0, f"CuPy {cupy.__version__} sees no GPU"
    except Exception as e:  # noqa: BLE001 - ImportError, or a CUDA error from a CuPy without a driver
        env["cupy"] = None
        caps["cupy"], why["cupy"] = False, f"CuPy is not usable ({type(e).__name__}: {str(e)[:200]})"
    for dist in ("cuda-python", "torch", "onnxruntime-gpu", "onnx", "tensorrt"):
        try:
            env.setdefault("distributions", {})[dist] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            env.setdefault("distributions", {})[dist] = None
    env["cuda_python_importable"] = util.find_spec("cuda") is not None
    api = {"SpecDecoder.load(cuda_graphs=)": "cuda_graphs" in inspect.signature(SpecDecoder.load).parameters,
           "open_runner(cuda_graphs=)": "cuda_graphs" in inspect.signature(open_runner).parameters,
           "TrtRunner(cuda_graphs=)": "cuda_graphs" in inspect.signature(TrtRunner.__init__).parameters,
           "OrtRunner zeroes its device cache (zero_device_cache)": hasattr(ort_backend, "zero_device_cache"),
           "spec-export validate --goldens": util.find_spec("specedge.export.validate") is not None
           and "goldens" in _validate_fields()}
    env["api"] = api
    caps["cuda_graphs"] = api["SpecDecoder.load(cuda_graphs=)"]
    why["cuda_graphs"] = ("this checkout's SpecDecoder.load has no cuda_graphs option (the TensorRT CUDA-graphs change "
                          "has not landed here)")
    for lib in ("polygraphy", "click", "tokenizers", "jinja2"):
        caps[lib] = not str(libs.get(lib, "missing")).startswith("missing")
        why[lib] = f"{lib} {libs.get(lib)} (and the kit's copy did not help)"
    try:  # the int4-qdq parser-rules check loads its graphs with onnx (the kit does not carry it)
        import onnx

        caps["onnx"], why["onnx"] = True, f"onnx {onnx.__version__}"
    except Exception as e:  # noqa: BLE001
        caps["onnx"], why["onnx"] = False, f"onnx is not importable ({type(e).__name__}: {str(e)[:200]})"
    caps["ort-qdq"], why["ort-qdq"] = _ort_qdq()
    return env, caps, why


def _ort_qdq() -> tuple[bool, str]:
    """Whether this ONNX Runtime opens --quant-form qdq bundles (the runtime refuses one that would not fuse
    their DequantizeLinear + MatMul into MatMulNBits)."""
    import onnxruntime as ort

    from specedge.runtime.errors import BackendUnavailableError

    try:
        from specedge.runtime.backends.ort import qdq_runtime_check

        qdq_runtime_check(ort.__version__)
    except BackendUnavailableError as e:
        return False, str(e)
    except ImportError:
        return False, "this checkout's ONNX Runtime backend has no qdq_runtime_check (no --quant-form qdq support)"
    return True, f"onnxruntime {ort.__version__}"


def _validate_fields() -> list[str]:
    import dataclasses

    from specedge.export.validate import ValidateOptions

    return [f.name for f in dataclasses.fields(ValidateOptions)]


def environment(ctx: Ctx) -> dict:
    d = ctx.env["doctor"]
    c = d["cuda"]
    gpu = (f"{c['gpu']} (CC {c['compute_capability']}, driver {c['driver']}, runtime {c['runtime']})" if c.get("ok")
           else f"no GPU ({c.get('why')})")
    summary = (f"{gpu}; TensorRT {d['tensorrt'] or 'absent'}; ONNX Runtime {d['onnxruntime']} "
               f"[{', '.join(p.replace('ExecutionProvider', '') for p in d['ort_providers'])}]; CuPy "
               f"{(ctx.env['cupy'] or {}).get('version', 'absent')}; cuda_graphs option: "
               f"{'yes' if ctx.caps['cuda_graphs'] else 'no'}; specedge: {ctx.env['specedge']}")
    return {"passed": True, "summary": summary, **ctx.env, "capabilities": ctx.caps,
            "missing": {k: ctx.why[k] for k, v in ctx.caps.items() if not v}}


def integrity(ctx: Ctx) -> dict:
    """Every kit file against kit.json (sha256, bytes); every bundle's manifest hashes; goldens recorded from
    these graphs at these widths."""
    from gpu_kit_prepare import sha256

    from specedge.runtime.manifest import read_manifest

    bad = []
    for rel, f in ctx.meta["files"].items():
        p = ctx.kit / rel
        if not p.is_file():
            bad.append(f"{rel}: missing")
        elif p.stat().st_size != f["bytes"] or sha256(p) != f["sha256"]:
            bad.append(f"{rel}: differs from kit.json (sha256/bytes)")
    for name, b in ctx.meta["bundles"].items():
        m = read_manifest(ctx.bundle(name), verify="sha256")
        meta, logits = gg.load(ctx.goldens(name))
        if meta["graphs"] != {r: m.files[e.graph]["sha256"] for r, e in m.models.items()}:
            bad.append(f"{b['goldens']}: recorded from other graphs than bundles/{name}")
        if meta["widths"] != {r: [[w.T, w.L] for w in e.widths] for r, e in m.models.items()}:
            bad.append(f"{b['goldens']}: widths differ from bundles/{name}")
    return {"passed": not bad, "problems": bad, "files": len(ctx.meta["files"]),
            "summary": f"{len(ctx.meta['files'])} files, {len(ctx.meta['bundles'])} bundles"
                       + (f"; {len(bad)} problem(s): {bad[:3]}" if bad else ": all hashes match")}


# ------------------------------------------------------------------ the table
NEEDS = {"ort-cpu": (), "ort-cuda": ("ort-cuda",), "trt": ("tensorrt", "tokenizers", "jinja2"),
         "ort-trt": ("ort-trt",)}


def _needs(cfg: Config, qdq: bool = False) -> tuple[str, ...]:
    base = ("tokenizers", "jinja2") if not cfg.tf32_off else ()  # SpecDecoder.load reads the tokenizer
    ort_qdq = ("ort-qdq",) if qdq and cfg.backend.startswith("ort") else ()  # ONNX Runtime opening a qdq bundle
    return tuple(dict.fromkeys((*NEEDS[cfg.backend], *base, *(("cuda_graphs",) if cfg.graphs else ()), *ort_qdq)))


def checks(ctx: Ctx) -> list[Check]:
    """Every check, in the order it runs: CPU checks, then the cheap and fundamental GPU ones; TensorRT builds
    before what uses their engines; ONNX Runtime's TensorRT EP (it builds engines on first use) last."""
    fp = [b for b, m in ctx.meta["bundles"].items() if m["weights"] == "fp32"]
    q = [b for b, m in ctx.meta["bundles"].items() if m["weights"] != "fp32"]
    qdq = [b for b in q if ctx.meta["bundles"][b].get("quant_form") == "qdq"]  # int4 as standard ONNX: TensorRT too
    nbits = [b for b in q if b not in qdq]  # int4 as MatMulNBits: ONNX Runtime only
    first, by = fp[0], CONFIGS
    same_models = next((b for b in fp if ctx.meta["bundles"][b]["drafter"] == "model"), None)  # int4-qdq's, in fp16
    out = [Check("environment", False, (), lambda c: {"what": "GPU, CUDA, TensorRT, ONNX Runtime, CuPy, API"},
                 environment),
           Check("kit-integrity", False, (), lambda c: {"what": "sha256 of every kit file and bundle"}, integrity)]

    def par(cfg: Config, b: str, gpu: bool, after: tuple[str, ...] = ()) -> Check:
        return Check(f"parity/{cfg.name}/{b}", gpu, _needs(cfg, b in qdq), lambda c: parity_plan(c, b, cfg),
                     lambda c: parity(c, b, cfg), after)

    def gre(cfg: Config, b: str, gpu: bool, after: tuple[str, ...] = ()) -> Check:
        return Check(f"greedy/{cfg.name}/{b}", gpu, _needs(cfg, b in qdq), lambda c: greedy_plan(c, b, cfg),
                     lambda c: greedy(c, b, cfg), after)

    def val(cand: str, b: str, gpu: bool, needs: tuple[str, ...], after: tuple[str, ...] = ()) -> Check:
        return Check(f"validate/{cand}/{b}", gpu, (*needs, "polygraphy", "click"),
                     lambda c: validate_plan(c, b, cand), lambda c: validate(c, b, cand), after)

    # CPU: the goldens replayed where they were made (proves them and this code), greedy, validate
    out += [par(by["ort-cpu/fp32"], b, False) for b in fp] + [par(by["ort-cpu/int4"], b, False) for b in q]
    out += [par(by["ort-cpu/fp16"], b, False) for b in fp] + [par(by["ort-cpu/int4-fp16"], b, False) for b in qdq]
    out += [gre(by["ort-cpu/fp32"], b, False) for b in fp] + [gre(by["ort-cpu/int4"], b, False) for b in q]
    out += [val("ort-fp16", b, False, ()) for b in fp]
    out += [Check(f"trt-parser/{b}", False, ("onnx",), lambda c, b=b: kt.parser_rules_plan(c, b),
                  lambda c, b=b: kt.parser_rules(c, b)) for b in qdq]  # TensorRT's input, checked on the CPU
    # GPU without TensorRT: the CUDA binding, ONNX Runtime CUDA
    out.append(Check("cuda-binding", True, ("cupy",), cuda_binding_plan,
                     lambda c: script_check(c, "gpu_check_cuda.py")))
    out.append(Check("trt-runner-graphs", True, ("cupy",), runner_graphs_plan,
                     lambda c: script_check(c, "gpu_check_graphs.py")))
    for prec in (None, "fp16"):
        out.append(Check(f"nan-cache/ort-cuda/{prec or 'fp32'}/{first}", True, ("ort-cuda", "tokenizers", "jinja2"),
                         lambda c, p=prec: nan_cache_plan(c, first, p), lambda c, p=prec: nan_cache(c, first, p)))
    out += [par(by["ort-cuda/fp32"], b, True) for b in fp] + [par(by["ort-cuda/tf32"], first, True)]
    out += [par(by["ort-cuda/fp16"], b, True) for b in fp] + [par(by["ort-cuda/int4"], b, True) for b in nbits]
    out += [par(by["ort-cuda/int4-fp16"], b, True) for b in qdq]
    out += [gre(by["ort-cuda/tf32"], b, True) for b in fp] + [gre(by["ort-cuda/fp16"], first, True)]
    out += [gre(by["ort-cuda/int4"], b, True) for b in nbits] + [gre(by["ort-cuda/int4-fp16"], b, True) for b in qdq]
    out += [val("ort-cuda-fp16", first, True, ("ort-cuda",))]
    # TensorRT: fp16 engines of the fp32 bundles, weight-only INT4 engines of the int4-qdq bundle
    for b in fp:
        out.append(Check(f"trt-build/{b}", True, ("tensorrt", "click"), lambda c, b=b: kt.build_plan(c, b),
                         lambda c, b=b: kt.build(c, b)))
    for b in qdq:
        out.append(Check(f"trt-build/{b}", True, ("tensorrt", "click"), lambda c, b=b: kt.build_plan(c, b, same_models),
                         lambda c, b=b: kt.build(c, b, same_models), (f"trt-parser/{b}",) if ctx.caps["onnx"] else ()))
    out += [Check(f"trt-build/{b}", True, (), lambda c: {"what": "nothing"}, lambda c: {}, na=int4_on_trt(qdq))
            for b in nbits]
    for b in fp:
        built = (f"trt-build/{b}",)
        out += [par(by["trt/fp16"], b, True, built), par(by["trt-graphs/fp16"], b, True, built),
                gre(by["trt/fp16"], b, True, built), val("trt", b, True, ("tensorrt",), built)]
    for b in qdq:
        built = (f"trt-build/{b}",)
        out += [par(by["trt/int4"], b, True, built), gre(by["trt/int4"], b, True, built)]
    built = (f"trt-build/{first}",)
    out.append(gre(by["trt-graphs/fp16"], first, True, built))
    out.append(Check(f"step-times/trt/{first}", True, ("tensorrt", "tokenizers", "jinja2"),
                     lambda c: kt.step_times_plan(c, first, "trt", "fp16"),
                     lambda c: kt.step_times(c, first, "trt", "fp16"), built))
    out.append(Check(f"step-times/ort-cuda/{first}", True, ("ort-cuda", "tokenizers", "jinja2"),
                     lambda c: kt.step_times_plan(c, first, "ort-cuda", None),
                     lambda c: kt.step_times(c, first, "ort-cuda", None)))
    out.append(Check(f"trt-profiles/{first}", True, ("tensorrt",), lambda c: kt.sizes_plan(c, first),
                     lambda c: kt.sizes(c, first), built))
    out += [par(by["ort-trt/fp32"], b, True) for b in fp] + [gre(by["ort-trt/fp32"], first, True)]
    return out


def int4_on_trt(qdq: list[str]) -> str:
    """Why a MatMulNBits int4 bundle has no TensorRT build, and where int4 on TensorRT is checked instead."""
    where = (f"int4 on TensorRT is checked on the {', '.join(qdq)} bundle (--quant-form qdq: INT4 DequantizeLinear, "
             "weight-only INT4 engines): " + ", ".join(f"trt-build/{b}, parity/trt/int4/{b}, greedy/trt/int4/{b}"
                                                      for b in qdq) if qdq else
             "not applicable: this kit has no --quant-form qdq bundle to build int4 engines from")
    return (f"{where}; this bundle's MatMulNBits is an ONNX Runtime contrib op that TensorRT's parser does not take "
            "(checked on ort-cpu and ort-cuda)")


# ------------------------------------------------------------------ running
def _skip_reason(ctx: Ctx, c: Check, only: list[str] | None) -> str | None:
    if only and c.id not in ("environment", "kit-integrity") and not any(s in c.id for s in only):
        return "not selected (--only)"
    if c.na:
        return c.na
    if c.gpu and not ctx.caps["gpu"]:
        return f"no GPU ({ctx.why['gpu']})"
    for need in c.needs:
        if not ctx.caps.get(need, False):
            return f"{need}: {ctx.why.get(need, 'not available')}"
    for dep in c.after:
        st = ctx.results.get(dep, {}).get("status")
        if st != "passed":
            return f"needs {dep}, which {st or 'did not run'}"
    if time.monotonic() > ctx.deadline:
        return "the time budget is spent (--budget-s)"
    return None


def run_all(ctx: Ctx, only: str | None = None, say: Callable[[str], None] = print,
            write: Callable[[dict], None] | None = None) -> dict:
    """Run every check in order; `write` gets the report so far after each one (a run killed from outside still
    leaves a report)."""
    t0 = time.perf_counter()
    sel = [s for s in only.split(",") if s] if only else None
    mode = "dry-run" if ctx.dry_run else ("gpu" if ctx.caps["gpu"] else "no-gpu")
    say(f"GPU kit check: {ctx.kit} ({mode}); work {ctx.work}")

    def report(done: bool) -> dict:
        counts = {s: sum(r["status"] == s for r in ctx.results.values()) for s in ("passed", "failed", "error",
                                                                                     "skipped")}
        return {"kit": str(ctx.kit), "kit_created": ctx.meta.get("created"), "kit_git": ctx.meta.get("git"),
                "mode": mode, "complete": done, "work": str(ctx.work), "seconds": round(time.perf_counter() - t0, 1),
                "counts": counts, "passed": done and counts["failed"] == counts["error"] == 0,
                "checks": list(ctx.results.values())}

    for c in checks(ctx):
        t = time.perf_counter()
        why = _skip_reason(ctx, c, sel)
        res: dict[str, Any] = {}
        if why is None:
            try:
                res = c.run(ctx)
                status = "passed" if res.get("passed") else "failed"
            except Skip as e:
                why = str(e)
            except Exception as e:  # noqa: BLE001 - one broken check must not stop the others
                status = "error"
                res = {"error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()[-3000:],
                       "summary": f"{type(e).__name__}: {str(e)[:300]}"}
        if why is not None:
            status, res = "skipped", {"reason": why, "plan": c.plan(ctx)}
        entry = {"id": c.id, "kind": "gpu" if c.gpu else "cpu", "status": status,
                 "seconds": round(time.perf_counter() - t, 2), **res}
        ctx.results[c.id] = entry
        _print(say, entry)
        if write:
            write(report(False))
    rep = report(True)
    n = rep["counts"]
    say(f"\n{n['passed']} passed, {n['failed']} failed, {n['error']} errors, {n['skipped']} skipped "
        f"in {rep['seconds']:.0f}s" + ("" if ctx.caps["gpu"] else f" (no GPU: {ctx.why['gpu']})"))
    if write:
        write(rep)
    return rep


def _print(say: Callable[[str], None], e: dict) -> None:
    tag = {"passed": "PASS", "failed": "FAIL", "error": "ERR ", "skipped": "SKIP"}[e["status"]]
    if e["status"] != "skipped":
        say(f"{tag} {e['kind']:<3} {e['id']} ({e['seconds']}s): {e.get('summary', '')}")
        return
    say(f"{tag} {e['kind']:<3} {e['id']}: skipped: {e['reason']}")
    for k, v in e["plan"].items():
        for line in (v if isinstance(v, list) else [v]):
            say(f"         {k}: {line if not isinstance(line, dict) else json.dumps(line)}")
