"""`spec-export doctor`: what this machine is, and which specedge backends will work on it and why not.

Reads only files and libraries (no GPU work): Jetson release (``/etc/nv_tegra_release``) and
board (``/proc/device-tree/model``), the power mode (``nvpmodel -q`` where present), memory
(``/proc/meminfo``), the CUDA runtime and GPU (through :mod:`.backends.cuda_rt`), TensorRT,
polygraphy and ONNX Runtime with its execution providers. ``root`` lets tests point it at a
fake filesystem.
"""

from __future__ import annotations

import importlib.util
import platform
import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

# L4T release -> JetPack (NVIDIA's release notes). Unknown releases are reported as they are.
JETPACK = {
    ("35", "1"): "5.0.2", ("35", "2"): "5.1", ("35", "3"): "5.1.1", ("35", "4"): "5.1.2", ("35", "5"): "5.1.3",
    ("35", "6"): "5.1.4", ("36", "2"): "6.0 DP", ("36", "3"): "6.0", ("36", "4"): "6.1 / 6.2 (36.4.3 = 6.2)",
    ("38", "1"): "7.0 DP", ("38", "2"): "7.0",
}


def _read(root: Path, path: str) -> str | None:
    try:
        return (root / path.lstrip("/")).read_text(errors="replace").replace("\0", "").strip()
    except OSError:
        return None


def jetson_info(root: Path = Path("/")) -> dict[str, Any] | None:
    """None unless this is a Jetson (``/etc/nv_tegra_release`` exists)."""
    rel = _read(root, "/etc/nv_tegra_release")
    if rel is None:
        return None
    m = re.search(r"R(\d+)\s*\(release\),\s*REVISION:\s*([\d.]+)", rel)
    l4t = f"{m.group(1)}.{m.group(2)}" if m else None
    jp = JETPACK.get((m.group(1), m.group(2).split(".")[0])) if m else None
    if l4t == "36.4.3":
        jp = "6.2"
    return {"l4t": l4t, "jetpack": jp or "unknown (see NVIDIA's L4T release notes)",
            "model": _read(root, "/proc/device-tree/model"), "power_mode": _power_mode(root), "release": rel}


def _power_mode(root: Path) -> str | None:
    if root == Path("/") and shutil.which("nvpmodel"):
        try:
            out = subprocess.run(["nvpmodel", "-q"], capture_output=True, text=True, timeout=5).stdout
            lines = [line.strip() for line in out.splitlines() if line.strip()]
            if lines:
                return " / ".join(lines[:2])
        except (OSError, subprocess.SubprocessError):
            pass
    status = _read(root, "/var/lib/nvpmodel/status")
    return status or None


def meminfo(root: Path = Path("/")) -> dict[str, float]:
    """GiB of MemTotal, MemAvailable, SwapTotal (empty where /proc/meminfo is unreadable)."""
    text = _read(root, "/proc/meminfo") or ""
    out = {}
    for key in ("MemTotal", "MemAvailable", "SwapTotal"):
        m = re.search(rf"^{key}:\s+(\d+)\s*kB", text, re.M)
        if m:
            out[key] = round(int(m.group(1)) / 2**20, 2)
    return out


def cuda_info() -> dict[str, Any]:
    from .backends.cuda_rt import CudaRuntime
    from .errors import SpecEdgeError

    try:
        c = CudaRuntime()
    except SpecEdgeError as e:
        return {"ok": False, "why": str(e)}
    drv, rt = c.versions()
    free, total = c.mem_info()
    return {"ok": True, "library": c.library, "driver": f"{drv // 1000}.{drv % 1000 // 10}",
            "runtime": f"{rt // 1000}.{rt % 1000 // 10}", "gpu": c.device_name(),
            "compute_capability": c.compute_capability(), "integrated": c.integrated(),
            "memory_free_gib": round(free / 2**30, 2), "memory_total_gib": round(total / 2**30, 2)}


def _module_version(name: str) -> str | None:
    if importlib.util.find_spec(name) is None:
        return None
    try:
        mod = __import__(name)
        return str(getattr(mod, "__version__", "installed"))
    except Exception as e:  # a broken install (e.g. a TensorRT wheel without its libraries) is worth reporting
        return f"broken ({type(e).__name__}: {e})"


def report(root: Path = Path("/")) -> dict[str, Any]:
    ort_version, providers = None, []
    try:
        import onnxruntime as ort

        ort_version, providers = ort.__version__, ort.get_available_providers()
    except ImportError:
        pass
    cuda = cuda_info() if root == Path("/") else {"ok": False, "why": "not probed (fake root)"}
    trt = _module_version("tensorrt")
    rep = {
        "machine": platform.machine(), "system": _os_name(root), "cpu": _cpu_info() if root == Path("/") else None,
        "python": platform.python_version(), "jetson": jetson_info(root), "memory_gib": meminfo(root),
        "cuda": cuda, "tensorrt": trt, "polygraphy": _module_version("polygraphy"),
        "onnxruntime": ort_version, "ort_providers": providers,
    }
    rep["backends"] = backend_verdicts(rep)
    rep["specedge_kernels"] = kernels_info() if root == Path("/") else {"ok": False, "why": "not probed (fake root)"}
    return rep


def kernels_info() -> dict[str, Any]:
    """Whether specedge's own CPU kernels (--quant-form specedge) build and load here, and which paths they have."""
    from .errors import BackendUnavailableError
    from .kernels import Kernel, library_path

    try:
        path = library_path()
        isas = Kernel().isas()
    except BackendUnavailableError as e:
        return {"ok": False, "why": str(e).splitlines()[0]}
    except OSError as e:  # the built library does not load
        return {"ok": False, "why": f"the kernel library does not load: {e}"}
    return {"ok": True, "isas": isas, "library": str(path)}


def _cpu_info() -> dict[str, Any]:
    """The SIMD features that pick ONNX Runtime's CPU kernels, and what they mean for integer-GEMM bundles."""
    from .cpu import cpu_flags, int16_pair_saturation, physical_cores

    return {"simd": cpu_flags(), "physical_cores": physical_cores(), "int16_pair_sums": int16_pair_saturation()}


def _os_name(root: Path) -> str | None:
    m = re.search(r'^PRETTY_NAME="?([^"\n]+)"?', _read(root, "/etc/os-release") or "", re.M)
    return m.group(1) if m else None


def backend_verdicts(rep: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """Per backend: will it work here, and if not, why and what to install."""
    gpu_ok, gpu_why = rep["cuda"].get("ok", False), rep["cuda"].get("why", "")
    prov = rep["ort_providers"]
    trt = rep["tensorrt"]
    jet = rep["jetson"] is not None

    def v(ok: bool, why: str) -> dict[str, Any]:
        return {"ok": ok, "why": why}

    out = {"ort-cpu": v(bool(rep["onnxruntime"]), "ONNX Runtime " + (rep["onnxruntime"] or "is not installed"))}
    if "CUDAExecutionProvider" not in prov:
        out["ort-cuda"] = v(False, "ONNX Runtime has no CUDAExecutionProvider: install onnxruntime-gpu "
                            + ("(Jetson: the JetPack wheel from NVIDIA's Jetson AI Lab index, not PyPI's)" if jet else
                               "(and uninstall onnxruntime)"))
    else:
        out["ort-cuda"] = v(gpu_ok, "CUDAExecutionProvider present" + ("" if gpu_ok else f", but {gpu_why}"))
    if "TensorrtExecutionProvider" not in prov:
        out["ort-trt"] = v(False, "ONNX Runtime has no TensorrtExecutionProvider (needs onnxruntime-gpu and TensorRT)")
    else:
        out["ort-trt"] = v(gpu_ok, "TensorrtExecutionProvider present" + ("" if gpu_ok else f", but {gpu_why}"))
    if trt is None:
        how = ("JetPack ships it: `sudo apt install nvidia-tensorrt` (python3-libnvinfer), then a venv made with "
               "--system-site-packages" if jet else "pip install 'specedge[trt]' (tensorrt-cu12 wheels)")
        out["trt"] = v(False, f"TensorRT is not installed: {how}")
    elif trt.startswith("broken"):
        out["trt"] = v(False, f"TensorRT is installed but does not import: {trt}")
    else:
        from .backends import tensorrt_version_problem

        too_old = tensorrt_version_problem(trt)
        if too_old:
            out["trt"] = v(False, too_old)
        else:
            out["trt"] = v(gpu_ok, f"TensorRT {trt}" + ("" if gpu_ok else f", but {gpu_why}"))
    out["validate"] = v(bool(rep["polygraphy"]), "polygraphy " + (rep["polygraphy"] or
                                                                  "is not installed: pip install 'specedge[validate]'"))
    return out


def format_report(rep: dict[str, Any]) -> str:
    lines = [f"machine     {rep['machine']}, {rep['system'] or 'unknown OS'}, Python {rep['python']}"]
    cpu = rep.get("cpu")
    if cpu:
        pairs = cpu["int16_pair_sums"]
        gemm = ("int16 pair sums (no VNNI): --intgemm-full-range bundles are refused here" if pairs else
                "int32 dot products: every integer-GEMM bundle is exact here" if pairs is False else
                "unknown (CPU flags unreadable)")
        lines.append(f"cpu         {cpu['physical_cores']} physical cores; {cpu['simd']}")
        lines.append(f"int gemm    {gemm}")
    j = rep["jetson"]
    if j:
        lines.append(f"jetson      {j['model'] or 'unknown board'}: L4T {j['l4t']}, JetPack {j['jetpack']}")
        lines.append(f"power mode  {j['power_mode'] or 'not readable (nvpmodel -q)'}")
    else:
        lines.append("jetson      no (/etc/nv_tegra_release absent)")
    m = rep["memory_gib"]
    if m:
        lines.append(f"memory      {m.get('MemTotal', '?')} GiB total, {m.get('MemAvailable', '?')} GiB available, "
                     f"swap {m.get('SwapTotal', '?')} GiB" + (" (shared with the GPU)" if j else ""))
    c = rep["cuda"]
    if c.get("ok"):
        lines.append(f"gpu         {c['gpu']}, compute capability {c['compute_capability']}, "
                     f"{c['memory_free_gib']} of {c['memory_total_gib']} GiB free"
                     + (", integrated" if c["integrated"] else ""))
        lines.append(f"cuda        driver {c['driver']}, runtime {c['runtime']} ({c['library']})")
    else:
        lines.append(f"gpu         none usable: {c.get('why')}")
    lines.append(f"tensorrt    {rep['tensorrt'] or 'not installed'}; polygraphy {rep['polygraphy'] or 'not installed'}")
    lines.append(f"onnxruntime {rep['onnxruntime'] or 'not installed'}: {', '.join(rep['ort_providers']) or '-'}")
    k = rep.get("specedge_kernels") or {}
    if k.get("ok"):
        fast = [i for i in k["isas"] if i != "scalar"]
        lines.append(f"sek kernels built ({', '.join(k['isas'])}): --quant-form specedge bundles run here"
                     + ("" if fast else ", on the portable C path only (slow: no AVX2/AVX512-VNNI path for this CPU)"))
    else:
        lines.append(f"sek kernels no: {k.get('why', 'not probed')} (--quant-form specedge bundles cannot run)")
    lines.append("backends")
    for name, v in rep["backends"].items():
        lines.append(f"  {name:<9} {'yes' if v['ok'] else 'no '}  {v['why']}")
    return "\n".join(lines)
