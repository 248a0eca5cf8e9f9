"""`spec-run`: generate from a bundle. The text goes to stdout; progress and stats to stderr."""

from __future__ import annotations

import json
import sys

import click

from .errors import SpecEdgeError


@click.command(context_settings={"help_option_names": ["-h", "--help"]})
@click.argument("bundle", type=click.Path())
@click.argument("prompt")
@click.option("--chat", is_flag=True, help="Wrap the prompt as a user message in the bundle's chat template.")
@click.option("--backend", default="auto", show_default=True, help="auto | ort-cpu | ort-cuda | trt")
@click.option("--drafter", type=click.Choice(["model", "prompt-lookup", "none"]), default=None,
              help="Who drafts (default: the bundle's drafter).")
@click.option("--no-spec", is_flag=True, help="Plain decoding (same as --drafter none).")
@click.option("--k", "k", type=int, default=None, help="Draft length, 1..K of the bundle (default K).")
@click.option("--max-new-tokens", type=int, default=128, show_default=True)
@click.option("--temperature", type=float, default=0.0, show_default=True, help="0 = greedy.")
@click.option("--top-p", type=float, default=1.0, show_default=True)
@click.option("--top-k", type=int, default=0, show_default=True)
@click.option("--seed", type=int, default=None)
@click.option("--stop", multiple=True, help="Stop string (repeatable).")
@click.option("--stats", is_flag=True, help="Print statistics to stderr.")
@click.option("--stats-json", is_flag=True, help="Print statistics as JSON to stderr.")
@click.option("--threads", type=int, default=None, help="ONNX Runtime intra-op threads (default: physical cores).")
def main(bundle, prompt, chat, backend, drafter, no_spec, k, max_new_tokens, temperature, top_p, top_k, seed, stop,
         stats, stats_json, threads) -> None:
    """Generate a completion of PROMPT with the speculative runtime over BUNDLE."""
    from .decoder import SpecDecoder
    from .sampling import SamplingParams

    try:
        params = SamplingParams(max_new_tokens=max_new_tokens, temperature=temperature, top_p=top_p, top_k=top_k,
                                seed=seed, stop=tuple(stop))
        click.echo(f"loading {bundle} …", err=True)
        dec = SpecDecoder.load(bundle, backend=backend, threads=threads)
        last = None
        for ev in dec.stream(prompt, params, drafter="none" if no_spec else drafter, k=k, chat=chat):
            sys.stdout.write(ev.text)
            sys.stdout.flush()
            last = ev
        sys.stdout.write("\n")
    except SpecEdgeError as e:
        click.echo(f"error: {e}", err=True)
        sys.exit(2)
    if last is not None and last.stats is not None:
        if stats:
            click.echo(f"[{dec.backend}] {last.stats}", err=True)
        if stats_json:
            click.echo(json.dumps(last.stats.as_dict()), err=True)


if __name__ == "__main__":  # pragma: no cover
    main()
