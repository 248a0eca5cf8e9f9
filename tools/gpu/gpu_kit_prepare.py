"""`python tools/gpu/gpu_kit.py prepare OUT_DIR`: the GPU kit, built on the CPU machine (needs the test extras: torch +
transformers make the tiny random models, exactly as tests/conftest.py does).

OUT_DIR (a few MB, git-ignored as .gpu-kit/):

    kit.json                     what is here: bundles, goldens, tolerances, prompts, every file's sha256
    bundles/model/               tiny random llama target (2 layers, hidden 64, V 320; tests/conftest.py) + its
                                 first layer as the draft: fp32 + fp16 graphs (`spec-export build --backend onnx`)
    bundles/lookup/              the same target with prompt lookup: fp32 + fp16 graphs
    bundles/int4/                target + draft as int4 MatMulNBits (--weights int4 --accuracy-level 0): ONNX
                                 Runtime only (a contrib op), checked on ort-cpu and ort-cuda
    bundles/int4-qdq/            target + draft as int4 in standard ONNX (--weights int4 --quant-form qdq
                                 --kv-mode portable --accuracy-level 0: opset 21 blocked INT4 DequantizeLinear
                                 + MatMul, int8 lm_head) + their fp16 graphs (`spec-export build --backend onnx
                                 --precision fp16`: INT4 DequantizeLinear kept, 8-bit blocks made fp16
                                 constants) — TensorRT's weight-only INT4 input
    goldens/<bundle>.npz         every step of a fixed step script (gpu_kit_goldens) and its logits, run on
                                 ONNX Runtime CPU with the fp32 (int4: the int4, fp32-compute) graphs
    goldens/greedy.json          per bundle: prompts, their token ids, plain greedy tokens and top-2 gaps
    goldens/validate-<b>.npz     `spec-export validate --save-goldens` (recorded graph inputs + fp32 outputs;
                                 the fp32 bundles)
    prompts.jsonl                the prompts (spec-run bench / spec-export validate format)
    pylib.tar.gz                 pure-Python (and abi3) packages the runtime imports, for a GPU machine that
                                 lacks them and cannot download: click, jinja2, markupsafe, polygraphy,
                                 tokenizers (used only where the machine's own import fails)

All bundles: portable KV, K=4, verify widths 2..5 (target widths 1, 2, 3, 4, 5, 16; int8/int4 targets round
them up to even ones: 1, 2, 4, 6, 16; draft 1, 16), S_max 256, prefill P=16.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import sys
import tarfile
import time
from collections.abc import Callable
from pathlib import Path

import gpu_kit_goldens as gg
import numpy as np

ROOT = Path(__file__).resolve().parents[2]
KIT_VERSION = 1
K, VERIFY_WIDTHS, MAX_CONTEXT, PREFILL = 4, (2, 3, 4), 256, 16
GREEDY_TOKENS = 24
# Candidate prompts; prepare keeps the three whose greedy continuations have the widest top-2 gaps (fewest
# near-ties, so a strict token-for-token comparison on another backend is meaningful).
CANDIDATE_PROMPTS = (
    "The quick brown fox jumps over the lazy dog. The quick brown fox",
    "def fib(n):\n    if n < 2:\n        return n",
    "import numpy as np\nx = np.arange(10)",
    "The capital of France is",
    "Speculative decoding lets a cheap draft propose tokens.",
    "héllo wörld — data データ",
    "print(x.sum())",
    "return fib(n - 1) + fib(n - 2)",
    "The lazy dog sleeps. The lazy dog",
    "x = np.arange(10)\nprint(x.sum())\nx = np.arange(10)",
    "Paris is the capital of",
    "A draft proposes, the target verifies.",
    "if n < 2:",
    "ünïcödé ✓ 数据",
    "Write a function that reverses a list.",
    "def add(a, b):\n    return a + b",
)
PYLIB = ("click", "jinja2", "markupsafe", "polygraphy", "tokenizers")
BUNDLES = {  # name -> (draft, weights, quantized form, reduced-precision graphs)
    "model": ("draft", "fp32", None, ("fp16",)),
    "lookup": ("prompt-lookup", "fp32", None, ("fp16",)),
    "int4": ("draft", "int4", "matmulnbits", ()),
    "int4-qdq": ("draft", "int4", "qdq", ("fp16",)),
}


def sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def prepare(out: Path, say: Callable[[str], None] = print, force: bool = False) -> dict:
    """Build the kit into `out` (written beside it, then moved into place)."""
    out = Path(out)
    if out.exists() and not force:
        raise SystemExit(f"{out} exists; pass --force to replace it")
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    (tmp / "goldens").mkdir(parents=True)
    t0 = time.perf_counter()
    hf = _models(tmp / "_hf", say)
    kit = {"version": KIT_VERSION, "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "git": _git_rev(),
           "python": sys.version.split()[0], "layout": {"k": K, "verify_widths": [*VERIFY_WIDTHS, K + 1],
                                                          "max_context": MAX_CONTEXT, "prefill_chunk": PREFILL},
           "bundles": {}, "greedy_tokens": GREEDY_TOKENS,
           "tolerances": {n: {"rel": t.rel, "atol": t.atol, "why": t.why, "rule": t.text()}
                          for n, t in gg.TOLERANCES.items()}}
    for name, (draft, weights, form, reduced) in BUNDLES.items():
        kit["bundles"][name] = _bundle(tmp, hf, name, draft, weights, form, reduced, say)
    greedy = _greedy_goldens(tmp, kit, say)
    (tmp / "goldens" / "greedy.json").write_text(json.dumps(greedy, indent=1) + "\n")
    prompts = greedy["model"]["prompts"]
    (tmp / "prompts.jsonl").write_text("".join(json.dumps({"text": p["text"]}) + "\n" for p in prompts))
    for name, b in kit["bundles"].items():
        if b["weights"] == "fp32" and "fp16" in b["precisions"]:
            b["validate_goldens"], b["validate_cpu"] = _validate_goldens(tmp, name, [p["text"] for p in prompts], say)
    _pylib(tmp / "pylib.tar.gz", say)
    shutil.rmtree(tmp / "_hf")
    kit["files"] = {str(p.relative_to(tmp)): {"sha256": sha256(p), "bytes": p.stat().st_size}
                    for p in sorted(tmp.rglob("*")) if p.is_file()}
    kit["bytes"] = sum(f["bytes"] for f in kit["files"].values())
    kit["seconds"] = round(time.perf_counter() - t0, 1)
    (tmp / "kit.json").write_text(json.dumps(kit, indent=1) + "\n")
    if out.exists():
        shutil.rmtree(out)
    tmp.rename(out)
    say(f"kit {out}: {len(kit['files'])} files, {kit['bytes'] / 1e6:.1f} MB, {kit['seconds']}s")
    return kit


def _models(root: Path, say: Callable[[str], None]) -> dict[str, Path]:
    """The tiny random llama of tests/conftest.py as the target (2 layers, hidden 64, 4/2 heads, V 320) and, as the
    draft, that target cut to its first layer (a layer-skip self-draft): conftest's independent random draft
    agrees with the target almost never, this one partially, so the greedy checks exercise partial acceptance
    (rows of a verify step committed, the rest rolled back) and not only rejections."""
    sys.path.insert(0, str(ROOT))
    try:
        from transformers import AutoModelForCausalLM

        from tests.conftest import make_hf_model, make_tokenizer
    except ImportError as e:
        raise SystemExit(f"prepare needs the test extras (torch + transformers + pytest) to make the tiny models: "
                         f"{e}; use the test venv (make test creates it)") from None
    say("tiny random models (tests/conftest.py recipe; draft = the target's first layer)")
    target = make_hf_model(root / "target", "llama")
    m = AutoModelForCausalLM.from_pretrained(target)
    m.model.layers = m.model.layers[:1]
    m.config.num_hidden_layers = 1
    m.save_pretrained(root / "draft")
    make_tokenizer(root / "draft")
    return {"target": target, "draft": root / "draft"}


def _bundle(tmp: Path, hf: dict[str, Path], name: str, draft: str, weights: str, form: str | None,
            reduced: tuple[str, ...], say: Callable[[str], None]) -> dict:
    from specedge.export.bundle import ExportOptions, export_bundle
    from specedge.export.engines import build_onnx
    from specedge.export.quant import WeightFormat
    from specedge.runtime.backends.ort import OrtRunner
    from specedge.runtime.manifest import read_manifest

    fmt = WeightFormat(weights, accuracy_level=0, form=form) if weights != "fp32" else WeightFormat()
    opts = ExportOptions(k=K, verify_widths=VERIFY_WIDTHS, max_context=MAX_CONTEXT, prefill_chunk=PREFILL, weights=fmt,
                         kv_mode="portable", device_argmax=form == "qdq")  # the Jetson preset's form: ids on device
    bdir = tmp / "bundles" / name
    export_bundle(hf["target"], hf["draft"] if draft == "draft" else draft, bdir, opts)
    cmd = (f"spec-export export --for datacenter-gpu --target TINY_TARGET "
           f"--draft {'TINY_DRAFT' if draft == 'draft' else draft} --k {K} "
           f"--verify-widths {','.join(map(str, VERIFY_WIDTHS))} --max-context {MAX_CONTEXT} --prefill-chunk {PREFILL}"
           + (f" --weights {weights} --accuracy-level 0" if weights != "fp32" else "")
           + (" --quant-form qdq --kv-mode portable --device-argmax" if form == "qdq" else " --no-device-argmax"))
    commands = [cmd]
    for p in reduced:
        build_onnx(bdir, p)
        commands.append(f"spec-export build BUNDLE --backend onnx --precision {p}")
    m = read_manifest(bdir)
    runners = {r: OrtRunner(bdir, m, r, threads=1) for r in m.models}
    try:
        meta = gg.record(tmp / "goldens" / f"{name}.npz", bdir, m, runners, f"{weights} graphs, ONNX Runtime CPU")
    finally:
        for r in runners.values():
            r.close()
    measured = {}
    for p in reduced:  # how far the reduced-precision graphs land from the goldens (fp32 / int4 graphs), on this CPU
        es = m.engine_set("onnx", p)
        runners = {r: OrtRunner(bdir, m, r, threads=1, engines=es) for r in m.models}
        meta_, ref = gg.load(tmp / "goldens" / f"{name}.npz")
        got = gg.run_script(runners, meta_["ops"])
        rel = max(float(np.abs(g - r).max() / np.abs(r).max()) for g, r in zip(got, ref))
        measured[p] = {f"max_reldiff_vs_{weights}_on_cpu": float(f"{rel:.4g}")}
    say(f"bundle {name}: {weights}{f' ({form})' if form else ''}, drafter {m.drafter}, widths "
        + "; ".join(f"{r} {[w.T for w in e.widths]}" for r, e in m.models.items())
        + f", {len(meta['ops'])} golden steps" + (f", fp16 vs {weights} on CPU {measured}" if measured else ""))
    return {"dir": f"bundles/{name}", "drafter": m.drafter, "weights": weights, "quant_form": form,
            "precisions": [weights, *reduced], "goldens": f"goldens/{name}.npz", "commands": commands,
            "reduced_precision_on_cpu": measured, "golden_steps": len(meta["ops"])}


def _greedy_goldens(tmp: Path, kit: dict, say: Callable[[str], None]) -> dict:
    """Per bundle: the three candidate prompts with the widest greedy top-2 gaps (picked on the model bundle,
    shared by all), their ids, plain greedy tokens (drafter none, ONNX Runtime CPU) and the gaps."""
    from specedge.runtime import SpecDecoder
    from specedge.runtime.backends.ort import OrtRunner

    out: dict = {}
    order = None
    for name in kit["bundles"]:
        dec = SpecDecoder.load(tmp / "bundles" / name, backend="ort-cpu", threads=1)
        gap_runner = OrtRunner(dec.bundle_dir, dec.manifest, "target", threads=1)  # its own cache
        gap_runner.min_width = 2  # the widths the decoder's plain rounds run
        try:
            rows = []
            for text in (CANDIDATE_PROMPTS if order is None else order):
                ids = dec.encode_prompt(text, chat=True)
                toks = gg.greedy_tokens(dec, text, GREEDY_TOKENS)
                gaps = gg.top2_gaps(gap_runner, ids, toks, dec.manifest.prefill_chunk)
                rows.append({"text": text, "ids": ids, "tokens": toks, "gaps": [round(g, 5) for g in gaps]})
            if order is None:
                rows = sorted(rows, key=lambda r: -min(r["gaps"]))[:3]
                order = [r["text"] for r in rows]
        finally:
            gap_runner.close()
            dec.close()
        out[name] = {"prompts": rows, "backend": "ort-cpu", "chat": True, "max_new_tokens": GREEDY_TOKENS}
        say(f"greedy goldens {name}: {len(rows)} prompts x {GREEDY_TOKENS} tokens, smallest top-2 gap "
            f"{min(min(r['gaps']) for r in rows):.3g}")
    return out


def _validate_goldens(tmp: Path, name: str, prompts: list[str], say: Callable[[str], None]) -> tuple[str, dict]:
    """`spec-export validate BUNDLE --candidate ort-fp16 --save-goldens ...` through the API: the goldens the GPU
    machine passes to `--goldens`, and this CPU's own fp16 verdict as a baseline."""
    from specedge.export.validate import ValidateOptions, validate

    rel = f"goldens/validate-{name}.npz"
    rep = validate(tmp / "bundles" / name, ValidateOptions(candidate="ort-fp16", prompts=tuple(prompts), tokens=16,
                                                           save_goldens=tmp / rel, threads=1))
    summary = {"passed": rep["passed"], "cases": f"{sum(c['passed'] for c in rep['cases'])}/{len(rep['cases'])}",
               "greedy": {r: g["fraction"] for r, g in rep["greedy"].items()}}
    say(f"validate goldens {rel}: CPU fp16 {'passed' if rep['passed'] else 'FAILED'} {summary}")
    return rel, summary


def _pylib(path: Path, say: Callable[[str], None]) -> None:
    """The packages of PYLIB as this venv has them (no __pycache__, stubs or tests)."""
    import importlib

    def keep(ti: tarfile.TarInfo) -> tarfile.TarInfo | None:
        parts = ti.name.split("/")
        drop = "__pycache__" in parts or "tests" in parts or ti.name.endswith(".pyi")
        return None if drop else ti

    with tarfile.open(path, "w:gz") as tar:
        for mod in PYLIB:
            d = Path(importlib.import_module(mod).__file__).parent
            tar.add(d, arcname=d.name, filter=keep)
    say(f"pylib {path.name}: {', '.join(PYLIB)} ({path.stat().st_size / 1e6:.1f} MB)")


def _git_rev() -> str | None:
    head = ROOT / ".git" / "HEAD"
    try:
        ref = head.read_text().strip()
        if ref.startswith("ref: "):
            return (ROOT / ".git" / ref[5:]).read_text().strip()
        return ref
    except OSError:
        return None
