"""`spec-export build`: reduced-precision ONNX graphs and TensorRT engines for a bundle.

Two kinds of engine set (``Manifest.engines``, see :class:`specedge.runtime.manifest.EngineSet`):

* ``onnx`` — fp16/bf16 copies of the portable fp32 graphs (:mod:`.precision`). They run on ONNX
  Runtime (fp16) and are the input of a TensorRT build.
* ``trt`` — one serialized engine per model, built from the reduced-precision graph as a
  *strongly typed* network (precision comes from the graph; TensorRT 11 removed the builder's
  precision flags and TensorRT 10 already honours the graph's types in this mode), with one
  optimization profile per declared width, min = opt = max (prefill P, verify widths, decode 1; a draft's
  catch-up widths),
  a workspace cap, a persistent timing cache, and progress printed as TensorRT reports it.

The TensorRT part is written against the TensorRT 10 Python API (10.3 on JetPack 6) and has not
run in CI (no GPU there); everything around it — graph conversion, profile shapes, manifest
records, the error when TensorRT is missing — is tested.
"""

from __future__ import annotations

import dataclasses
import os
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from specedge.runtime.backends.trt import import_tensorrt
from specedge.runtime.bundle_files import file_entry, verify_files
from specedge.runtime.errors import BundleError
from specedge.runtime.manifest import (
    EngineSet,
    Manifest,
    read_manifest,
    width_shapes,
    write_manifest,
)

from .precision import KV_DTYPE, PRECISIONS, convert_graph

ENGINE_DIR = "trt"
OOM_HINT = ("TensorRT found no kernel that fits: this is almost always the GPU running out of memory during the "
            "build. Lower --workspace-gb, close other GPU programs (on a Jetson: stop the desktop, `sudo "
            "systemctl isolate multi-user.target`), or export with a smaller --prefill-chunk or --max-context")


class BuildError(BundleError):
    """A TensorRT engine build failed."""


Say = Callable[[str], None]


def trt_parser_problems(model: Any) -> list[str]:
    """What TensorRT's ONNX parser would refuse in a graph's DequantizeLinear nodes (an onnx.ModelProto with
    its initializers loaded). The rules are those of onnx-tensorrt's Q/DQ importer (TensorRT 10.1 source,
    ``QuantDequantLinearHelper``) and TensorRT's Dequantize operator documentation: the scale is a build-time
    constant with every coefficient > 0; a zero point, if any, is all zeros; the input is INT8, INT4 or FP8
    (not UINT8); a scale of the input's rank is a block quantization, which TensorRT takes for INT4 only,
    with one blocked axis whose extent the block divides and an even last dimension. The parser reads
    ``block_size`` from the shapes, and checks only opset >= 7 (modelopt's INT4 exports are opset 21 too)."""
    from onnx import TensorProto, numpy_helper

    inits = {t.name: t for t in model.graph.initializer}
    names = {TensorProto.INT4: "INT4", TensorProto.INT8: "INT8", TensorProto.UINT8: "UINT8",
             TensorProto.FLOAT8E4M3FN: "FP8"}
    out = []
    for i, n in enumerate(model.graph.node):
        if n.op_type != "DequantizeLinear":
            continue
        where = f"DequantizeLinear {n.name or f'#{i}'} ({n.input[0]})"
        x, s = inits.get(n.input[0]), inits.get(n.input[1])
        if s is None:
            out.append(f"{where}: the scale must be a build-time constant (an initializer)")
            continue
        scale = numpy_helper.to_array(s)
        if not (scale > 0).all():
            out.append(f"{where}: every scale coefficient must be > 0 ({int((scale <= 0).sum())} are not)")
        if len(n.input) > 2 and n.input[2]:
            zp = inits.get(n.input[2])
            if zp is None or numpy_helper.to_array(zp).any():
                out.append(f"{where}: the zero point must be all zeros")
        if x is None:
            continue
        kind = names.get(x.data_type, TensorProto.DataType.Name(x.data_type))
        if kind not in ("INT4", "INT8", "FP8"):
            out.append(f"{where}: input type {kind}; TensorRT dequantizes INT8, INT4 or FP8")
        shape = tuple(x.dims)
        if scale.ndim == len(shape) and scale.size > 1:
            if kind != "INT4":
                out.append(f"{where}: {kind} with a block scale {scale.shape}: TensorRT takes block quantization "
                           "for INT4 only")
            ratios = [a / b for a, b in zip(shape, scale.shape)]
            if sum(r != 1 for r in ratios) != 1 or any(r != int(r) for r in ratios):
                out.append(f"{where}: input {shape} and scale {scale.shape} must differ in exactly one axis, "
                           "which the block size divides")
        if kind == "INT4" and shape and shape[-1] % 2:
            out.append(f"{where}: INT4 needs an even last dimension, got {shape}")
    return out


def _read_for_build(bundle_dir: Path) -> Manifest:
    """The manifest, with the files a build reads (graphs, weights, tokenizer) checked by size. Files of engine
    sets are not required: a build recreates them (an engine deleted by hand is rebuilt, not an error)."""
    m = read_manifest(bundle_dir, verify="none")
    derived = frozenset(f for es in m.engines.values() for g in es.get("graphs", {}).values() for f in (g, f"{g}.data"))
    verify_files(bundle_dir, m, "size", skip=derived)
    return m


def _register(manifest: Manifest, bundle_dir: Path, es: EngineSet, say: Say) -> Manifest:
    """The manifest with `es` recorded and its files hashed (replacing a previous set of the same key)."""
    files = dict(manifest.files)
    old = manifest.engines.get(es.key)
    if old:
        for f in old["graphs"].values():
            files.pop(f, None)
            files.pop(f + ".data", None)
    for f in es.graphs.values():
        for name in (f, f + ".data"):
            p = bundle_dir / name
            if p.is_file():
                say(f"hashing {name}")
                files[name] = file_entry(p)
    engines = {**manifest.engines, es.key: es.to_json()}
    m = dataclasses.replace(manifest, files=files, engines=engines)
    write_manifest(bundle_dir, m)
    return m


def build_onnx(bundle_dir: str | Path, precision: str = "fp16", progress: Say | None = None,
               force: bool = False, head: str = "fp32") -> EngineSet:
    """Reduced-precision ONNX graphs for every model of the bundle (reused when already built from the same
    fp32 graphs with the same head precision, unless `force`). head: fp32 | low, see convert_graph."""
    say = progress or (lambda s: None)
    bundle_dir = Path(bundle_dir)
    if precision not in PRECISIONS:
        raise BundleError(f"--precision {precision!r}: choose one of {', '.join(PRECISIONS)}")
    m = _read_for_build(bundle_dir)
    key = f"onnx-{precision}"
    sources = {role: m.files[e.graph]["sha256"] for role, e in m.models.items()}
    if key in m.engines and not force:
        es = EngineSet.from_json(m.engines[key])
        if es.sources == sources and es.build.get("head", "fp32") == head and \
                all((bundle_dir / f).is_file() for f in es.graphs.values()):
            say(f"{key}: up to date")
            return es
    t0 = time.perf_counter()
    graphs, reports = {}, {}
    for role, e in m.models.items():
        out = f"{Path(e.graph).stem}.{precision}.onnx"
        say(f"{role}: converting {e.graph} to {precision}")
        rep = convert_graph(bundle_dir / e.graph, bundle_dir / out, precision, progress=say, head=head)
        say(f"{role}: {rep.low_nodes} nodes in {precision}, {rep.fp32_nodes} kept in fp32 (norms, softmax, RoPE "
            f"tables, logits), {rep.casts_added} casts, {rep.weight_bytes / 1e6:.0f} MB of weights, {rep.seconds:.1f}s")
        graphs[role], reports[role] = out, rep.to_json()
    es = EngineSet(kind="onnx", precision=precision, kv_dtype=KV_DTYPE[precision], graphs=graphs, sources=sources,
                   build={"seconds": round(time.perf_counter() - t0, 1), "head": head, "conversion": reports})
    _register(m, bundle_dir, es, say)
    return es


@dataclasses.dataclass(frozen=True)
class TrtBuildOptions:
    precision: str = "fp16"
    workspace_gb: float = 2.0
    timing_cache: str | None = None  # default: ~/.cache/specedge/trt-timing-<TensorRT version>-sm<cc>.cache
    builder_optimization_level: int = 3  # TensorRT's default; 0-5 (lower builds faster)
    head: str = "fp32"  # lm_head precision in the graph: fp32 | low (see precision.convert_graph)

    def __post_init__(self) -> None:
        if self.precision not in PRECISIONS:
            raise BundleError(f"--precision {self.precision!r}: choose one of {', '.join(PRECISIONS)}")
        if not self.workspace_gb > 0:
            raise BundleError(f"--workspace-gb must be > 0, got {self.workspace_gb}")
        if not 0 <= self.builder_optimization_level <= 5:
            raise BundleError(f"--opt-level must be 0..5, got {self.builder_optimization_level}")


def trt_profiles(manifest: Manifest, role: str) -> list[dict[str, tuple[int, ...]]]:
    """The optimization profiles of one model's engine: one per declared width, in width order; each maps every
    input to its one shape (min = opt = max)."""
    e = manifest.models[role]
    return [width_shapes(e.dims, w, manifest.max_context) for w in e.widths]


def default_timing_cache(trt_version: str, cc: str) -> Path:
    root = Path(os.environ.get("SPECEDGE_CACHE", Path.home() / ".cache" / "specedge"))
    return root / f"trt-timing-{trt_version}-sm{cc.replace('.', '')}.cache"


def build_trt(bundle_dir: str | Path, opts: TrtBuildOptions = TrtBuildOptions(),
              progress: Say | None = None) -> EngineSet:
    """Build one TensorRT engine per model of the bundle and record them in the manifest."""
    say = progress or (lambda s: None)
    bundle_dir = Path(bundle_dir)
    trt = import_tensorrt()  # one clear line when TensorRT is missing, before any work
    from specedge.runtime.backends.cuda_rt import CudaRuntime

    cuda = CudaRuntime()
    cc, gpu = cuda.compute_capability(), cuda.device_name()
    free, total = cuda.mem_info()
    say(f"TensorRT {trt.__version__} on {gpu} (compute capability {cc}), {free / 2**30:.1f} of "
        f"{total / 2**30:.1f} GiB free")
    onnx_set = build_onnx(bundle_dir, opts.precision, say, head=opts.head)
    m = _read_for_build(bundle_dir)
    cache_path = Path(opts.timing_cache) if opts.timing_cache else default_timing_cache(trt.__version__, cc)
    (bundle_dir / ENGINE_DIR).mkdir(exist_ok=True)
    t_all = time.perf_counter()
    graphs, sources, profiles, seconds = {}, {}, {}, {}
    for role in m.models:
        onnx_file = onnx_set.graphs[role]
        out = f"{ENGINE_DIR}/{role}.{opts.precision}.sm{cc.replace('.', '')}.engine"
        t0 = time.perf_counter()
        tmp = bundle_dir / (out + ".tmp")
        size = _build_one(trt, bundle_dir / onnx_file, trt_profiles(m, role), opts, cache_path,
                          lambda s, r=role: say(f"{r}: {s}"), tmp)
        os.replace(tmp, bundle_dir / out)
        seconds[role] = round(time.perf_counter() - t0, 1)
        say(f"{role}: engine {out} ({size / 1e6:.0f} MB) built in {seconds[role]}s")
        graphs[role] = out
        sources[role] = m.files[onnx_file]["sha256"]
        profiles[role] = [[w.T, w.L] for w in m.models[role].widths]
    es = EngineSet(kind="trt", precision=opts.precision, kv_dtype=KV_DTYPE[opts.precision], graphs=graphs,
                   sources=sources, profiles=profiles, tensorrt=trt.__version__,
                   gpu={"name": gpu, "compute_capability": cc},
                   build={"seconds": seconds, "total_seconds": round(time.perf_counter() - t_all, 1),
                          "workspace_gb": opts.workspace_gb, "timing_cache": str(cache_path),
                          "builder_optimization_level": opts.builder_optimization_level, "head": opts.head,
                          "onnx": dict(onnx_set.graphs)})
    _register(m, bundle_dir, es, say)
    return es


def _build_one(trt: Any, onnx_path: Path, profiles: list[dict[str, tuple[int, ...]]], opts: TrtBuildOptions,
               cache_path: Path, say: Say, out: Path) -> int:
    """Build one engine and write its plan straight to ``out`` (no Python copy of it); returns its size. The
    parser, network, config and plan are released before returning, so the next model's build does not run
    beside this one's weights."""
    from specedge.runtime.backends import tensorrt_version_problem

    if (why := tensorrt_version_problem(trt.__version__)) is not None:
        raise BuildError(why)
    logger = _CapturingLogger(trt, say)
    builder = trt.Builder(logger)
    flags = 1 << int(trt.NetworkDefinitionCreationFlag.STRONGLY_TYPED)
    network = builder.create_network(flags)
    parser = trt.OnnxParser(network, logger)
    say(f"parsing {onnx_path.name}")
    if not parser.parse_from_file(str(onnx_path)):  # resolves the external weights next to the graph
        errs = "; ".join(str(parser.get_error(i).desc()) for i in range(parser.num_errors))
        raise BuildError(f"TensorRT's ONNX parser rejected {onnx_path.name}: {errs}")
    config = builder.create_builder_config()
    config.set_memory_pool_limit(trt.MemoryPoolType.WORKSPACE, int(opts.workspace_gb * 2**30))
    config.builder_optimization_level = opts.builder_optimization_level
    cache = config.create_timing_cache(cache_path.read_bytes() if cache_path.is_file() else b"")
    config.set_timing_cache(cache, ignore_mismatch=False)
    if hasattr(trt.BuilderFlag, "TF32"):
        config.clear_flag(trt.BuilderFlag.TF32)  # the fp32 islands (norm statistics, softmax, head) stay fp32
    for i, shapes in enumerate(profiles):
        prof = builder.create_optimization_profile()
        for name, shape in shapes.items():
            prof.set_shape(name, shape, shape, shape)
        if i > 0 and hasattr(prof, "extra_memory_target"):
            prof.extra_memory_target = 0.0  # no extra weight copies for the later profiles
        config.add_optimization_profile(prof)
    if hasattr(trt, "IProgressMonitor"):
        config.progress_monitor = _Progress(trt, say)
    say(f"building ({len(profiles)} profiles: T = {', '.join(str(p['input_ids'][1]) for p in profiles)}; workspace "
        f"{opts.workspace_gb} GiB; timing cache {cache_path})")
    plan = builder.build_serialized_network(network, config)
    if plan is None:
        msgs = " | ".join(logger.errors[-3:]) or "no message"
        if any("could not find any implementation" in e.lower() or "out of memory" in e.lower()
               for e in logger.errors):
            raise BuildError(f"building {onnx_path.name} failed: {OOM_HINT}. TensorRT said: {msgs}")
        raise BuildError(f"building {onnx_path.name} failed; TensorRT said: {msgs}")
    cache_path.parent.mkdir(parents=True, exist_ok=True)
    tmp = cache_path.with_suffix(".tmp")
    tmp.write_bytes(memoryview(config.get_timing_cache().serialize()))
    os.replace(tmp, cache_path)
    with open(out, "wb") as f:
        f.write(memoryview(plan))
    size = out.stat().st_size
    del plan, parser, network, config, builder
    return size


def _CapturingLogger(trt: Any, say: Say) -> Any:  # noqa: N802 - a class made at run time (trt is imported lazily)
    class Logger(trt.ILogger):
        def __init__(self) -> None:
            trt.ILogger.__init__(self)
            self.errors: list[str] = []

        def log(self, severity: Any, msg: str) -> None:
            if severity in (trt.ILogger.Severity.ERROR, trt.ILogger.Severity.INTERNAL_ERROR):
                self.errors.append(msg)
                say(f"TensorRT error: {msg}")
            elif severity == trt.ILogger.Severity.WARNING:
                say(f"TensorRT warning: {msg}")

    return Logger()


def _Progress(trt: Any, say: Say) -> Any:  # noqa: N802
    class Progress(trt.IProgressMonitor):
        """Prints top-level phases and every ~10 % of their steps, with elapsed time (called from TensorRT's
        threads, hence the lock)."""

        def __init__(self) -> None:
            trt.IProgressMonitor.__init__(self)
            self._lock, self._t0 = threading.Lock(), time.perf_counter()
            self._steps: dict[str, int] = {}
            self._parent: dict[str, str | None] = {}

        def phase_start(self, phase_name: str, parent_phase: str | None, num_steps: int) -> None:
            with self._lock:
                self._steps[phase_name], self._parent[phase_name] = num_steps, parent_phase
                if parent_phase is None:
                    say(f"[{time.perf_counter() - self._t0:6.1f}s] {phase_name} ({num_steps} steps)")

        def step_complete(self, phase_name: str, step: int) -> bool:
            with self._lock:
                n = self._steps.get(phase_name, 0)
                if self._parent.get(phase_name) is None and n >= 10 and (step + 1) % max(1, n // 10) == 0:
                    say(f"[{time.perf_counter() - self._t0:6.1f}s] {phase_name}: {step + 1}/{n}")
            return True  # False would cancel the build

        def phase_finish(self, phase_name: str) -> None:
            with self._lock:
                if self._parent.pop(phase_name, "x") is None:
                    say(f"[{time.perf_counter() - self._t0:6.1f}s] {phase_name} done")

    return Progress()
