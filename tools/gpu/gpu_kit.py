"""The GPU smoke kit: prepared on the CPU machine, checked on a GPU machine that cannot download anything.

    python tools/gpu/gpu_kit.py prepare .gpu-kit            # CPU machine, test venv (torch + transformers): bundles,
                                                         # fp16 + int4 (MatMulNBits and qdq) graphs, goldens from
                                                         # ONNX Runtime CPU (~10 s)
    bash tools/gpu/gpu_check.sh .gpu-kit                     # GPU machine: every check below, report JSON, < 8 min
    python tools/gpu/gpu_kit.py check .gpu-kit --report R.json [--dry-run] [--only SUBSTR,..] [--work DIR]
                                                             [--budget-s S]
    python tools/gpu/gpu_kit.py spec-export ARGS | exec SCRIPT ARGS   # the CLI / a script, with the imports below

`check` copies the kit's bundles to a work folder (the kit stays as prepared), runs the CPU checks (the kit's
integrity; its goldens replayed on ONNX Runtime CPU, which proves the goldens and the check code; greedy
speculative == plain on CPU; `spec-export validate --goldens` on CPU; the int4-qdq bundle's fp16 graphs against
TensorRT's ONNX parser rules, its INT4 DequantizeLinear nodes counted) and then the GPU checks: CUDA binding vs
CuPy, ort-cuda with a NaN-poisoned allocator, step-by-step parity with the goldens at every width (past_len 0
and > 0, after rollbacks, target and draft interleaved) on ort-cuda fp32/TF32/fp16/int4 (MatMulNBits; and the
int4-qdq fp16 graph), TensorRT fp16 with and without CUDA graphs, TensorRT weight-only INT4 (int4-qdq) and ONNX
Runtime's TensorRT EP, TensorRT builds (seconds, engine vs weight bytes, with 1 and N profiles; int4-qdq engines
vs the same models' fp16 engines), `spec-export validate --goldens`, greedy speculative == plain for every
drafter and k = 1..K, step times per width with and without CUDA graphs. Without a GPU (or with --dry-run) every
GPU check is printed with what it would run — commands, API calls, widths, tolerances — and reported "skipped: no
GPU"; a check whose library is missing (TensorRT, onnxruntime-gpu, CuPy; an onnxruntime older than the
runtime's QDQ_MIN_ORT for the int4-qdq bundle on ONNX Runtime; onnx for its parser-rules check) is skipped
with that reason. Exit status 0 when no check failed.

The kit imports specedge from this checkout (an import shim where it is not installed, or installed from
elsewhere) and, where the machine lacks click / jinja2 / tokenizers / polygraphy, the copies the kit carries
(pylib.tar.gz). `python tools/gpu/gpu_kit.py spec-export ARGS` runs the spec-export CLI the same way; where onnx
is missing, its `build` and `validate` run with a stand-in onnx module (they only import it: the kit carries the
fp16 graphs they would otherwise convert), and the check's report says so.
"""

from __future__ import annotations

import argparse
import importlib.abc
import importlib.util
import json
import os
import sys
import tarfile
import tempfile
import types
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = {"runtime": "runtime", "export": "export", "configs": "configs"}  # specedge.<name> -> folder
PYLIB_ENV = "SPECEDGE_KIT_PYLIB"


# ------------------------------------------------------------------ bootstrap: this checkout, carried libraries
class _CheckoutFinder(importlib.abc.MetaPathFinder):
    """specedge.runtime / .export / .configs from this checkout's folders (pyproject's package-dir)."""

    def find_spec(self, name, path, target=None):  # noqa: ANN001, ANN201
        parts = name.split(".")
        if parts[0] != "specedge" or len(parts) < 2 or parts[1] not in PACKAGES:
            return None
        base = ROOT / PACKAGES[parts[1]] / Path(*parts[2:])
        if (base / "__init__.py").is_file():
            return importlib.util.spec_from_file_location(name, base / "__init__.py",
                                                          submodule_search_locations=[str(base)])
        if base.with_suffix(".py").is_file():
            return importlib.util.spec_from_file_location(name, base.with_suffix(".py"))
        return None


def use_checkout() -> str:
    """Make `import specedge...` load this checkout; say how."""
    try:
        spec = importlib.util.find_spec("specedge.runtime")
    except ImportError:
        spec = None
    origin = Path(spec.origin).resolve() if spec and spec.origin else None
    if origin is not None and ROOT in origin.parents:
        return "installed from this checkout"
    for m in [m for m in sys.modules if m == "specedge" or m.startswith("specedge.")]:
        del sys.modules[m]
    pkg = types.ModuleType("specedge")
    pkg.__path__ = []
    sys.modules["specedge"] = pkg
    sys.meta_path.insert(0, _CheckoutFinder())
    return f"this checkout through the kit's import shim (installed: {origin or 'none'})"


def add_pylib(kit: Path | None, work: Path | None) -> dict[str, str]:
    """Where one of the carried packages does not import, unpack the kit's pylib.tar.gz (once) and append it to
    sys.path (installed packages still win); subprocesses get it through $SPECEDGE_KIT_PYLIB. Returns
    {package: "installed" | "kit copy" | "missing: why"}."""
    from gpu_kit_prepare import PYLIB

    def probe() -> dict[str, str]:
        out = {}
        for mod in PYLIB:
            try:
                m = __import__(mod)
                out[mod] = "kit copy" if os.environ.get(PYLIB_ENV, "\0") in str(getattr(m, "__file__", "")) \
                    else "installed"
            except Exception as e:  # noqa: BLE001 - a broken install is as good as none
                out[mod] = f"missing: {type(e).__name__}: {e}"
        return out

    if os.environ.get(PYLIB_ENV):
        sys.path.append(os.environ[PYLIB_ENV])
    have = probe()
    tgz = kit / "pylib.tar.gz" if kit else None
    if all(v == "installed" for v in have.values()) or os.environ.get(PYLIB_ENV) or not (tgz and tgz.is_file()):
        return have
    dest = (work or Path(tempfile.mkdtemp())) / "pylib"
    if not dest.is_dir():
        with tarfile.open(tgz) as tar:
            tar.extractall(dest)
    os.environ[PYLIB_ENV] = str(dest)
    sys.path.append(str(dest))
    for mod in [m for m, v in have.items() if v != "installed"]:
        sys.modules.pop(mod, None)
    return probe()


def stub_onnx() -> str | None:
    """`spec-export build` imports onnx (export/precision.py) even when the fp16 graphs it would convert are up to
    date, as they are in the kit. Where onnx is missing, a stand-in module lets the TensorRT build run; any real
    use of it raises."""
    try:
        import onnx  # noqa: F401

        return None
    except ImportError as e:
        why = str(e)

    class Missing:
        def __init__(self, name: str):
            self._name = name

        def __getattr__(self, attr: str) -> Missing:
            if attr.startswith("__"):
                raise AttributeError(attr)
            return Missing(f"{self._name}.{attr}")

        def __call__(self, *a, **k):  # noqa: ANN002, ANN003, ANN204
            raise ImportError(f"{self._name}: onnx is not installed ({why}); the GPU kit's stand-in cannot do this")

    def module_attr(attr: str) -> Missing:
        if attr.startswith("__"):  # introspection (inspect.getmodule walks sys.modules) must see a plain module
            raise AttributeError(attr)
        return Missing(f"onnx.{attr}")

    mod = types.ModuleType("onnx")
    mod.__getattr__ = module_attr  # type: ignore[method-assign]
    sys.modules["onnx"] = mod
    return f"onnx is not installed ({why}): a stand-in module was used (the fp16 graphs came with the kit)"


# ------------------------------------------------------------------ commands
def cmd_prepare(a: argparse.Namespace) -> int:
    use_checkout()
    from gpu_kit_prepare import prepare

    prepare(Path(a.out), force=a.force)
    return 0


def cmd_check(a: argparse.Namespace) -> int:
    import gpu_kit_checks as kc

    kit = Path(a.kit).resolve()
    if not (kit / "kit.json").is_file():
        print(f"{kit} is not a GPU kit (no kit.json); make one on the CPU machine: "
              f"python tools/gpu/gpu_kit.py prepare {a.kit}", file=sys.stderr)
        return 2
    work = Path(a.work).resolve() if a.work else Path(tempfile.mkdtemp(prefix="specedge-gpu-kit-"))
    work.mkdir(parents=True, exist_ok=True)
    report_path = Path(a.report).resolve() if a.report else work / "report.json"
    how = use_checkout()
    libs = add_pylib(kit, work)
    ctx = kc.Ctx.create(kit, work, dry_run=a.dry_run, budget_s=a.budget_s, libs=libs, specedge=how)
    report_path.parent.mkdir(parents=True, exist_ok=True)

    def write(rep: dict) -> None:
        tmp = report_path.with_name(report_path.name + ".tmp")
        tmp.write_text(json.dumps(rep, indent=1, default=str) + "\n")
        tmp.replace(report_path)

    report = kc.run_all(ctx, only=a.only, write=write)
    print(f"report: {report_path}")
    return 0 if report["passed"] else 1


def cmd_spec_export(args: list[str]) -> int:
    use_checkout()
    add_pylib(None, None)
    note = stub_onnx() if args[:1] in (["build"], ["validate"]) else None
    if note:
        print(f"[gpu-kit] {note}", file=sys.stderr)
    from specedge.export.cli import main as cli

    sys.argv = ["spec-export", *args]
    try:
        cli()
    except SystemExit as e:
        return int(e.code or 0) if not isinstance(e.code, str) else 1
    return 0


def cmd_trt_sizes(a: argparse.Namespace) -> int:
    use_checkout()
    add_pylib(None, None)
    stub_onnx()
    from gpu_kit_trt import engine_sizes

    print(json.dumps(engine_sizes(Path(a.bundle), Path(a.timing_cache))))
    return 0


def cmd_exec(args: list[str]) -> int:
    """Run a Python script (e.g. tools/gpu/gpu_check_cuda.py) with this checkout and the carried libraries
    importable."""
    import runpy

    use_checkout()
    add_pylib(None, None)
    sys.argv = list(args)
    try:
        runpy.run_path(args[0], run_name="__main__")
    except SystemExit as e:
        return int(e.code or 0) if not isinstance(e.code, str) else 1
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["spec-export"]:
        return cmd_spec_export(argv[1:])
    if argv[:1] == ["exec"]:
        return cmd_exec(argv[1:])
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("prepare", help="build the kit (CPU machine, test venv)")
    p.add_argument("out")
    p.add_argument("--force", action="store_true", help="replace an existing kit")
    p.set_defaults(fn=cmd_prepare)
    c = sub.add_parser("check", help="run the checks (GPU machine; no-GPU mode elsewhere)")
    c.add_argument("kit")
    c.add_argument("--report", help="JSON report path (default WORK/report.json)")
    c.add_argument("--dry-run", action="store_true", help="CPU checks only; print what each GPU check would do")
    c.add_argument("--only", help="comma-separated substrings: run only the checks whose id contains one "
                                  "(environment and kit-integrity always run), e.g. --only trt,nan-cache")
    c.add_argument("--work", help="work folder (default: a new temporary one)")
    c.add_argument("--budget-s", type=float, default=400.0,
                   help="checks not started after this many seconds are skipped, and commands they run stop 50 s "
                        "after it (default 400: the whole check stays under 8 minutes)")
    c.set_defaults(fn=cmd_check)
    t = sub.add_parser("trt-sizes", help="(internal) engines with 1 and N profiles per model, sizes and build times")
    t.add_argument("bundle")
    t.add_argument("timing_cache")
    t.set_defaults(fn=cmd_trt_sizes)
    a = ap.parse_args(argv)
    return a.fn(a)


if __name__ == "__main__":
    sys.exit(main())
