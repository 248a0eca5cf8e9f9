"""`spec-export validate`: a candidate graph against the fp32 ONNX Runtime reference, with polygraphy.

Two checks, on real inputs recorded from real prompts:

1. **Per graph** (polygraphy ``Comparator.compare_accuracy``, per-output tolerances): for every
   model of the bundle, the inputs of a prefill chunk, a verify step (target) and a decode step,
   each with the KV cache filled by the preceding prompt, are recorded by running the fp32 graph
   with the specedge runtime; the reference (ONNX Runtime fp32, CPU) and the candidate (the
   bundle's fp16 ONNX graph on ONNX Runtime, or its TensorRT engine, one polygraphy runner per
   optimization profile) run them; ``logits`` and the real rows of every ``present.*`` output are
   compared (rows of a chunk's padding are computed but never committed, so they are not checked).
2. **Per model, greedy**: the reference's greedy continuation of every prompt is fed to the
   candidate token by token (teacher forcing, so one early difference does not derail the rest)
   and the candidate's top-1 is compared with the reference's next token. Where they differ, the
   reference's top-2 logit gap is reported: a small gap is a near-tie, a large one is a bug.

Goldens (recorded inputs, reference outputs and greedy tokens) can be saved in one run and
compared in another (``--save-goldens`` / ``--goldens``): a small device then never holds the
fp32 reference and the candidate at once. The report is JSON; the exit status says pass/fail.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from specedge.runtime.drafters import feed
from specedge.runtime.errors import BundleError
from specedge.runtime.manifest import QDQ_FORMAT, Manifest, read_manifest
from specedge.runtime.text import TextCodec

DEFAULT_PROMPTS = (
    "Write a Python function that returns the n-th Fibonacci number iteratively, with a docstring.",
    "Explain in two sentences why the sky is blue.",
    "Summarize: The meeting moved the launch from May to June because the supplier delayed the parts, "
    "and the budget stays the same.",
)
CANDIDATES = ("ort-fp16", "ort-cuda-fp16", "trt")
GOLDENS_VERSION = 2


@dataclass(frozen=True)
class Tolerance:
    """atol + scale * max|reference| (per output tensor) and rtol, checked per element by polygraphy.

    The scale term is the storage precision at the tensor's own magnitude: Qwen's keys reach |k| ~ 360
    (their bias), where fp16 is only good to 0.25, so a fixed atol would flag rounding, not bugs."""

    atol: float
    rtol: float
    scale: float = 0.0
    stat: str = "elemwise"  # polygraphy check_error_stat: elemwise | max | mean | median

    def atol_for(self, reference: np.ndarray) -> float:
        return float(self.atol + self.scale * (np.abs(reference).max() if reference.size else 0.0))

    def to_json(self) -> dict:
        return {"atol": self.atol, "rtol": self.rtol, "scale": self.scale, "stat": self.stat}


# Defaults, per candidate precision. An element fails only if it is off by more than atol AND by more
# than rtol x |reference| (polygraphy's elementwise rule). Measured on SmolLM2-135M, fp16 graph on ONNX
# Runtime CPU: logits max |d| <= 0.027, KV rows max |d| <= 0.041 (values up to ~14); Qwen2.5-Coder
# 1.5B / 0.5B: logits <= 0.032, KV <= 0.15 (keys up to ~360: 2^-9 x 360 = 0.7 of scale room). ONNX
# Runtime CPU widens fp16 to fp32 inside most kernels; TensorRT accumulates in fp16 tiles too.
DEFAULT_TOLERANCES = {
    "fp16": {"logits": Tolerance(0.5, 0.05), "present": Tolerance(0.05, 0.05, scale=2 ** -9)},
    "bf16": {"logits": Tolerance(2.0, 0.1), "present": Tolerance(0.25, 0.1, scale=2 ** -6)},
}


@dataclass
class ValidateOptions:
    candidate: str = "ort-fp16"
    precision: str | None = None  # trt: which engines (None: the only ones built); ort-*: fp16
    prompts: tuple[str, ...] = DEFAULT_PROMPTS
    chat: bool = True
    tokens: int = 24  # greedy tokens per prompt
    logits: Tolerance | None = None  # None: DEFAULT_TOLERANCES[precision]
    present: Tolerance | None = None
    min_agreement: float = 0.95  # teacher-forced top-1 agreement with the reference, per model
    goldens: Path | None = None  # compare against these instead of running the reference
    save_goldens: Path | None = None
    threads: int | None = None

    def __post_init__(self) -> None:
        if self.candidate not in CANDIDATES:
            raise BundleError(f"--candidate {self.candidate!r}: choose one of {', '.join(CANDIDATES)}")
        if self.tokens < 1 or not self.prompts:
            raise BundleError("validation needs at least one prompt and --tokens >= 1")
        if not 0 <= self.min_agreement <= 1:
            raise BundleError(f"--min-agreement must be in [0, 1], got {self.min_agreement}")


@dataclass
class Case:
    role: str
    name: str  # prefill | verify | decode
    T: int
    feed: dict[str, np.ndarray]
    reference: dict[str, np.ndarray] = field(default_factory=dict)
    n: int = 0  # real tokens (rows >= n of present.* are padding: computed, never committed, not compared)

    def real(self, outputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        """The outputs restricted to what the runtime uses: present.* rows < n (logits rows are all used)."""
        return {k: np.ascontiguousarray(v[:, :, :self.n] if k.startswith("present.") else v)
                for k, v in outputs.items()}


@dataclass
class Greedy:
    role: str
    prompt: list[int]
    tokens: list[int]  # the reference's greedy continuation
    gaps: list[float]  # the reference's top-1 minus top-2 logit at each of them


# ------------------------------------------------------------------ recording (reference side)
def record(bundle_dir: Path, manifest: Manifest, opts: ValidateOptions, say: Callable[[str], None]
           ) -> tuple[list[Case], list[Greedy]]:
    """Run the fp32 graphs with the runtime (ONNX Runtime, CPU) on the prompts: graph inputs of a prefill
    chunk, a verify step and a decode step of the first prompt, and every prompt's greedy continuation."""
    from specedge.runtime.backends.ort import OrtRunner

    codec = TextCodec(bundle_dir, manifest.tokenizer)
    prompts = [codec.encode(codec.render_chat([{"role": "user", "content": p}]), add_bos=False) if opts.chat
               else codec.encode(p) for p in opts.prompts]
    cases, greedy = [], []
    P, K = manifest.prefill_chunk, manifest.k
    for role in manifest.models:
        runner = OrtRunner(bundle_dir, manifest, role, threads=opts.threads, accuracy_level=0)
        try:
            for i, ids in enumerate(prompts):
                need = len(ids) + opts.tokens + K + 1
                if need > manifest.max_context:
                    raise BundleError(f"prompt {i + 1} needs {need} positions, the bundle holds {manifest.max_context}")
                # prefill in chunks of P; for the first prompt the last chunk is recorded, and it starts at
                # len - P (or half way for a short prompt) so that it too runs over a filled cache
                split = len(ids) - P if len(ids) > P else len(ids) // 2
                starts = [*range(0, split, P), split] if i == 0 else list(range(0, len(ids), P))
                logits = None
                for j, start in enumerate(starts):
                    end = starts[j + 1] if j + 1 < len(starts) else len(ids)
                    chunk = ids[start:min(end, start + P)]
                    if i == 0 and j == len(starts) - 1:
                        f = runner.feed(chunk, start, False)
                        cases.append(Case(role, "prefill", f["input_ids"].shape[1], f, n=len(chunk)))
                    logits = runner.step(chunk, start, all_logits=False)
                toks, gaps, pos = [], [], len(ids)
                for _ in range(opts.tokens):  # plain greedy decoding, one token per step
                    top2 = np.partition(logits[-1], -2)[-2:]
                    toks.append(int(np.argmax(logits[-1])))
                    gaps.append(float(top2[1] - top2[0]))
                    logits = runner.step([toks[-1]], pos, all_logits=False)
                    pos += 1
                greedy.append(Greedy(role, list(ids), toks, gaps))
                if i == 0:  # a verify step (target) and a decode step over the filled cache
                    extra = (toks + toks)[:K + 1]
                    if role == "target":
                        f = runner.feed(extra, pos, True)
                        cases.append(Case(role, "verify", f["input_ids"].shape[1], f, n=len(extra)))
                        runner.step(extra, pos, all_logits=True)
                        pos += len(extra)
                    f = runner.feed([toks[-1]], pos, False)
                    cases.append(Case(role, "decode", f["input_ids"].shape[1], f, n=1))
            say(f"{role}: recorded {sum(c.role == role for c in cases)} graph inputs and "
                f"{sum(len(g.tokens) for g in greedy if g.role == role)} greedy tokens")
        finally:
            runner.close()
    return cases, greedy


def _weight_only_session(path: Path, providers: list[str]) -> Callable[[], Any]:
    """An ONNX Runtime session loader whose fused int4/int8 MatMulNBits (qdq graphs) compute in fp32
    (accuracy level 0): the numerics of a weight-only engine, without ONNX Runtime's int8 activation rounding."""
    import onnxruntime as ort

    def load() -> Any:
        so = ort.SessionOptions()
        so.add_session_config_entry("session.qdq_matmulnbits_accuracy_level", "0")
        return ort.InferenceSession(str(path), so, providers=providers)

    return load


def run_reference(bundle_dir: Path, manifest: Manifest, cases: list[Case], say: Callable[[str], None]) -> None:
    """Fill each case's reference outputs with polygraphy's ONNX Runtime runner on the fp32 graph (CPU). A
    --quant-form qdq graph runs with fp32 compute (accuracy level 0): its int4 weights, no int8 activations —
    the reference a weight-only INT4 engine is held to."""
    from polygraphy.backend.onnxrt import OnnxrtRunner

    for role, e in manifest.models.items():
        runner = OnnxrtRunner(_weight_only_session(bundle_dir / e.graph, ["CPUExecutionProvider"]),
                              name=f"ort-fp32-{role}")
        with runner:
            for c in (c for c in cases if c.role == role):
                c.reference = c.real({k: np.asarray(v, dtype=np.float32) for k, v in runner.infer(c.feed).items()})
        say(f"{role}: reference outputs computed (ONNX Runtime fp32, CPU)")


# ------------------------------------------------------------------ goldens
def save_goldens(path: Path, bundle_dir: Path, manifest: Manifest, cases: list[Case], greedy: list[Greedy],
                 opts: ValidateOptions) -> None:
    arrays: dict[str, np.ndarray] = {}
    meta = {"version": GOLDENS_VERSION, "bundle": str(bundle_dir),
            "graphs": {r: manifest.files[e.graph]["sha256"] for r, e in manifest.models.items()},
            "cases": [], "greedy": [], "prompts": list(opts.prompts), "chat": opts.chat}
    for j, c in enumerate(cases):
        meta["cases"].append({"role": c.role, "name": c.name, "T": c.T, "n": c.n})
        for k, v in c.feed.items():
            arrays[f"c{j}/in/{k}"] = v
        for k, v in c.reference.items():
            arrays[f"c{j}/out/{k}"] = v
    for g in greedy:
        meta["greedy"].append({"role": g.role, "prompt": g.prompt, "tokens": g.tokens, "gaps": g.gaps})
    arrays["meta"] = np.frombuffer(json.dumps(meta).encode(), dtype=np.uint8)
    tmp = Path(str(path) + ".tmp.npz")
    np.savez_compressed(tmp, **arrays)
    tmp.replace(path)


def load_goldens(path: Path, manifest: Manifest) -> tuple[list[Case], list[Greedy], dict]:
    if not Path(path).is_file():
        raise BundleError(f"goldens file {path} does not exist; make it with --save-goldens")
    try:
        z = np.load(path)
        meta = json.loads(bytes(z["meta"]).decode())
    except (OSError, ValueError, KeyError) as e:
        raise BundleError(f"{path} is not a specedge goldens file: {e}") from e
    if meta.get("version") != GOLDENS_VERSION:
        raise BundleError(f"{path} is goldens format {meta.get('version')}, this specedge reads {GOLDENS_VERSION}")
    mine = {r: manifest.files[e.graph]["sha256"] for r, e in manifest.models.items()}
    if meta["graphs"] != mine:
        raise BundleError(f"{path} was recorded from other graphs than this bundle's (fp32 graph sha256 differ); "
                          "record goldens from this bundle")
    cases = []
    for j, c in enumerate(meta["cases"]):
        feed = {k.split("/", 2)[2]: z[k] for k in z.files if k.startswith(f"c{j}/in/")}
        ref = {k.split("/", 2)[2]: z[k] for k in z.files if k.startswith(f"c{j}/out/")}
        cases.append(Case(c["role"], c["name"], c["T"], feed, ref, c["n"]))
    greedy = [Greedy(g["role"], g["prompt"], g["tokens"], g["gaps"]) for g in meta["greedy"]]
    return cases, greedy, meta


# ------------------------------------------------------------------ candidate
def _candidate_runners(bundle_dir: Path, manifest: Manifest, opts: ValidateOptions, role: str,
                       cases: list[Case]) -> Iterator[tuple[Any, list[Case], np.dtype]]:
    """(polygraphy runner, the cases it runs, the KV dtype it takes), one runner per engine profile."""
    if opts.candidate == "trt":
        from polygraphy.backend.trt import EngineFromBytes, TrtRunner

        es = manifest.engine_set("trt", opts.precision)
        if es.kv_dtype != "float16":
            raise NotImplementedError(f"validating {es.precision} TensorRT engines is not implemented: polygraphy's "
                                      "numpy path has no bfloat16; validate the fp16 engines")
        import mmap

        widths = [w.T for w in manifest.models[role].widths]
        with open(bundle_dir / es.graphs[role], "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as plan:
            engine = EngineFromBytes(plan)()  # the map is released right after deserializing
        for p, T in enumerate(widths):
            mine = [c for c in cases if c.T == T]
            if mine:
                yield TrtRunner(engine, name=f"trt-{es.precision}-{role}-T{T}", optimization_profile=p), mine, \
                    np.dtype(np.float16)
        return
    from polygraphy.backend.onnxrt import OnnxrtRunner

    from .engines import build_onnx

    es = build_onnx(bundle_dir, opts.precision or "fp16")
    providers = ["CUDAExecutionProvider", "CPUExecutionProvider"] if opts.candidate == "ort-cuda-fp16" \
        else ["CPUExecutionProvider"]
    sess = _weight_only_session(bundle_dir / es.graphs[role], providers)
    yield OnnxrtRunner(sess, name=f"{opts.candidate}-{role}"), cases, np.dtype(np.float16)


def _runtime_candidate(bundle_dir: Path, manifest: Manifest, opts: ValidateOptions, role: str):
    from specedge.runtime.backends import open_runner

    backend = {"ort-fp16": "ort-cpu", "ort-cuda-fp16": "ort-cuda", "trt": "trt"}[opts.candidate]
    precision = opts.precision or ("fp16" if backend != "trt" else None)
    return open_runner(backend, bundle_dir, manifest, role, opts.threads, precision, {}, accuracy_level=0)


def compare_cases(bundle_dir: Path, manifest: Manifest, cases: list[Case], opts: ValidateOptions,
                  tol: dict[str, Tolerance], say: Callable[[str], None]) -> list[dict]:
    from polygraphy import comparator as pc
    from polygraphy.comparator import Comparator, IterationResult, RunResults
    from polygraphy.logger import G_LOGGER

    simple = getattr(pc, "SimpleCompareFunc", None) or pc.CompareFunc.simple  # the class since polygraphy 0.50

    G_LOGGER.module_severity = G_LOGGER.ERROR  # our summary lines replace polygraphy's per-tensor statistics
    out = []
    for role in manifest.models:
        for runner, mine, kv_dtype in _candidate_runners(bundle_dir, manifest, opts, role,
                                                         [c for c in cases if c.role == role]):
            with runner:
                for c in mine:
                    feed = {k: (v.astype(kv_dtype) if k.startswith("past_key_values.") else v)
                            for k, v in c.feed.items()}
                    got = c.real({k: np.asarray(v, dtype=np.float32) for k, v in runner.infer(feed).items()})
                    names = sorted(c.reference)
                    t = {n: tol["logits" if n == "logits" else "present"] for n in names}
                    func = simple(atol={n: t[n].atol_for(c.reference[n]) for n in names},
                                  rtol={n: t[n].rtol for n in names},
                                  check_error_stat={n: t[n].stat for n in names})
                    results = RunResults()
                    results.append(("reference", [IterationResult(c.reference, runner_name="reference")]))
                    results.append(("candidate", [IterationResult({n: got[n] for n in names},
                                                                  runner_name="candidate")]))
                    acc = Comparator.compare_accuracy(results, compare_func=func)
                    if not hasattr(acc, "values"):  # polygraphy >= 0.50: one AccuracyResult per compare function
                        acc = acc[0]
                    per = next(iter(acc.values()))[0]  # (reference, candidate), iteration 0
                    out.append(_case_summary(c, per, tol))
                    say(_case_line(out[-1]))
    return out


def _case_summary(c: Case, per: dict, tol: dict[str, Tolerance]) -> dict:
    def agg(names: list[str]) -> dict:
        return {"passed": all(bool(per[n]) for n in names),
                "max_absdiff": max(per[n].max_absdiff for n in names),
                "mean_absdiff": float(np.mean([per[n].mean_absdiff for n in names])),
                "max_reldiff": max(per[n].max_reldiff for n in names),
                "failed": sorted(n for n in names if not bool(per[n]))[:8]}

    kv = [n for n in per if n.startswith("present.")]
    return {"role": c.role, "case": c.name, "T": c.T, "n": c.n, "past_len": int(c.feed["past_len"][0]),
            "logits": {**agg(["logits"]), **tol["logits"].to_json()},
            "present": {**agg(kv), **tol["present"].to_json(), "tensors": len(kv)},
            "passed": all(bool(v) for v in per.values())}


def _case_line(s: dict) -> str:
    ok = lambda b: "ok" if b else "FAIL"  # noqa: E731
    lg, kv = s["logits"], s["present"]
    scale = f" + {kv['scale']:.3g} x max|ref|" if kv["scale"] else ""
    return (f"{s['role']} {s['case']} T={s['T']} ({s['n']} real) at {s['past_len']}: "
            f"logits max|d| {lg['max_absdiff']:.4g} mean {lg['mean_absdiff']:.3g} "
            f"(atol {lg['atol']}, rtol {lg['rtol']}) {ok(lg['passed'])}; KV ({kv['tensors']} tensors) max|d| "
            f"{kv['max_absdiff']:.4g} (atol {kv['atol']}{scale}) {ok(kv['passed'])}")


def greedy_agreement(bundle_dir: Path, manifest: Manifest, greedy: list[Greedy], opts: ValidateOptions,
                     say: Callable[[str], None]) -> dict[str, dict]:
    """Teacher-forced top-1 agreement of the candidate (run by the specedge runtime) with the reference."""
    out = {}
    for role in manifest.models:
        runs = [g for g in greedy if g.role == role]
        runner = _runtime_candidate(bundle_dir, manifest, opts, role)
        agree = total = 0
        firsts, mismatches = [], []
        try:
            for k, g in enumerate(runs):
                last = feed(runner, np.array(g.prompt), 0, manifest.prefill_chunk)  # the runtime's own prefill
                pos, first = len(g.prompt), None
                for j, tok in enumerate(g.tokens):
                    top = int(np.argmax(last))
                    if top == tok:
                        agree += 1
                    else:
                        first = j if first is None else first
                        mismatches.append({"prompt": k, "position": j, "reference": tok, "candidate": top,
                                           "reference_top2_gap": round(g.gaps[j], 5)})
                    total += 1
                    last = runner.step([tok], pos, all_logits=False)[0]
                    pos += 1
                firsts.append(first)
        finally:
            runner.close()
        frac = agree / total if total else 1.0
        out[role] = {"tokens": total, "agree": agree, "fraction": round(frac, 4), "first_difference": firsts,
                     "mismatches": mismatches[:20], "passed": frac >= opts.min_agreement,
                     "min_agreement": opts.min_agreement}
        gaps = ", ".join(f"{m['reference_top2_gap']:.3g}" for m in mismatches[:5])
        say(f"{role} greedy: {agree}/{total} top-1 agree ({100 * frac:.1f} %, need {100 * opts.min_agreement:.0f} %)"
            + (f"; reference top-2 gaps where they differ: {gaps}" if mismatches else ""))
    return out


def validate(bundle: str | Path, opts: ValidateOptions = ValidateOptions(),
             progress: Callable[[str], None] | None = None) -> dict:
    """Run both checks; return the JSON report (``report["passed"]`` is the verdict)."""
    say = progress or (lambda s: None)
    t0 = time.perf_counter()
    bundle_dir = Path(bundle)
    manifest = read_manifest(bundle_dir, verify="size")
    if manifest.kv_mode != "portable" or any(e.quant and e.quant.get("format") != QDQ_FORMAT
                                             for e in manifest.models.values()):
        raise BundleError("validate compares reduced-precision graphs and TensorRT engines, which are built from "
                          "fp32 or --quant-form qdq bundles in the portable KV mode; this bundle is "
                          f"{manifest.kv_mode} / {manifest.target.precision}"
                          + (f" ({manifest.target.quant.get('format', 'MatMulNBits')})"
                             if manifest.target.quant else ""))
    precision = opts.precision or ("fp16" if opts.candidate != "trt" else manifest.engine_set("trt").precision)
    base = DEFAULT_TOLERANCES.get(precision, DEFAULT_TOLERANCES["fp16"])
    tol = {"logits": opts.logits or base["logits"], "present": opts.present or base["present"]}
    if opts.goldens:
        cases, greedy, meta = load_goldens(Path(opts.goldens), manifest)
        say(f"goldens {opts.goldens}: {len(cases)} graph inputs, {len(greedy)} greedy runs")
        prompts = meta["prompts"]
    else:
        cases, greedy = record(bundle_dir, manifest, opts, say)
        run_reference(bundle_dir, manifest, cases, say)
        prompts = list(opts.prompts)
        if opts.save_goldens:
            save_goldens(Path(opts.save_goldens), bundle_dir, manifest, cases, greedy, opts)
            say(f"goldens saved to {opts.save_goldens}")
    case_results = compare_cases(bundle_dir, manifest, cases, opts, tol, say)
    agreement = greedy_agreement(bundle_dir, manifest, greedy, opts, say)
    passed = all(c["passed"] for c in case_results) and all(a["passed"] for a in agreement.values())
    return {"bundle": str(bundle_dir), "reference": "ort-cpu fp32", "candidate": opts.candidate,
            "precision": precision, "tolerances": {k: v.to_json() for k, v in tol.items()},
            "prompts": prompts, "cases": case_results, "greedy": agreement, "passed": passed,
            "seconds": round(time.perf_counter() - t0, 1)}
