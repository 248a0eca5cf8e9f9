"""A self draft: the target's own graph with some of its layers skipped, sharing the target's weights and KV cache.

The draft graph is cut from the target's (``self_draft_model``): a skipped layer's output is replaced by its
input, the kept layers' cache inputs and outputs are renumbered 0..m-1, and every node no output needs is dropped.
Its initializers keep their external-data references into the target's weights file, so on disk the draft is a
graph of a few hundred kilobytes; the runtime reads every tensor of that file once and hands both sessions the same
buffers (:func:`specedge.runtime.backends.ort.shared_weights`), and binds the kept layers' cache to the target's own
(``OrtRunner(kv_of=...)``). The draft's rows in that cache are written past the committed tokens only, and the
verify step recomputes and overwrites every row it verifies, in every layer.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
from pathlib import Path

import onnx
from onnx import TensorProto

from specedge.runtime.bundle_files import file_entry
from specedge.runtime.errors import BundleError, OptionError
from specedge.runtime.manifest import (
    GRAPH_RESIDUALS_KEY,
    ROLE_DECODE,
    ROWS_KV_MODE,
    SEK_FORMAT,
    Manifest,
    ModelEntry,
    Width,
    format_layers,
)

SELF = "self"  # --draft self[:SKIP|auto]
SELF_GRAPH = "self_draft.onnx"  # the self draft's graph in a bundle (its weights: the target's file)
_KV = re.compile(r"^(past_key_values|present)\.(\d+)\.(key|value)$")


def is_self(draft: str) -> bool:
    return draft == SELF or draft.startswith(SELF + ":")


def parse_skip(spec: str, n_layers: int) -> tuple[int, ...]:
    """``"3,5-9"`` -> (3, 5, 6, 7, 8, 9): the target layers a self draft skips, checked against the model."""
    out: set[int] = set()
    for part in spec.split(","):
        m = re.fullmatch(r"\s*(\d+)\s*(?:-\s*(\d+)\s*)?", part)
        if not m:
            raise OptionError(f"self draft layers {spec!r}: give layer numbers and ranges such as 4,6-9 "
                              f"(0..{n_layers - 1}), or auto to search")
        a, b = int(m[1]), int(m[2] if m[2] is not None else m[1])
        if a > b or b >= n_layers:
            raise OptionError(f"self draft layers {spec!r}: {part.strip()} is outside the target's layers "
                              f"0..{n_layers - 1}")
        out |= set(range(a, b + 1))
    if len(out) >= n_layers:
        raise OptionError(f"self draft layers {spec!r} skip all {n_layers} layers; keep at least one")
    return tuple(sorted(out))


def residuals(model: onnx.ModelProto) -> list[str]:
    props = {p.key: p.value for p in model.metadata_props}
    if GRAPH_RESIDUALS_KEY not in props:
        raise BundleError("this target graph does not name its layers' boundaries (exported by an older specedge): "
                          "export it again to give it a self draft")
    return json.loads(props[GRAPH_RESIDUALS_KEY])


def self_draft_model(target: onnx.ModelProto, skip: tuple[int, ...]) -> onnx.ModelProto:
    """The target graph (loaded without its external data) with the layers ``skip`` left out."""
    res = residuals(target)
    n_layers = len(res) - 1
    kept = [i for i in range(n_layers) if i not in set(skip)]
    model = onnx.ModelProto()
    model.CopyFrom(target)
    g = model.graph
    alias: dict[str, str] = {}
    for i in sorted(skip):  # the stream after a skipped layer is the stream before it
        alias[res[i + 1]] = alias.get(res[i], res[i])
    renum = {i: j for j, i in enumerate(kept)}

    def rename(name: str, read: bool = True) -> str | None:
        """A value's name in the draft (None: a skipped layer's cache); what a node reads follows the aliases."""
        m = _KV.match(name)
        if m is None:
            return alias.get(name, name) if read else name
        i = int(m[2])
        return None if i not in renum else f"{m[1]}.{renum[i]}.{m[3]}"

    for node in g.node:  # (a skipped layer's nodes are renamed too, then dropped: nothing reads them)
        node.input[:] = [rename(x) or f"{x}.skipped" if x else x for x in node.input]
        node.output[:] = [rename(x, read=False) or f"{x}.skipped" for x in node.output]
    for io in (g.input, g.output):
        keep = [v for v in io if rename(v.name) is not None]
        for v in keep:
            v.name = rename(v.name, read=False)
        del io[:]
        io.extend(keep)
    needed = {o.name for o in g.output}
    nodes = []
    for node in reversed(g.node):  # the nodes some output needs, found from the outputs back
        if any(o in needed for o in node.output):
            nodes.append(node)
            needed |= {x for x in node.input if x}
    del g.node[:]
    g.node.extend(reversed(nodes))
    inits = [t for t in g.initializer if t.name in needed]
    del g.initializer[:]
    g.initializer.extend(inits)
    props = {p.key: p.value for p in model.metadata_props}
    props[GRAPH_RESIDUALS_KEY] = json.dumps([alias.get(res[i], res[i]) for i in kept] + [alias.get(res[-1], res[-1])])
    del model.metadata_props[:]
    onnx.helper.set_model_props(model, props)
    g.name = f"{g.name}-self"
    return model


def external_tensors(model: onnx.ModelProto) -> dict[str, tuple[int, ...]]:
    """Every initializer kept in the target's weights file: name -> (offset, length, ONNX type, *dims), what the
    runtime reads once and hands both sessions (it has no ``onnx`` to read the graph with)."""
    out = {}
    for t in model.graph.initializer:
        if t.data_location != TensorProto.EXTERNAL:
            continue
        e = {x.key: x.value for x in t.external_data}
        out[t.name] = (int(e.get("offset", 0)), int(e["length"]), int(t.data_type), *map(int, t.dims))
    return out


def write_self_draft(bundle_dir: Path, target_graph: str, skip: tuple[int, ...], name: str = "draft.onnx",
                     kv_mode: str = ROWS_KV_MODE) -> tuple[Path, dict[str, tuple[int, ...]]]:
    """Cut the self draft from ``bundle_dir/target_graph`` and write it next to it (its weights stay the target's
    file): its path and every tensor of the target's weights file, which the runtime reads once and hands both
    sessions (the draft's graph uses those of the layers it keeps; ONNX Runtime ignores the others there)."""
    if kv_mode != ROWS_KV_MODE:
        raise OptionError(f"a self draft shares the target's KV cache, which needs row-addressed steps (kv_mode "
                          f"rows, the specedge form's default); this bundle has kv_mode {kv_mode}")
    target = onnx.load(str(Path(bundle_dir) / target_graph), load_external_data=False)
    model = self_draft_model(target, skip)
    path = Path(bundle_dir) / name
    onnx.save_model(model, str(path))
    return path, external_tensors(target)


def self_entry(manifest: Manifest, skip: tuple[int, ...], graph: str,
               tensors: dict[str, tuple[int, ...]]) -> ModelEntry:
    """The manifest's entry for a self draft of ``manifest``'s target skipping ``skip``: one width (a draft step
    is one token; it never catches up, since the target's cache already holds every committed row)."""
    t = manifest.target
    kept = tuple(i for i in range(t.dims.n_layers) if i not in set(skip))
    return ModelEntry(
        family=t.family, dims=dataclasses.replace(t.dims, n_layers=len(kept)), graph=graph, weights=t.weights,
        precision=t.precision, widths=(Width(ROLE_DECODE, 1, 1),),
        source={"self": f"the target's layers without {format_layers(skip)}", "skipped": list(skip)},
        quant=t.quant, layers=kept, tensors=tensors)


def with_self_draft(bundle_dir: Path, manifest: Manifest, skip: tuple[int, ...],
                    graph: str = SELF_GRAPH) -> Manifest:
    """Write the self draft's graph into ``bundle_dir`` and return the manifest that names it (the caller writes
    it: the manifest is what makes the draft part of the bundle). A bundle with a draft model is refused: its draft
    would be replaced, and the draft model's files left behind."""
    if manifest.draft is not None and not manifest.draft.is_self:
        raise OptionError(f"{bundle_dir} has a draft model ({manifest.draft.graph}); a bundle has one draft: export "
                          "the target again with --draft self to make a self-draft bundle")
    if manifest.target.quant.get("format") != SEK_FORMAT:
        raise OptionError(f"{bundle_dir}: a self draft runs the target's own kernels in the specedge form "
                          f"(--quant-form specedge, kv_mode rows: the cpu profile's default); this target is "
                          f"{manifest.target.quant.get('format') or manifest.target.precision}")
    tmp_name = f".{graph}.tmp"
    path, tensors = write_self_draft(bundle_dir, manifest.target.graph, skip, tmp_name, manifest.kv_mode)
    os.replace(path, Path(bundle_dir) / graph)
    files = {k: v for k, v in manifest.files.items() if k != graph}
    files[graph] = file_entry(Path(bundle_dir) / graph)
    return dataclasses.replace(manifest, draft=self_entry(manifest, skip, graph, tensors), drafter="model",
                               drafter_params={}, files=dict(sorted(files.items())))
