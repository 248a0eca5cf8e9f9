"""Export a target (+ draft) into a bundle directory, atomically.

Everything is written into a temporary sibling directory and swapped into place
only when complete (:mod:`.install`), so a failed or interrupted export never leaves a
half-written bundle and never loses the previous one.
"""

from __future__ import annotations

import dataclasses
import json
import resource
import shutil
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import onnx

from specedge.runtime.bundle_files import file_entry
from specedge.runtime.errors import BundleError, OptionError, UnsupportedModelError
from specedge.runtime.manifest import (
    BATCH_WIDTHS,
    DEFAULT_NGRAM_MAX,
    DEFAULT_NGRAM_MIN,
    KV_DTYPE_SHORT,
    KV_DTYPES,
    KV_MODES,
    MAX_CONTEXT,
    ONNX_OPSET,
    ROWS_KV_MODE,
    SEK_FORMAT,
    HeadRows,
    Manifest,
    ModelEntry,
    model_widths,
    write_manifest,
)

from .fetch import resolve_model
from .graph import build_model_graph
from .install import MARKER, check_destination, install, real_destination, workspace
from .loaders import WeightSource, load_source
from .quant import QDQ_OPSET, WeightFormat
from .self_draft import external_tensors, format_layers, is_self, parse_skip, with_self_draft
from .tokenizer import TOKENIZER_FILE, check_same_vocab, write_tokenizer

DRAFT_NO_MODEL = ("prompt-lookup", "none")
MAX_K = 16  # longest draft a bundle may verify (see ExportOptions)


@dataclass(frozen=True)
class ExportOptions:
    k: int = 4
    max_context: int = 2048
    prefill_chunk: int = 64
    lookup_ngram_max: int = DEFAULT_NGRAM_MAX
    lookup_ngram_min: int = DEFAULT_NGRAM_MIN
    verify_widths: tuple[int, ...] = ()  # extra verify widths 2..K (K+1 is always there)
    # the draft's narrow prefill widths, 2..P-1 (None: manifest.DRAFT_CATCHUP_WIDTHS below P)
    draft_catchup_widths: tuple[int, ...] | None = None
    weights: WeightFormat = WeightFormat()  # target
    draft_weights: WeightFormat | None = None  # None: same as the target
    # portable (every backend) | ort-inplace (ONNX Runtime GroupQueryAttention; specedge's attention in its form)
    # | rows (the specedge form: row-addressed steps over a pool of KV slots, for batches of requests)
    kv_mode: str = "portable"
    kv_dtype: str = "float32"  # the KV caches' elements: float32; float16 or int8 (specedge's attention only)
    device_argmax: bool = False  # graphs also output next_ids = ArgMax(logits) (see Manifest.device_argmax)
    draft_vocab: int = 0  # > 0: the draft's lm_head keeps token ids < draft_vocab + the special tokens (HeadRows)
    overwrite: bool = False
    cache_dir: str | None = None
    extra: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not 1 <= self.k <= MAX_K:
            raise BundleError(f"--k must be in 1..{MAX_K}, got {self.k}: a verify step of K+1 tokens costs up to "
                              f"K+1 plain steps on a CPU, and drafts beyond {MAX_K} tokens are almost never all "
                              f"accepted (llama.cpp's --draft-max default is 16 too)")
        if self.prefill_chunk < 1:
            raise BundleError(f"--prefill-chunk must be >= 1, got {self.prefill_chunk}")
        if self.max_context > MAX_CONTEXT:  # the manifest's own bound, checked before the export's work
            raise BundleError(f"--max-context {self.max_context} is over the most a bundle takes, {MAX_CONTEXT}: the "
                              f"KV buffers are allocated at that length up front (`spec-export plan` sizes them)")
        if self.max_context < self.prefill_chunk + self.k + 1:
            raise BundleError(
                f"--max-context {self.max_context} is too small for prefill chunk {self.prefill_chunk} + "
                f"verify width K+1 {self.k + 1}: it must be at least {self.prefill_chunk + self.k + 1}")
        if self.kv_mode not in KV_MODES:
            raise BundleError(f"--kv-mode {self.kv_mode!r}: choose one of {', '.join(KV_MODES)}")
        if self.kv_mode == ROWS_KV_MODE and not all(f.specedge for f in (self.weights, self.draft_weights or
                                                                           self.weights)):
            raise BundleError("--kv-mode rows (row-addressed steps, for batches of requests) runs specedge's "
                              "attention, which only the specedge form has (--weights int8/int4 --quant-form "
                              "specedge, for a CPU): choose --kv-mode ort-inplace for this form")
        if self.kv_dtype not in KV_DTYPES:
            raise BundleError(f"--kv-dtype {self.kv_dtype!r}: choose one of {', '.join(KV_DTYPES)}")
        if self.kv_dtype != "float32" and not (self.kv_mode in (ROWS_KV_MODE, "ort-inplace") and all(
                f.specedge for f in (self.weights, self.draft_weights or self.weights))):
            short = KV_DTYPE_SHORT[self.kv_dtype]
            raise BundleError(f"--kv-dtype {short} is read by specedge's attention, which only the specedge form has "
                              f"(--weights int8/int4 --quant-form specedge for target and draft, --kv-mode rows or "
                              f"ort-inplace); this export is {self.weights.name} {self.weights.form}, kv "
                              f"{self.kv_mode}: choose --kv-dtype fp32")
        if self.weights.even_widths and self.prefill_chunk % 2:
            raise BundleError(f"--prefill-chunk {self.prefill_chunk}: an int8/int4 MatMulNBits target needs an even "
                              f"prefill chunk (ONNX Runtime's kernel takes rows in pairs; see manifest.model_widths; "
                              f"--weights int8 --quant-form intgemm has no such rule)")
        if self.draft_vocab < 0 or isinstance(self.draft_vocab, bool):
            raise BundleError(f"--draft-vocab must be 0 (the whole vocabulary) or a number of token ids, got "
                              f"{self.draft_vocab}")
        bad = [t for t in self.verify_widths if not 2 <= t <= self.k + 1]
        if bad:
            raise BundleError(f"--verify-widths {bad} out of range: each must be in 2..K+1={self.k + 1}")
        bad = [t for t in self.draft_catchup_widths or () if not 2 <= t < self.prefill_chunk]
        if bad:
            raise BundleError(f"--draft-catchup-widths {bad} out of range: each must be in 2..P-1="
                              f"{self.prefill_chunk - 1} (below the prefill chunk), or 'none'")
        if not 1 <= self.lookup_ngram_min <= self.lookup_ngram_max <= 64:
            raise BundleError(f"prompt-lookup n-gram range {self.lookup_ngram_min}..{self.lookup_ngram_max} "
                              "is not allowed: "
                              f"need 1 <= --ngram-min <= --ngram-max <= 64 (defaults {DEFAULT_NGRAM_MIN} and "
                              f"{DEFAULT_NGRAM_MAX})")


@dataclass(frozen=True)
class ExportReport:
    manifest: Manifest
    out: Path
    seconds: float
    peak_rss_mb: float
    bytes_total: int


def peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0


def export_bundle(target: str | Path, draft: str | Path, out: str | Path, opts: ExportOptions = ExportOptions(),
                  progress: Callable[[str], None] | None = None) -> ExportReport:
    """Export `target` and `draft` ("prompt-lookup", "none", a known model name or a path) into `out`.
    A filesystem failure (read-only folder, disk full, permissions) is a BundleError naming the path; the
    previous bundle at `out`, if any, is kept (see :mod:`.install`)."""
    try:
        return _export(target, draft, out, opts, progress)
    except OSError as e:
        where = e.filename or out
        raise BundleError(f"cannot write the bundle {out}: {e.strerror or e} ({where}); nothing was replaced") \
            from None


def _export(target: str | Path, draft: str | Path, out: str | Path, opts: ExportOptions,
            progress: Callable[[str], None] | None) -> ExportReport:
    say = progress or (lambda s: None)
    t0 = time.perf_counter()
    out = Path(out)
    dest = real_destination(out)  # --out a symbolic link: the bundle goes where it points, the link is kept
    check_destination(dest, opts.overwrite)  # before any work: never replace what is not ours
    draft = str(draft)
    tsrc = load_source(resolve_model(str(target), opts.cache_dir, say))
    if opts.draft_vocab and (draft in DRAFT_NO_MODEL or is_self(draft)):
        raise BundleError(f"--draft-vocab {opts.draft_vocab} sets a draft model's lm_head, and --draft {draft} has no "
                          f"model: drop --draft-vocab or name a draft model")
    self_skip = _self_skip(draft, tsrc, opts)  # --draft self[:LAYERS|auto]: None for a search, () for no self draft
    dsrc = None if draft in DRAFT_NO_MODEL or is_self(draft) else load_source(resolve_model(draft, opts.cache_dir, say))
    for role, src in (("target", tsrc), ("draft", dsrc)):
        if src is not None:
            _check_supported(role, src, opts)

    with workspace(dest) as tmp:
        # tokenizers first: a draft with another vocabulary is refused before minutes of graph export
        tok = write_tokenizer(tsrc, tmp)
        for role, src in (("target", tsrc), ("draft", dsrc)):  # an id past the embedding fails only at run time
            if src is not None and src.config.dims.vocab < tok.vocab_size:
                raise BundleError(f"the {role} {src.path} has {src.config.dims.vocab} embedding rows and its "
                                  f"tokenizer {tok.vocab_size} ids: the file and its tokenizer disagree")
        if dsrc is not None:
            dtok_dir = Path(tempfile.mkdtemp(dir=tmp))
            write_tokenizer(dsrc, dtok_dir)
            check_same_vocab(tmp / TOKENIZER_FILE, dtok_dir / TOKENIZER_FILE)
            shutil.rmtree(dtok_dir)
        say(f"target: {tsrc.config.family.name} {_dims_str(tsrc)} from {tsrc.path}")
        target_entry = _export_model("target", tsrc, tmp, opts, say)
        draft_entry = None
        if dsrc is not None:
            say(f"draft: {dsrc.config.family.name} {_dims_str(dsrc)} from {dsrc.path}")
            head = _draft_head(dsrc, tmp / TOKENIZER_FILE, tok.eos_ids, opts.draft_vocab, say)
            draft_entry = _export_model("draft", dsrc, tmp, opts, say, head)
        files = {}
        for f in sorted(p for p in tmp.iterdir() if p.name != MARKER):  # (the marker is the workspace's)
            say(f"hashing {f.name}")
            files[f.name] = file_entry(f)
        from specedge.runtime import __version__

        manifest = Manifest(
            max_context=opts.max_context, k=opts.k, prefill_chunk=opts.prefill_chunk,
            target=target_entry, draft=draft_entry,
            drafter="model" if dsrc is not None else "none" if is_self(draft) else draft,
            drafter_params=({"ngram_max": opts.lookup_ngram_max, "ngram_min": opts.lookup_ngram_min}
                            if draft == "prompt-lookup" else {}),
            tokenizer=tok, files=files, created_by=f"specedge {__version__}", kv_mode=opts.kv_mode,
            kv_dtype=opts.kv_dtype,
            device_argmax=opts.device_argmax,
            opset=max(QDQ_OPSET if (f or opts.weights).qdq else ONNX_OPSET for f in (opts.weights, opts.draft_weights)),
        )
        write_manifest(tmp, manifest)
        if is_self(draft):
            manifest = _add_self_draft(tmp, manifest, self_skip, say)
            write_manifest(tmp, manifest)
        tmp.chmod(0o755)  # mkdtemp makes it private; a bundle is an ordinary directory
        install(tmp, dest)
    total = sum(m["bytes"] for m in manifest.files.values())
    return ExportReport(manifest, out, time.perf_counter() - t0, peak_rss_mb(), total)


def _self_skip(draft: str, tsrc: WeightSource, opts: ExportOptions) -> tuple[int, ...] | None:
    """--draft self:LAYERS -> the layers to skip, checked before any work; self or self:auto -> None (search)."""
    if not is_self(draft):
        return ()
    if opts.kv_mode != ROWS_KV_MODE or not opts.weights.specedge:
        raise OptionError(f"--draft {draft}: a self draft shares the target's weights and KV cache, which needs the "
                          f"specedge form with row-addressed steps (--for cpu: --quant-form specedge, --kv-mode rows); "
                          f"this export is {opts.weights.name} {opts.weights.form}, kv {opts.kv_mode}")
    spec = draft.partition(":")[2]
    return None if spec in ("", "auto") else parse_skip(spec, tsrc.config.dims.n_layers)


def _add_self_draft(tmp: Path, manifest: Manifest, skip: tuple[int, ...] | None,
                    say: Callable[[str], None]) -> Manifest:
    if skip is None:
        from .self_search import search_skip

        say("self draft: searching the layers to skip (spec-export self-search prints the same)")
        result = search_skip(tmp, progress=lambda s: say(f"  {s}"))
        skip = result.best.skip
        say(f"self draft: skipping {format_layers(skip)} (first-token acceptance {result.best.alpha:.2f}, "
            f"predicted {result.best.speedup:.2f}x plain at k={result.best.k})")
        if result.best.speedup < 1:
            say("self draft: no set tried is predicted to beat plain decoding on this machine: auto will not choose "
                "it (the bundle keeps it; prompt lookup and plain rounds are still auto's)")
    out = with_self_draft(tmp, manifest, skip)
    say(f"self draft: {out.draft.dims.n_layers} of {manifest.target.dims.n_layers} target layers, no weights of "
        "its own")
    return out


def _dims_str(src: WeightSource) -> str:
    d = src.config.dims
    return f"(layers {d.n_layers}, hidden {d.hidden}, heads {d.n_heads}/{d.n_kv_heads}, vocab {d.vocab})"


def _check_supported(role: str, src: WeightSource, opts: ExportOptions) -> None:
    D = src.config.dims.head_dim
    if opts.kv_mode == "ort-inplace" and D % 16:
        raise UnsupportedModelError(
            f"{role} has head_dim {D}; ONNX Runtime's GroupQueryAttention (--kv-mode ort-inplace) needs a multiple "
            f"of 16: export for TensorRT with --kv-mode portable (--for datacenter-gpu; a CPU profile refuses it)")
    fmt = opts.weights if role == "target" else draft_format(opts)
    R = src.config.rot_dim()
    if opts.kv_mode == "ort-inplace" and not fmt.specedge and (R // 2) % 8:
        raise UnsupportedModelError(
            f"{role} rotates {R} of each head's {D} dims; ONNX Runtime's GroupQueryAttention (--kv-mode ort-inplace "
            "outside the specedge form) takes rotary tables a multiple of 8 wide (a multiple of 16 rotated dims): "
            "export in the specedge form (--quant-form specedge) or with --kv-mode portable")
    if fmt.intgemm_smooth and not src.config.plain_layers():
        raise UnsupportedModelError(
            f"--intgemm-smooth calibrates on a numpy forward pass of llama's layer; {role} is a "
            f"{src.config.family.name} model, whose layers differ (q/k norm, multipliers or layers without RoPE): "
            f"export it without --intgemm-smooth")


def draft_format(opts: ExportOptions) -> WeightFormat:
    """The draft's weight format: ``draft_weights`` (None: the target's), and an int4 draft's lm_head at int4 where
    the format leaves the head to its default (``lm_head`` "auto", which means int8 for a target): the draft only
    proposes, so its head's rounding changes which tokens it proposes, never the output. Measured on the 0.5B
    Qwen draft: a draft step 16.2 -> 13.5 ms, acceptance 75.2 -> 75.7 % (docs/weight-formats.md)."""
    fmt = opts.draft_weights or opts.weights
    if fmt.name == "int4" and fmt.lm_head == "auto" and not fmt.intgemm:
        return dataclasses.replace(fmt, lm_head="int4")
    return fmt


def _draft_head(src: WeightSource, tokenizer: Path, eos_ids: tuple[int, ...], draft_vocab: int,
                say: Callable[[str], None]) -> HeadRows | None:
    """--draft-vocab N: the draft's head over ids 0..N-1 (byte-level BPE ids are in merge order: the most frequent
    tokens first) plus every added token above them (end-of-turn, end-of-text, tool and FIM markers), so the draft
    can still propose the end of an answer. None: the whole vocabulary."""
    V = src.config.dims.vocab
    if not draft_vocab or draft_vocab >= V:
        return None
    added = json.loads(tokenizer.read_text(encoding="utf-8")).get("added_tokens", [])
    extra = tuple(sorted({i for i in [*(int(t["id"]) for t in added), *eos_ids] if draft_vocab <= i < V}))
    head = HeadRows(draft_vocab, extra)
    say(f"draft: lm_head over {head.width} of {V} token ids (0..{draft_vocab - 1} and {len(extra)} added tokens)")
    return head


def _export_model(role: str, src: WeightSource, tmp: Path, opts: ExportOptions,
                  say: Callable[[str], None], head: HeadRows | None = None) -> ModelEntry:
    t0 = time.perf_counter()
    fmt = opts.weights if role == "target" else draft_format(opts)
    smoothing = None
    if fmt.intgemm_smooth:
        src, smoothing = _smoothed(role, src, tmp, fmt.intgemm_smooth, say)
    onnx_path, data_path, quant = build_model_graph(src, tmp, role, progress=lambda s: say(f"  {role}: {s}"), fmt=fmt,
                                                    kv_mode=opts.kv_mode, kv_dtype=opts.kv_dtype,
                                                    max_positions=opts.max_context, argmax=opts.device_argmax,
                                                    head_ids=None if head is None else head.ids())
    if smoothing:
        quant["smoothing"] = smoothing
    if quant:
        types = quant.get("requantized_gguf_types")
        lossy = f"; GGUF {', '.join(types)} blocks have no exact form here and were re-quantized" if types else ""
        say(f"  {role}: {fmt.name}: {quant['repacked_from_gguf']} matrices re-packed from GGUF blocks, "
            f"{quant['requantized']} re-quantized (weight rel. RMS error {quant['requant_weight_rel_rms_error']:.4f})"
            f"{lossy}")
    say(f"  {role}: graph written in {time.perf_counter() - t0:.1f}s, peak RSS {peak_rss_mb():.0f} MB")
    return ModelEntry(
        family=src.config.family.name, dims=src.config.dims, graph=onnx_path.name, weights=data_path.name,
        precision=fmt.name, widths=model_widths(role, opts.k, opts.prefill_chunk, opts.verify_widths,
                                                even=role == "target" and fmt.even_widths,
                                                catchup=opts.draft_catchup_widths,
                                                batch=tuple(t for t in BATCH_WIDTHS if t <= opts.max_context)
                                                if opts.kv_mode == ROWS_KV_MODE else ()),
        source=src.describe(), quant=quant, head=head,
        # the specedge form's tensors, which the runtime reads itself (its kernels keep no packed copy of their own)
        tensors=external_tensors(onnx.load(str(onnx_path), load_external_data=False))
        if quant.get("format") == SEK_FORMAT else {},
    )


def _smoothed(role: str, src: WeightSource, tmp: Path, alpha: float,
              say: Callable[[str], None]) -> tuple[WeightSource, dict[str, Any]]:
    """--intgemm-smooth: activation maxima from a float forward pass over the calibration text, folded into the
    weights (export/smooth.py)."""
    from tokenizers import Tokenizer

    from .smooth import CALIBRATION_TEXT, MAX_CALIBRATION_TOKENS, activation_maxima, smoothed, smoothing_factors

    t0 = time.perf_counter()
    ids = Tokenizer.from_file(str(tmp / TOKENIZER_FILE)).encode(CALIBRATION_TEXT).ids[:MAX_CALIBRATION_TOKENS]
    w_max: dict = {}  # the weights' column maxima, from the same pass (a GGUF's weights dequantized once)
    maxima = activation_maxima(src, ids, progress=lambda s: say(f"  {role}: {s}"), weight_maxima=w_max)
    factors = smoothing_factors(src, maxima, alpha, weight_maxima=w_max)
    say(f"  {role}: smoothing (alpha {alpha}) from {len(ids)} calibration tokens in {time.perf_counter() - t0:.1f}s")
    return smoothed(src, factors), {"alpha": alpha, "calibration_tokens": len(ids)}
