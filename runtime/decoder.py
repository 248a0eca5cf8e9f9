"""The decode loop: prefill, then rounds of draft -> verify -> accept -> commit.

``SpecDecoder.stream`` is one generator yielding :class:`StreamEvent`s; ``generate``
collects them. A round is four short functions over one small :class:`_Request`.

Invariant between rounds: the target cache holds rows for ``tokens[:n-1]`` — every
committed token except the last, which is fed first in the next verify call.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import operator
import os
import platform
import tempfile
import threading
import time
import warnings
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from .adaptive import SPEC_MODES, AutoDrafter, CostModel
from .backends import GraphRunner, open_runner, resolve_backend
from .drafters import (
    Drafter,
    ModelDrafter,
    NoDrafter,
    PromptLookupDrafter,
    Proposal,
    feed,
)
from .errors import BundleError, ContextLengthError, OptionError, PromptError, SamplingParamsError
from .manifest import (
    DEFAULT_NGRAM_MAX,
    DEFAULT_NGRAM_MIN,
    INTGEMM_FORMAT,
    MANIFEST_NAME,
    SEK_ATTENTION,
    SEK_FORMAT,
    VERIFY_MODES,
    Manifest,
    read_manifest,
)
from .sampling import (
    SamplingParams,
    accept_argmax,
    choose_next,
    process_logits,
    top1_probability,
    verify_greedy,
    verify_keyed,
    verify_sampled,
)
from .stats import Stats
from .text import IncrementalDetokenizer, TextCodec, check_text

Prompt = str | Sequence[dict[str, Any]]
COST_CACHE_MAX_AGE_S = 24 * 3600  # step costs kept between processes this long (SpecDecoder.cost_model)
# How the kept step costs were timed; entries of another timing are timed again. 2: widths in turn in each pass
# (``SpecDecoder.time_steps``). Entries of the older order (one width after another) kept a phase of a shared machine
# as their shape for a day: a 2-token step at 1.4x a 1-token one on the Haswell build, where it runs 1.04-1.08x.
STEP_TIMING = 2


def _close_shared(shared: dict) -> None:
    """Free what the runners of one bundle share (TensorRT: the scratch and the stream both runners used)."""
    if "scratch" in shared:
        shared["scratch"].close()
        shared["cuda"].stream_destroy(shared["stream"])
    shared.clear()


def _read_step_costs(path: Path | None) -> dict[str, dict[int, float]] | None:
    """Step costs a previous process measured ({role: {width: seconds}}), or None (none kept, too old, timed another
    way, unreadable)."""
    if path is None:
        return None
    try:
        raw = json.loads(path.read_text())
        if raw.get("timing") != STEP_TIMING or not 0 <= time.time() - float(raw["measured_at"]) <= COST_CACHE_MAX_AGE_S:
            return None
        steps = {role: {int(t): float(s) for t, s in raw["steps"][role].items()} for role in raw["steps"]}
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return None
    if "target" not in steps or not all(s > 0 and math.isfinite(s) for d in steps.values() for s in d.values()):
        return None
    return steps


def _write_step_costs(path: Path | None, steps: dict[str, dict[int, float]]) -> None:
    """Keep measured step costs for the next process (atomically; a cache that cannot be written is skipped)."""
    if path is None:
        return
    tmp = None
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile("w", dir=path.parent, suffix=".tmp", delete=False) as f:
            tmp = f.name
            json.dump({"timing": STEP_TIMING, "measured_at": time.time(), "steps": {r: {str(t): s for t, s in d.items()}
                                                             for r, d in steps.items()}}, f)
        os.replace(tmp, path)
    except OSError:
        if tmp is not None:
            Path(tmp).unlink(missing_ok=True)


@dataclass
class StreamEvent:
    text: str  # new text since the previous event (may be "")
    token_ids: list[int]  # tokens committed in this event
    finished: bool = False
    finish_reason: str | None = None  # "eos" | "stop" | "length"
    stats: Stats | None = None  # on the final event


@dataclass
class GenerationResult:
    text: str
    token_ids: list[int]
    finish_reason: str
    stats: Stats


@dataclass
class _Request:
    tokens: np.ndarray  # [S_max] int64, committed tokens in tokens[:n]
    n: int
    n_prompt: int
    params: SamplingParams
    rng: np.random.Generator
    stats: Stats
    detok: IncrementalDetokenizer
    text: str = ""
    emitted_chars: int = 0
    finish: str | None = None
    stop_hold: int = 0  # chars held back while they could start a stop string
    pending: list[int] = field(default_factory=list)

    @property
    def generated(self) -> int:
        return self.n - self.n_prompt


class SpecDecoder:
    """Speculative decoder over a bundle. Its graph runners (ONNX Runtime sessions, TensorRT contexts) open once and
    serve many requests.

    Thread safety: one prefill or round runs at a time per decoder (a lock held for one step of work, never
    across a yield), so streams from several threads, or several streams interleaved in one thread, are all
    served; a paused or abandoned stream blocks nobody. A stream resumed after another request ran re-prefills
    its committed tokens (``Stats.resyncs``). Use one decoder per thread for parallel throughput.
    """

    def __init__(self, bundle_dir: Path, manifest: Manifest, backend: str, target: GraphRunner,
                 draft: GraphRunner | None, codec: TextCodec, invariant: bool = True):
        self.bundle_dir, self.manifest, self.backend = bundle_dir, manifest, backend
        self.target, self.draft_runner, self.codec = target, draft, codec
        # Batch invariance: the target never runs a width-1 step (GraphRunner.min_width), so every logits row is
        # computed by the same kernels whatever the drafter, k or auto's choice; a round with nothing to verify
        # carries a free one-token guess instead of running alone.
        self.invariant = invariant
        t = manifest.target
        # specedge's own kernels (matmul and attention) compute a lone row exactly as inside a wider step: there
        # plain decoding runs width 1 (no guess row) and stays bitwise the same
        self.width1_exact = (t.quant or {}).get("attention") == SEK_ATTENTION
        target.min_width = 2 if invariant and not self.width1_exact else 1
        odd = [w.T for w in t.widths if w.L == w.T and w.T > 1 and w.T % 2]
        # integer GEMM alone, or specedge's kernel: exact at any width
        pairs = t.quant and t.quant.get("format") not in (INTGEMM_FORMAT, SEK_FORMAT)
        if invariant and pairs and odd and t.quant.get("block", 32) >= 64:  # block 32: the same rounding (measured)
            warnings.warn(f"{bundle_dir}: this int8/int4 target declares odd verify widths {odd}; with blocks >= 64 "
                          f"ONNX Runtime computes an odd last row by other rounding, so speculative output may differ "
                          f"from plain. Re-export it: new exports use even widths (docs/exactness.md).", stacklevel=3)
        if backend == "ort-cpu" and manifest.kv_mode == "portable":
            warnings.warn(f"{bundle_dir}: a portable-KV bundle on a CPU: its attention's rows differ by ~1e-6 between "
                          f"feeding patterns, so greedy speculation equals plain decoding except at near-ties. "
                          f"Export with --for cpu (in-place KV) for bitwise identity (docs/exactness.md).",
                          stacklevel=3)
        p = manifest.drafter_params
        # the free guess takes any match, down to one token: it rides in a width-2 step that runs anyway
        self._guesser = PromptLookupDrafter(p.get("ngram_max", DEFAULT_NGRAM_MAX), 1)
        self._lock = threading.Lock()  # held for one prefill or round at a time (never across a yield)
        self._owner: _Request | None = None  # the request whose rows the caches hold
        self._costs: CostModel | None = None  # measured on the first auto/hybrid request, refreshed every round
        self._shared: dict = {}  # what the runners share (TensorRT: CUDA stream and scratch memory)
        self.precision = "fp32"  # of the graphs/engines run (set by load)
        self.threads: int | None = None  # as given to load (None: its default)

    @classmethod
    def load(cls, bundle: str | Path, backend: str = "auto", verify: str = "size",
             threads: int | None = None, precision: str | None = None, invariant: bool = True,
             cuda_graphs: bool = True) -> SpecDecoder:
        """verify: "size" (default: every file present with its recorded size — what the CLI does; a bit flip in a
        weight file is not caught), "sha256" (hash every file first: minutes for gigabytes on a Jetson; `spec-export
        info BUNDLE` does it on demand) or "none".
        backend: auto | ort-cpu | ort-cuda | ort-trt | trt. precision: None (fp32 graphs on ONNX Runtime; the
        built engines on TensorRT) or fp16/bf16 (the bundle's reduced-precision graphs or engines).
        invariant: True (default) runs every target step at width >= 2, so speculative output is bitwise the
        plain output in every weight format; False lets plain rounds run a narrower width-1 step whose rows
        differ from verify rows by kernel rounding (int8/int4: up to ~0.6 in a logit).
        cuda_graphs: TensorRT only - True (default) captures each width's engine run into a CUDA graph at its first
        step and replays it after (less launch overhead per step); False always runs execute_async_v3."""
        if threads is not None and (isinstance(threads, bool) or not isinstance(threads, int)
                                    or not 1 <= threads <= 256):
            raise OptionError(f"threads must be an int in 1..256 (or None: physical cores), got {threads!r}")
        if verify not in VERIFY_MODES:
            raise OptionError(f"verify must be one of {', '.join(VERIFY_MODES)}, got {verify!r}")
        if precision not in (None, "fp32", "fp16", "bf16"):
            raise OptionError(f"precision must be fp16 or bf16 (the bundle's reduced-precision graphs or engines), "
                              f"fp32 or None, got {precision!r}; int8/int4 weights are chosen at export (--weights)")
        if not isinstance(bundle, (str, os.PathLike)):
            raise OptionError(f"bundle must be a path to a bundle directory, got {type(bundle).__name__}")
        bundle_dir = Path(bundle)
        manifest = read_manifest(bundle_dir, verify=verify)
        backend = resolve_backend(backend, manifest)
        shared: dict = {}
        target = draft = None
        try:
            target = open_runner(backend, bundle_dir, manifest, "target", threads, precision, shared,
                                 cuda_graphs=cuda_graphs)
            draft = (open_runner(backend, bundle_dir, manifest, "draft", threads, precision, shared,
                                 cuda_graphs=cuda_graphs) if manifest.draft else None)
            dec = cls(bundle_dir, manifest, backend, target, draft, TextCodec(bundle_dir, manifest.tokenizer),
                      invariant)
        except BaseException:  # what opened is closed: device memory is not left to the garbage collector
            for runner in (draft, target):
                if runner is not None:
                    runner.close()
            _close_shared(shared)
            raise
        dec._shared = shared
        dec.threads = threads
        dec.precision = precision or ("fp32" if backend != "trt" else manifest.engine_set("trt").precision)
        return dec

    # ---------------------------------------------------------------- drafters
    DRAFTER_ALIASES = {"lookup": "prompt-lookup", "off": "none"}

    def make_drafter(self, kind: str | None = None) -> Drafter:
        """kind: auto (default) | hybrid | model | prompt-lookup (lookup) | none (off)."""
        kind = self.DRAFTER_ALIASES.get(kind or "auto", kind or "auto")
        p = self.manifest.drafter_params
        if kind == "model":
            if self.draft_runner is None:
                raise SamplingParamsError("this bundle has no draft model; use drafter 'prompt-lookup' or 'none'")
            head = self.manifest.draft.head if self.manifest.draft is not None else None
            return ModelDrafter(self.draft_runner, self.manifest.target.dims.vocab, self.manifest.prefill_chunk,
                                None if head is None else head.ids())
        if kind == "prompt-lookup":
            return PromptLookupDrafter(p.get("ngram_max", DEFAULT_NGRAM_MAX), p.get("ngram_min", DEFAULT_NGRAM_MIN))
        if kind == "none":
            return NoDrafter()
        if kind in SPEC_MODES:
            model = self.make_drafter("model") if self.draft_runner is not None else None
            return AutoDrafter(self.cost_model(), self.make_drafter("prompt-lookup"), model, mode=kind)
        raise SamplingParamsError(f"unknown drafter {kind!r}; choose auto, hybrid, model, prompt-lookup (lookup) "
                                  f"or none (off)")

    def cost_model(self, say=None) -> CostModel:  # noqa: ANN001
        """The measured step costs adaptive speculation decides with (measured once, then refreshed by every
        round's own timings). Timing every width takes ~1.5 s for the Qwen pair on 2 cores, which a command-line run
        paid on each call: on ONNX Runtime CPU the measurement is kept for a day in SPECEDGE_COST_CACHE (default
        SPECEDGE_CACHE/costs; "off" keeps nothing) under a key of the bundle's manifest, the backend, precision,
        threads, the kernel build and the CPU. ``say(message)`` is told when it measures."""
        if self._costs is None:
            path = self._cost_cache_file()
            steps = _read_step_costs(path)
            if steps is None:
                if say is not None:
                    say("timing the model steps auto decides with (once"
                        + (f"; kept a day in {path.parent})" if path is not None else ")") + " …")
                steps = self.time_steps(repeats=3, all_logits_only=True, roles=("target",))
                # the draft at every width, its prefill chunk too: what catching up on a prompt costs
                steps.update(self.time_steps(repeats=3, roles=("draft",)))
                _write_step_costs(path, steps)
            target = {T: s for T, s in steps["target"].items() if T >= self.target.min_width}
            draft = steps.get("draft", {})
            self._costs = CostModel(target, draft.get(1), draft_widths=draft)
        return self._costs

    def _cost_cache_file(self) -> Path | None:
        """Where this decoder's step costs are kept between processes (None: not kept: GPU backends, whose steps
        are quick to time, or SPECEDGE_COST_CACHE=off)."""
        where = os.environ.get("SPECEDGE_COST_CACHE", "")
        if where.lower() in ("off", "0", "none") or self.backend != "ort-cpu":
            return None
        from . import kernels
        from .cpu import cpu_features

        try:
            import onnxruntime

            ort_version = onnxruntime.__version__
        except ImportError:  # pragma: no cover - the backend is ort-cpu
            ort_version = "?"
        try:
            cpus = len(os.sched_getaffinity(0))
        except AttributeError:  # not Linux
            cpus = os.cpu_count() or 0
        try:
            h = hashlib.sha256((self.bundle_dir / MANIFEST_NAME).read_bytes())
        except OSError:  # the bundle moved since it was loaded: time the steps, keep nothing
            return None
        for part in (self.backend, self.precision, str(self.threads), str(self.target.min_width), ort_version,
                     str(kernels._built), " ".join(sorted(cpu_features() or ())), platform.processor(), str(cpus)):
            h.update(b"\0" + part.encode())
        base = Path(where).expanduser() if where else kernels.cache_root() / "costs"
        return base / f"{h.hexdigest()[:20]}.json"

    # ------------------------------------------------------------------ public
    def encode_prompt(self, prompt: Prompt, chat: bool | None = None) -> list[int]:
        if self.target is None:
            raise OptionError("this decoder is closed; load the bundle again")
        if isinstance(prompt, str):
            if not prompt:
                raise PromptError("the prompt is empty")
            check_text(prompt, "the prompt")
            if chat:
                return self.codec.encode_chat([{"role": "user", "content": prompt}])
            return self.codec.encode(prompt)
        if not isinstance(prompt, (list, tuple)):
            raise PromptError(f"a prompt is a string or a list of chat messages, got {type(prompt).__name__}")
        return self.codec.encode_chat(prompt)

    def generate(self, prompt: Prompt, params: SamplingParams = SamplingParams(), **kw: Any) -> GenerationResult:
        text, ids, last = [], [], None
        for ev in self.stream(prompt, params, **kw):
            text.append(ev.text)
            ids += ev.token_ids
            last = ev
        assert last is not None and last.stats is not None
        return GenerationResult("".join(text), ids, last.finish_reason or "", last.stats)

    def stream(self, prompt: Prompt, params: SamplingParams = SamplingParams(), *, drafter: str | None = None,
               k: int | None = None, chat: bool | None = None, reuse_prefix: bool = True) -> Iterator[StreamEvent]:
        """Yield text as tokens are accepted. drafter: auto (default: picks plain, prompt lookup or the draft
        model with its k every round) | hybrid | model | prompt-lookup | none; k: (maximum) draft length,
        1..K of the bundle (default K). reuse_prefix: start the prefill after the leading tokens whose rows the
        previous request left in the cache (a chat turn pays only for its new tokens; ``Stats.reused_tokens``), and
        let a model drafter keep the draft's rows that agree with the prompt; False: a new request's cost, nothing
        cached is reused (benchmarks: a configuration run after another on the same prompt would otherwise find the
        draft caught up on it). The output is the same either way."""
        K = self.manifest.k
        asked = K if k is None else k
        try:  # an int (numpy's too); not a bool, 2.5 or "3"
            k = -1 if isinstance(asked, bool) else operator.index(asked)
        except TypeError:
            k = -1
        if not 0 <= k <= K:
            raise SamplingParamsError(f"k must be an integer in 0..{K} (the bundle's verify width is K+1={K + 1}), "
                                      f"got {asked!r}")
        if drafter is not None and not isinstance(drafter, str):
            raise SamplingParamsError(f"drafter must be a name (auto, hybrid, model, prompt-lookup or none), "
                                      f"got {drafter!r}")
        d = self.make_drafter(drafter)
        if k == 0:
            d = NoDrafter()
        ids = self.encode_prompt(prompt, chat)
        self._check_fits(len(ids), params)
        return self._run(ids, params, d, k, reuse_prefix)

    def _check_fits(self, n_prompt: int, params: SamplingParams) -> None:
        if n_prompt == 0:
            raise PromptError("the prompt encodes to zero tokens")
        S, K = self.manifest.max_context, self.manifest.k
        need = n_prompt + params.max_new_tokens + K + 1
        if need > S:
            raise ContextLengthError(
                f"bundle built for S_max={S}, request needs {need} (prompt {n_prompt} + max_new "
                f"{params.max_new_tokens} + K+1 {K + 1}); shorten the prompt, lower max_new_tokens, "
                f"or re-export with a larger --max-context")

    # ------------------------------------------------------------------- loop
    def _run(self, ids: list[int], params: SamplingParams, drafter: Drafter, k: int,
             reuse_prefix: bool = True) -> Iterator[StreamEvent]:
        if not params.greedy and params.sampler == "keyed" and params.seed is None:
            params = dataclasses.replace(params, seed=int(np.random.SeedSequence().entropy % (1 << 63)))
        drafter.reset()
        stats = Stats(drafter=drafter.name, k=k if drafter.name != "none" else 0, prompt_tokens=len(ids))
        tokens = np.zeros(self.manifest.max_context, dtype=np.int64)
        tokens[: len(ids)] = ids
        req = _Request(tokens, len(ids), len(ids), params, np.random.default_rng(params.seed), stats,
                       IncrementalDetokenizer(self.codec), stop_hold=max((len(s) for s in params.stop), default=1) - 1)
        # The lock is held for one step of work at a time, never across a yield: a paused, abandoned or
        # interleaved stream blocks nobody. Whoever runs next owns the caches; a stream that finds another
        # owner on resuming re-prefills its committed tokens first (see _resync).
        with self._lock:
            t_start = time.perf_counter()
            start = self._cached_prefix(tokens[: req.n]) if reuse_prefix else 0
            if not reuse_prefix and self.draft_runner is not None:  # nor the draft's rows: a model drafter starts cold
                self.draft_runner.draft_owner = self.draft_runner.draft_rows_for = None
            self._owner = req
            logits = feed(self.target, tokens[start: req.n], start, self.manifest.prefill_chunk)
            stats.reused_tokens = start
            if not np.isfinite(logits).all():  # damaged weights decode NaN logits to token 0: often an EOS, silently
                raise BundleError(f"the target's logits after the prompt are not finite (NaN or inf): its weights in "
                                  f"{self.bundle_dir} are damaged, or the backend failed; `spec-export info "
                                  f"{self.bundle_dir}` checks every file against its sha256")
            first = choose_next(logits, params, req.rng, position=req.n)
            ev = self._commit(req, [first])
            stats.ttft_s = time.perf_counter() - t_start
        t_first = time.perf_counter()
        yield ev
        while req.finish is None:
            with self._lock:
                if self.target is None:
                    raise OptionError("this decoder was closed while the stream was paused; load the bundle again")
                if self._owner is not req:
                    self._resync(req, drafter)
                ev = self._round(req, drafter, k)
            stats.decode_s = time.perf_counter() - t_first
            if ev.finished:
                stats.strategies = dict(getattr(drafter, "rounds", {drafter.name: stats.rounds}))
            yield ev

    def _cached_prefix(self, ids: np.ndarray) -> int:
        """How many leading tokens of ``ids`` already have their rows in the target cache (those of the request
        that used it last), keeping at least the last token to feed: where a prefill can start."""
        if self._owner is None:
            return 0
        have = self._owner.tokens[: self._owner.n - 1]  # rows valid for these (the invariant between rounds)
        m = min(len(have), len(ids) - 1)
        diff = np.flatnonzero(have[:m] != ids[:m])
        return int(diff[0]) if len(diff) else m

    def _resync(self, req: _Request, drafter: Drafter) -> None:
        """Another request used the caches since this one's last round: rebuild the target's rows for
        tokens[:n-1] (the invariant between rounds) from where they still agree, and make a model drafter
        catch up from scratch."""
        if req.n > 1:
            start = self._cached_prefix(req.tokens[: req.n])
            if start < req.n - 1:
                feed(self.target, req.tokens[start: req.n - 1], start, self.manifest.prefill_chunk)
        self._owner = req  # a model drafter re-adopts the draft cache itself (ModelDrafter._adopt)
        req.stats.resyncs += 1

    def _round(self, req: _Request, drafter: Drafter, k: int) -> StreamEvent:
        st = req.stats
        remaining = req.params.max_new_tokens - req.generated
        t0 = time.perf_counter()
        prop = drafter.propose(req.tokens[: req.n], min(k, remaining - 1), req.params, req.rng)
        guess = len(prop.tokens) == 0 and self.target.min_width >= 2
        if guess:  # a width-2 step anyway: let its second row check a free guess
            prop = self._free_guess(req)
        t1 = time.perf_counter()
        verify_in = np.concatenate([req.tokens[req.n - 1: req.n], prop.tokens])  # [last committed, d_1..d_n]
        # greedy on a graph with next_ids: only the n+1 argmax ids leave the device (same rows, same argmax)
        ids_only = req.params.greedy and getattr(self.target, "has_argmax", False)
        out = (self.target.step(verify_in, req.n - 1, all_logits=True, ids_only=True) if ids_only  # [n+1]
               else self.target.step(verify_in, req.n - 1, all_logits=True))  # [n+1, V]
        t2 = time.perf_counter()
        if self._costs is not None:
            self._costs.observe_target(len(verify_in), t2 - t1)
        m, nxt = accept_argmax(out, prop.tokens) if ids_only else self._accept(out, prop, req)
        if guess and self._costs is not None:
            self._costs.observe_guess(m)  # what plain rounds really yield, for auto's choice
        drafter.commit(0 if guess else m)
        wants = getattr(drafter, "wants_confidence", None)  # auto's prior (greedy on next_ids graphs: no logits)
        if not ids_only and wants is not None and wants():
            drafter.observe_confidence(top1_probability(out[: m + 1]))  # the rows whose tokens this round commits
        ev = self._commit(req, [*prop.tokens[:m].tolist(), nxt])
        # accepted: the draft tokens the request kept (an eos or a stop string may end it inside the round)
        st.record_round(0 if guess else len(prop.tokens), 0 if guess else min(m, len(ev.token_ids)),
                        guessed=m if guess else None)
        t3 = time.perf_counter()
        st.time_draft_s += t1 - t0
        st.time_verify_s += t2 - t1
        st.time_host_s += t3 - t2
        return ev

    def _free_guess(self, req: _Request) -> Any:
        """One token to fill the second row of a plain round: what followed the last n-gram in the context
        (prompt lookup), else the last token again. Deterministic (q one-hot), so the acceptance rule keeps
        the output exact; an accepted guess is a free token."""
        prop = self._guesser.propose(req.tokens[: req.n], 1, req.params, req.rng)
        return prop if len(prop.tokens) else Proposal(req.tokens[req.n - 1: req.n].copy(), None)

    @staticmethod
    def _accept(logits: np.ndarray, prop: Any, req: _Request) -> tuple[int, int]:
        p = req.params
        if p.greedy:
            return verify_greedy(logits, prop.tokens)
        p_target = process_logits(logits, p.temperature, p.top_k, p.top_p)
        if p.sampler == "keyed":  # logits row i is position req.n + i
            return verify_keyed(p_target, prop.tokens, p.seed, req.n)
        return verify_sampled(p_target, prop.q_draft, prop.tokens, req.rng)

    def _commit(self, req: _Request, new: list[int]) -> StreamEvent:
        """Append accepted tokens, apply eos / max_new / stop strings, and produce the event. With stop strings
        the tokens are detokenized one at a time, so a round that accepted several tokens stops exactly where
        plain decoding would (no token past the one that completes a stop string); without, in one push. A request
        that ends by eos or length ends its text with the detokenizer's held-back tail: the text is the ids'
        decoding whichever rounds committed them."""
        p, eos = req.params, self.manifest.tokenizer.eos_ids
        out: list[int] = []
        for t in new:
            if not p.ignore_eos and t in eos:
                req.finish = "eos"
                break
            out.append(t)
            if req.generated + len(out) >= p.max_new_tokens:
                req.finish = "length"
                break
        stop_at = None  # index in req.text where the first stop string starts
        if p.stop:
            for j, t in enumerate(out):
                req.text += req.detok.push([t])
                # with what push held back: a token that completes a stop string and starts a character ends here
                seen = req.text + req.detok.held if req.detok.held else req.text
                hits = [i for s in p.stop if (i := seen.find(s, max(0, req.emitted_chars - len(s)))) >= 0]
                if hits:
                    stop_at, req.finish, out, req.text = min(hits), "stop", out[: j + 1], seen
                    break
        else:
            req.text += req.detok.push(out)
        if req.finish in ("eos", "length"):  # the held-back tail ends the text, however the rounds grouped tokens
            req.text += req.detok.flush()
        req.tokens[req.n: req.n + len(out)] = out
        req.n += len(out)
        if stop_at is not None:
            req.text = req.text[:stop_at]
            emit_to = stop_at
        elif p.stop and req.finish is None:
            emit_to = max(req.emitted_chars, len(req.text) - req.stop_hold)
        else:
            emit_to = len(req.text)
        emit_to = max(emit_to, req.emitted_chars)
        piece = req.text[req.emitted_chars: emit_to]
        req.emitted_chars = emit_to
        done = req.finish is not None
        if done:
            req.stats.finish_reason = req.finish
        req.stats.new_tokens = req.generated
        return StreamEvent(piece, out, done, req.finish, req.stats if done else None)

    def time_steps(self, repeats: int = 5, past_len: int | None = None, all_logits_only: bool = False,
                   roles: tuple[str, ...] = ("target", "draft"), stat: str = "min") -> dict[str, dict[int, float]]:
        """Seconds of one forward step per model and declared width, the fastest of ``repeats`` after a warm-up
        (the minimum is what the hardware can do; a median still carries the noise of a shared machine):
        {"target": {T: s}, "draft": {T: s}}. ``stat="median"``: the typical step instead, what a run pays on
        average (on a shared VM a memory-bound step's median sits further above its fastest than a compute-bound
        one's: the fastest favours the narrow widths).

        The cost model's inputs (draft/target cost ratio, verify vs 1-token cost). Runs dummy tokens
        at ``past_len`` (default: a quarter of S_max); the rows it writes are never read, because
        every request starts with its own prefill. ``all_logits_only`` skips the prefill widths
        (the expensive ones); ``roles`` limits it to some of the models.
        """
        reduce = {"min": np.min, "median": np.median}.get(stat)
        if reduce is None:
            raise OptionError(f"time_steps: stat must be 'min' or 'median', got {stat!r}")
        S = self.manifest.max_context
        out: dict[str, dict[int, float]] = {}
        with self._lock:
            self._owner = None  # dummy rows below: a paused stream must re-prefill
            if self.draft_runner is not None:
                self.draft_runner.draft_owner = self.draft_runner.draft_rows_for = None
            for role, runner in (("target", self.target), ("draft", self.draft_runner)):
                if runner is None or role not in roles:
                    continue
                # widths in turn, each pass over all of them: a shared machine that changes phase during the
                # timing then moves every width alike (timed one width after another, the widths timed late took a
                # slow phase into auto's cost model as their shape: a 2-token step at 1.4x a 1-token one on the
                # Haswell build, where it runs 1.04-1.08x)
                widths = [w for w in runner.entry.widths if not (all_logits_only and w.L != w.T)]
                args = [(np.zeros(w.T, dtype=np.int64), min(S // 4 if past_len is None else past_len, S - w.T),
                         w.L == w.T) for w in widths]
                for ids, pos, all_logits in args:
                    runner.step(ids, pos, all_logits=all_logits)  # warm each width
                times: dict[int, list[float]] = {w.T: [] for w in widths}
                for _ in range(repeats):
                    for w, (ids, pos, all_logits) in zip(widths, args):
                        t0 = time.perf_counter()
                        runner.step(ids, pos, all_logits=all_logits)
                        times[w.T].append(time.perf_counter() - t0)
                out[role] = {T: float(reduce(ts)) for T, ts in times.items()}
        return out

    def close(self) -> None:
        """Release the sessions and buffers; later calls raise OptionError. Closing twice is harmless."""
        if self.target is None:
            return
        self.target.close()
        if self.draft_runner is not None:
            self.draft_runner.close()
        self.target = self.draft_runner = None  # type: ignore[assignment]
        _close_shared(self._shared)
