"""`spec-run`: generate from a bundle, or benchmark it.

    spec-run BUNDLE "prompt" [options]        # = spec-run generate ...: text on stdout, stats on stderr
    spec-run bench BUNDLE [options]           # plain vs speculative, JSON + Markdown + PNG report
"""

from __future__ import annotations

import json
import os
import sys

import click

from .config import config_option
from .errors import ContextLengthError, SpecEdgeError

INVARIANT_HELP = ("Never run a width-1 target step (plain rounds run width 2 with a free one-token guess), so "
                  "speculative output is bitwise the plain output in every weight format. --no-invariant allows the "
                  "narrower width-1 step, whose rows differ from verify rows by kernel rounding.")
CUDA_GRAPHS_HELP = ("TensorRT backend: replay each step width's engine run as a CUDA graph captured at its first step "
                    "(less launch overhead); --no-cuda-graphs always runs execute_async_v3. Other backends ignore it.")
THREADS = click.IntRange(1, 256)  # beyond any edge CPU; ONNX Runtime allocates per-thread state up front


BACKEND_HELP = ("auto (TensorRT where engines are built, else ONNX Runtime CUDA, else CPU) | ort-cpu | ort-cuda | "
                "ort-trt (ONNX Runtime's TensorRT execution provider, engine cache in the bundle) | trt")
PRECISION_HELP = ("Graphs to run: default fp32 on ONNX Runtime and the built engines on TensorRT; fp16/bf16 picks the "
                  "bundle's reduced-precision graphs (spec-export build).")


class _DefaultGenerate(click.Group):
    """A group whose first argument, if it is not a subcommand, starts ``generate``:
    ``spec-run BUNDLE PROMPT`` keeps working next to ``spec-run bench BUNDLE``."""

    def parse_args(self, ctx: click.Context, args: list[str]) -> list[str]:
        if args and args[0] not in self.commands and args[0] not in ("-h", "--help"):
            args = ["generate", *args]
        return super().parse_args(ctx, args)


@click.group(cls=_DefaultGenerate, context_settings={"help_option_names": ["-h", "--help"]})
def main() -> None:
    """Speculative decoding over a specedge bundle. `spec-run BUNDLE PROMPT` generates
    (see `spec-run generate -h`); `spec-run bench BUNDLE` benchmarks."""


@main.command()
@config_option("run")
@click.argument("bundle", type=click.Path())
@click.argument("prompt")
@click.option("--chat", is_flag=True, help="Wrap the prompt as a user message in the bundle's chat template.")
@click.option("--backend", default="auto", show_default=True, help=BACKEND_HELP)
@click.option("--precision", type=click.Choice(["fp32", "fp16", "bf16"]), default=None, help=PRECISION_HELP)
@click.option("--spec", "--drafter", "drafter", type=click.Choice(["auto", "hybrid", "model", "lookup", "prompt-lookup",
                                                                  "off", "none"]), default="auto", show_default=True,
              help="auto: every round, plain, prompt lookup or the draft model (and its k), whichever the measured "
                   "cost model predicts fastest; hybrid: prompt lookup when the context has a match, else the model; "
                   "model / lookup: fixed drafter; off: plain decoding.")
@click.option("--no-spec", is_flag=True, help="Plain decoding (same as --spec off).")
@click.option("--k", "k", type=int, default=None,
              help="(Maximum) draft length, 0..K of the bundle (default K; 0 = plain decoding).")
@click.option("--tree", type=int, default=None,
              help="Tree verification: branch rows a round may add to its draft, 0..8 (0: chains only). Default: "
                   "auto and hybrid add up to 4 where they predict it pays; model and lookup draft chains. With "
                   "model/lookup, B adds the draft's B likeliest runner-ups / B tokens of other matches every round. "
                   "Needs a row-addressed bundle (the specedge CPU form) and greedy or keyed sampling.")
@click.option("--max-new-tokens", type=int, default=128, show_default=True)
@click.option("--temperature", type=float, default=0.0, show_default=True, help="0 = greedy.")
@click.option("--top-p", type=float, default=1.0, show_default=True)
@click.option("--top-k", type=int, default=0, show_default=True)
@click.option("--seed", type=int, default=None)
@click.option("--stop", multiple=True, help="Stop string (repeatable).")
@click.option("--stats", is_flag=True, help="Print statistics to stderr.")
@click.option("--stats-json", is_flag=True, help="Print statistics as JSON to stderr.")
@click.option("--sampler", type=click.Choice(["keyed", "classic"]), default="keyed", show_default=True,
              help="keyed: each position's token is a pure function of (logits, seed, position), so a seed fixes the "
                   "text whatever the drafter; classic: the min(1, p/q) rejection rule. Both sample the target "
                   "distribution exactly.")
@click.option("--threads", type=THREADS, default=None, help="ONNX Runtime intra-op threads (default: physical cores).")
@click.option("--invariant/--no-invariant", default=True, show_default=True, help=INVARIANT_HELP)
@click.option("--cuda-graphs/--no-cuda-graphs", default=True, show_default=True, help=CUDA_GRAPHS_HELP)
def generate(bundle, prompt, chat, backend, precision, drafter, no_spec, k, tree, max_new_tokens, temperature, top_p,
             top_k, seed, stop, stats, stats_json, sampler, threads, invariant, cuda_graphs) -> None:
    """Generate a completion of PROMPT with the speculative runtime over BUNDLE."""
    from .decoder import SpecDecoder
    from .policy import SPEC_MODES
    from .sampling import SamplingParams

    for stream in (sys.stdout, sys.stderr):  # a terminal that cannot show a character gets a replacement, not a crash
        if hasattr(stream, "reconfigure"):
            stream.reconfigure(errors="replace")
    try:
        params = SamplingParams(max_new_tokens=max_new_tokens, temperature=temperature, top_p=top_p, top_k=top_k,
                                seed=seed, stop=tuple(stop), sampler=sampler)
        click.echo(f"loading {bundle} …", err=True)
        dec = SpecDecoder.load(bundle, backend=backend, threads=threads, precision=precision, invariant=invariant,
                               cuda_graphs=cuda_graphs)
        last = None
        if not no_spec and k != 0 and (drafter or "auto") in SPEC_MODES:
            dec.cost_model(say=lambda m: click.echo(m, err=True))  # says so when it times the steps
        for ev in dec.stream(prompt, params, drafter="none" if no_spec else drafter, k=k, chat=chat, tree=tree):
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


def comma_list(cast, allowed: str):
    """A click callback parsing "a,b,c" into a tuple of cast values (also used by spec-export). An empty list, an
    empty item ("2,,4") or an item that is not a ``cast`` is refused; the message says what ``allowed`` is."""
    def parse(ctx, param, value):
        if value is None:
            return None
        items = [v.strip() for v in str(value).split(",")]
        if not any(items):
            raise click.BadParameter(f"{value!r} is empty; give {allowed}")
        if "" in items:
            raise click.BadParameter(f"{value!r} has an empty item; give {allowed}")
        try:
            return tuple(cast(v) for v in items)
        except ValueError:
            raise click.BadParameter(f"{value!r} is not {allowed}") from None
    return parse


@main.command()
@config_option("bench")
@click.argument("bundle", type=click.Path())
@click.option("--suite", default="code,edit,chat,summarize,json", show_default=True,
              callback=comma_list(str, "a comma-separated list of built-in suites: code, edit, chat, summarize, json"),
              help="Built-in suites: code, edit, chat, summarize, json.")
@click.option("--prompts", type=click.Path(dir_okay=False), default=None,
              help="JSONL prompt file ({\"text\": ...} or {\"messages\": [...]}, optional \"suite\", \"id\") "
                   "used instead of the suites.")
@click.option("--k", "ks", default="2,4,6,8", show_default=True,
              callback=comma_list(int, "a comma-separated list of draft lengths 1..K, e.g. 2,4,6,8"),
              help="Draft lengths (<= K).")
@click.option("--drafter", "drafters", default="model,prompt-lookup,none", show_default=True,
              callback=comma_list(str, "a comma-separated list of drafters: model, prompt-lookup, none, auto, hybrid"),
              help="Drafters to compare: model, prompt-lookup, auto, hybrid; plain (none) is always measured as the "
                   "baseline. auto and hybrid run once, at the bundle's K.")
@click.option("--temperature", "temps", default="0", show_default=True,
              callback=comma_list(float, "a comma-separated list of temperatures >= 0, e.g. 0,0.7"),
              help="Sampling temperatures (0 = greedy; greedy runs are also checked token-identical to plain).")
@click.option("--tree", "trees", default="default", show_default=True,
              callback=comma_list(lambda v: None if v == "default" else int(v),
                                  "a comma-separated list of branch rows 0..8 or 'default', e.g. default,0"),
              help="Tree verification, one configuration per drafter and value: branch rows added to a draft chain "
                   "(0: chains only; default: the drafter's own choice, which for auto and hybrid branches where it "
                   "predicts it pays). Names them model:tree2, prompt-lookup:tree2, auto:tree0, ...")
@click.option("--repeats", type=int, default=1, show_default=True)
@click.option("--max-new-tokens", type=int, default=128, show_default=True)
@click.option("--per-suite", type=click.IntRange(min=0), default=0,
              help="Only the first N prompts of each suite (0: all of them).")
@click.option("--ignore-eos", is_flag=True, help="Always generate --max-new-tokens.")
@click.option("--out", type=click.Path(file_okay=False), default="bench/latest", show_default=True,
              help="Folder for the results: new, empty, or a previous bench output. results.json is rewritten "
                   "after every generation, so an interrupted run keeps what it measured.")
@click.option("--no-plots", is_flag=True, help="Skip the PNG plots.")
@click.option("--backend", default="auto", show_default=True, help=BACKEND_HELP)
@click.option("--precision", type=click.Choice(["fp32", "fp16", "bf16"]), default=None, help=PRECISION_HELP)
@click.option("--threads", type=THREADS, default=None)
@click.option("--invariant/--no-invariant", default=True, show_default=True, help=INVARIANT_HELP)
@click.option("--cuda-graphs/--no-cuda-graphs", default=True, show_default=True, help=CUDA_GRAPHS_HELP)
@click.option("--verify", type=click.Choice(["sha256", "size"]), default="sha256", show_default=True,
              help="Check every bundle file's sha256 before benchmarking (size: sizes and sampled blocks, faster on "
                   "big bundles).")
def bench(bundle, suite, prompts, ks, drafters, temps, trees, repeats, max_new_tokens, per_suite, ignore_eos, out,
          no_plots, backend, precision, threads, invariant, cuda_graphs, verify) -> None:
    """Benchmark speculative vs plain decoding on BUNDLE: every configuration and the plain baseline on the same
    prompts, interleaved, in one run. Writes OUT/results.json (after every generation), OUT/report.md and plots;
    prints the table. The prompts (each fits the bundle's context) and OUT are checked before any model loads."""
    from .bench import BenchPlan, load_prompts, run_bench, write_report
    from .bench.report import check_out_dir, write_results
    from .bench.runner import check_bundle_prompts
    from .decoder import SpecDecoder

    saved = []  # generations in OUT/results.json so far

    def save(partial: dict) -> None:
        write_results(partial, out_dir)
        saved[:] = [len(partial["runs"])]

    try:
        plan = BenchPlan(suites=suite, ks=ks, drafters=drafters, temperatures=temps, trees=tuple(trees),
                         repeats=repeats, max_new_tokens=max_new_tokens, per_suite=per_suite, ignore_eos=ignore_eos,
                         prompts=tuple(load_prompts(prompts)) if prompts else ())
        check_bundle_prompts(bundle, plan)  # suites, roles, context length: with the tokenizer, before the models
        out_dir = check_out_dir(out)
        os.environ.setdefault("SPECEDGE_COST_CACHE", "off")  # a benchmark times its own steps (auto's cost model)
        click.echo(f"loading {bundle} …", err=True)
        dec = SpecDecoder.load(bundle, backend=backend, threads=threads, verify=verify, precision=precision,
                               invariant=invariant, cuda_graphs=cuda_graphs)
        raw = run_bench(dec, plan, on_run=save)
        files = write_report(raw, out_dir, plots=not no_plots, say=lambda s: click.echo(s, err=True))
    except SpecEdgeError as e:
        kept = f" ({saved[0]} generations measured before it are in {out_dir / 'results.json'})" if saved else ""
        click.echo(f"error: {e}{kept}", err=True)
        sys.exit(2)
    except KeyboardInterrupt:
        kept = (f"the {saved[0]} generations measured so far are in {out_dir / 'results.json'} (no report: it needs "
                f"the whole plan)") if saved else "nothing was measured yet"
        click.echo(f"\ninterrupted: {kept}", err=True)
        sys.exit(130)
    click.echo(files["markdown"].read_text())
    click.echo(f"wrote {', '.join(str(p) for p in files.values())}", err=True)


def _user_message(line: str) -> dict[str, str]:
    return {"role": "user", "content": line}


def _fits(dec, messages: list[dict[str, str]], params) -> bool:
    """Whether a request of these messages fits the bundle's context."""
    from .request import check_fits

    try:
        check_fits(dec.manifest, len(dec.encode_prompt(messages)), params)
    except SpecEdgeError:
        return False
    return True


@main.command()
@config_option("run")
@click.argument("bundle", type=click.Path())
@click.option("--system", default=None, help="A system message to start the conversation with.")
@click.option("--max-new-tokens", type=int, default=256, show_default=True)
@click.option("--temperature", type=float, default=0.0, show_default=True)
@click.option("--spec", "drafter", default="auto", show_default=True,
              type=click.Choice(["auto", "hybrid", "model", "lookup", "prompt-lookup", "off", "none"]))
@click.option("--backend", default="auto", show_default=True, help=BACKEND_HELP)
@click.option("--threads", type=THREADS, default=None)
@click.option("--cuda-graphs/--no-cuda-graphs", default=True, show_default=True, help=CUDA_GRAPHS_HELP)
def chat(bundle, system, max_new_tokens, temperature, drafter, backend, threads, cuda_graphs) -> None:
    """A terminal chat over BUNDLE: the history is kept (each turn reuses the cached prefix, so it pays only for
    its new tokens); /reset starts over, /quit (or Ctrl-D) leaves. Stats per turn on stderr."""
    from .decoder import SpecDecoder
    from .sampling import SamplingParams

    try:
        dec = SpecDecoder.load(bundle, backend=backend, threads=threads, verify="size", cuda_graphs=cuda_graphs)
        params = SamplingParams(max_new_tokens=max_new_tokens, temperature=temperature)
    except SpecEdgeError as e:
        click.echo(f"error: {e}", err=True)
        sys.exit(2)
    start = [{"role": "system", "content": system}] if system else []
    history = list(start)
    while True:
        try:
            line = input("you> ")
        except (EOFError, KeyboardInterrupt):
            click.echo("", err=True)
            return
        if line.strip() in ("/quit", "/exit"):
            return
        if line.strip() == "/reset":
            history = list(start)
            click.echo("(history cleared)", err=True)
            continue
        if not line.strip():
            continue
        history.append(_user_message(line))
        reply, last = [], None
        try:
            for ev in dec.stream(history, params, drafter=drafter):
                sys.stdout.write(ev.text)
                sys.stdout.flush()
                reply.append(ev.text)
                last = ev
        except ContextLengthError as e:
            history.pop()
            if len(history) > len(start) and _fits(dec, [*start, _user_message(line)], params):
                click.echo(f"\nerror: the context is full: the conversation so far and this message do not fit "
                           f"({e}); /reset starts over with an empty history (/quit leaves)", err=True)
            else:
                click.echo(f"\nerror: this message alone does not fit the context ({e}); send a shorter one",
                           err=True)
            continue
        except SpecEdgeError as e:
            click.echo(f"\nerror: {e}", err=True)
            history.pop()
            continue
        sys.stdout.write("\n")
        history.append({"role": "assistant", "content": "".join(reply)})
        if last is not None and last.stats is not None:
            s = last.stats
            click.echo(f"[{s.new_tokens} tokens, {s.decode_tok_s:.1f} tok/s, ttft {s.ttft_s * 1000:.0f} ms, "
                       f"reused {s.reused_tokens}/{s.prompt_tokens} prompt tokens]", err=True)


@main.command()
@config_option("run")
@click.argument("bundle", type=click.Path())
@click.option("--host", default="127.0.0.1", show_default=True,
              help="Interface to listen on. Keep 127.0.0.1 unless a firewall and --api-key protect the port.")
@click.option("--port", type=click.IntRange(1, 65535), default=8000, show_default=True)
@click.option("--max-queue", type=click.IntRange(1, 1024), default=16, show_default=True,
              help="Requests waiting beyond the running ones; more get 503 with Retry-After.")
@click.option("--max-batch", type=click.IntRange(1, 48), default=None,
              help="Requests decoded together, their rounds in shared steps (each one's text what it is alone). "
                   "Default: 4 for a bundle in the specedge form on the CPU (kv_mode rows) without a self draft, "
                   "else 1; more than 1 needs such a bundle. Each costs a KV cache (spec-export plan --max-batch).")
@click.option("--api-key", envvar="SPECEDGE_API_KEY", default=None,
              help="Require 'Authorization: Bearer KEY' on the /v1 routes (or set SPECEDGE_API_KEY): visible ASCII "
                   "characters, no spaces; an empty key is refused.")
@click.option("--backend", default="auto", show_default=True, help=BACKEND_HELP)
@click.option("--threads", type=THREADS, default=None)
@click.option("--log-level", type=click.Choice(["critical", "error", "warning", "info", "debug"]), default="info")
@click.option("--cuda-graphs/--no-cuda-graphs", default=True, show_default=True, help=CUDA_GRAPHS_HELP)
@click.option("--drafter", type=click.Choice(["auto", "hybrid", "model", "lookup", "prompt-lookup", "off", "none"]),
              default="auto", show_default=True,
              help="The drafter of a request that names none in its 'speculation' field (see spec-run generate).")
@click.option("--ray", "ray_address", default=None, metavar="ADDRESS",
              help="Serve as replicas on the Ray cluster at ADDRESS ('auto': the cluster this machine is part of; "
                   "host:port of its head), behind one endpoint at --host:--port; a conversation's turns go to one "
                   "replica. BUNDLE must be at the same path on every node. Needs the [ray] extra.")
@click.option("--replicas", type=click.IntRange(1, 1024), default=1, show_default=True,
              help="With --ray: replicas, each its own decoder.")
@click.option("--max-replicas", type=click.IntRange(1, 1024), default=None,
              help="With --ray: above --replicas, Ray Serve scales between the two with the load.")
@click.option("--replica-cpus", type=click.FloatRange(0.1, 1024), default=None,
              help="With --ray: CPUs each replica reserves (default --threads, else 1).")
@click.option("--replica-gpus", type=click.FloatRange(0, 64), default=0, show_default=True,
              help="With --ray: GPUs each replica reserves.")
@click.option("--replica-resource", multiple=True, metavar="NAME=AMOUNT",
              help="With --ray: a custom node resource each replica needs (repeatable), e.g. jetson=1 for nodes "
                   "started with --resources '{\"jetson\": 1}'.")
def serve(bundle, host, port, max_queue, max_batch, api_key, backend, threads, log_level, cuda_graphs,
          drafter, ray_address, replicas, max_replicas, replica_cpus, replica_gpus, replica_resource) -> None:
    """Serve BUNDLE over an OpenAI-compatible HTTP API (/v1/chat/completions, /v1/completions, /v1/models,
    /health, /metrics). Needs the [serve] extra; --ray, the [ray] extra."""
    from .server import serve as run_server

    if api_key is None and "SPECEDGE_API_KEY" in os.environ:  # click reads an empty variable as unset
        api_key = os.environ["SPECEDGE_API_KEY"]  # refused as empty, not taken as "no key"
    if ray_address is None and (replicas != 1 or max_replicas or replica_cpus or replica_gpus or replica_resource):
        click.echo("error: --replicas, --max-replicas and --replica-* place replicas on a Ray cluster: give --ray "
                   "ADDRESS too", err=True)
        sys.exit(2)
    try:
        if ray_address is not None:
            from .openai_api import check_api_key
            from .serve_ray import RayOptions, parse_resources, serve_on_ray

            options = RayOptions(address=ray_address, replicas=replicas, max_replicas=max_replicas,
                                 replica_cpus=replica_cpus or float(threads or 1), replica_gpus=replica_gpus,
                                 resources=parse_resources(replica_resource))
            serve_on_ray(bundle, options, host=host, port=port,
                         serve_kw={"backend": backend, "threads": threads, "max_batch": max_batch,
                                   "max_queue": max_queue, "api_key": check_api_key(api_key), "drafter": drafter})
            return
        run_server(bundle, host=host, port=port, max_queue=max_queue, api_key=api_key, backend=backend,
                   threads=threads, log_level=log_level, cuda_graphs=cuda_graphs, drafter=drafter,
                   max_batch=max_batch)
    except SpecEdgeError as e:
        click.echo(f"error: {e}", err=True)
        sys.exit(2)


if __name__ == "__main__":  # pragma: no cover
    main()
