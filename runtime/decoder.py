"""The decode loop: prefill, then rounds of draft -> verify -> accept -> commit.

``SpecDecoder.stream`` is one generator yielding :class:`StreamEvent`s; ``generate``
collects them. A round is four short functions over one small :class:`Request`.

Invariant between rounds: the target cache holds rows for ``tokens[:n-1]`` — every
committed token except the last, which is fed first in the next verify call.

A decoder loaded with ``max_batch`` N > 1 (a row-addressed bundle) decodes up to N requests together:
:mod:`.batch` packs their rows into shared steps, each request's rows in its own slot of the cache.
"""

from __future__ import annotations

import dataclasses
import threading
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from .adaptive import AutoDrafter
from .backends import GraphRunner, SlotView, close_shared, open_runners, resolve_backend, tree_rows
from .batch import Batch, Slot
from .bundle_files import FileWatch
from .cache_rows import CacheRows
from .drafters import DraftCache, Drafter, ModelDrafter, NoDrafter, PromptLookupDrafter, Proposal, StepClock, feed
from .errors import BundleError, OptionError
from .factory import check_load_options, draft_length, make_drafter, plain_width, warn_about_form, width1_exact
from .manifest import DEFAULT_NGRAM_MAX, Manifest, read_manifest
from .policy import CostModel
from .request import GenerationResult, Request, StreamEvent, check_fits, commit
from .sampling import SamplingParams, accept_argmax, choose_next, top1_probability, verify_round
from .stats import Stats
from .step_costs import (
    StepCosts,
    cost_cache_file,
    cost_depth,
    read_step_costs,
    time_runner,
    time_slopes,
    write_step_costs,
)
from .text import IncrementalDetokenizer, TextCodec
from .trees import TREE_BRANCHES_MAX, TREE_MAX, path_moves, shape, spine_length, tree_refusal, walk

Prompt = str | Sequence[dict[str, Any]]


class SpecDecoder:
    """Speculative decoder over a bundle. Its graph runners (ONNX Runtime sessions, TensorRT contexts) open once and
    serve many requests.

    Thread safety: one prefill or round runs at a time per decoder (a lock held for one step of work, never
    across a yield), so streams from several threads, or several streams interleaved in one thread, are all
    served; a paused or abandoned stream blocks nobody. With ``max_batch`` 1 a stream resumed after another
    request ran re-prefills its committed tokens (``Stats.resyncs``); with ``max_batch`` N > 1 up to N streams
    decode together, each round advancing all of them in shared steps (:mod:`.batch`), each request's text
    bitwise what it is alone.
    """

    def __init__(self, bundle_dir: Path, manifest: Manifest, backend: str, target: GraphRunner,
                 draft: GraphRunner | None, codec: TextCodec, invariant: bool = True, files: FileWatch | None = None):
        self.bundle_dir, self.manifest, self.backend = bundle_dir, manifest, backend
        # the bundle's files as they were read: a request finds any replaced or rewritten since (FileWatch.check)
        self.files = files if files is not None else FileWatch(bundle_dir, manifest.files)
        self.target, self.draft_runner, self.codec = target, draft, codec
        # the draft's rows, owner and step clock: one per slot of a draft model's pool (max_batch > 1), one clock
        n_draft = getattr(draft, "slots", 1) if draft is not None else 0
        clock = StepClock()
        self.draft_caches = [DraftCache(SlotView(draft, i) if n_draft > 1 else draft, clock=clock)
                             for i in range(n_draft)]
        self.draft_cache = self.draft_caches[0] if self.draft_caches else None
        # Batch invariance: the target never runs a width-1 step (GraphRunner.min_width), so every logits row is
        # computed by the same kernels whatever the drafter, k or auto's choice; a round with nothing to verify
        # carries a free one-token guess instead of running alone.
        self.invariant = invariant
        self.width1_exact = width1_exact(manifest)
        assert target.min_width == plain_width(manifest, invariant), "open the target with plain_width's min_width"
        warn_about_form(bundle_dir, manifest, backend, invariant)
        p = manifest.drafter_params
        # the free guess takes any match, down to one token: it rides in a width-2 step that runs anyway
        self._guesser = PromptLookupDrafter(p.get("ngram_max", DEFAULT_NGRAM_MAX), 1)
        self._lock = threading.Lock()  # held for one prefill or round at a time (never across a yield)
        # the target cache's slots (one per sequence it holds: max_batch) and what each one's rows hold
        n_slots = getattr(target, "slots", 1)
        self.slots = [Slot(i, SlotView(target, i) if n_slots > 1 else target, CacheRows()) for i in range(n_slots)]
        self.batch = Batch(self) if n_slots > 1 else None
        self._costs: CostModel | None = None  # measured on the first auto/hybrid request, refreshed every round
        self._shared: dict = {}  # what the runners share (TensorRT: CUDA stream and scratch memory)
        self.precision = "fp32"  # of the graphs/engines run (set by load)
        self.threads: int | None = None  # as given to load (None: its default)

    @classmethod
    def load(cls, bundle: str | Path, backend: str = "auto", verify: str = "size",
             threads: int | None = None, precision: str | None = None, invariant: bool = True,
             cuda_graphs: bool = True, max_batch: int = 1) -> SpecDecoder:
        """verify: "size" (default: every file present with its recorded size and sampled hash — what the CLI does;
        a file zeroed or overwritten in part is caught, a flipped bit mostly not), "sha256" (hash every file first:
        minutes for gigabytes on a Jetson; `spec-export info BUNDLE` does it on demand) or "none".
        backend: auto | ort-cpu | ort-cuda | ort-trt | trt. precision: None (fp32 graphs on ONNX Runtime; the
        built engines on TensorRT) or fp16/bf16 (the bundle's reduced-precision graphs or engines).
        invariant: True (default) runs every target step at width >= 2, so speculative output is bitwise the
        plain output in every weight format; False lets plain rounds run a narrower width-1 step whose rows
        differ from verify rows by kernel rounding (int8/int4: up to ~0.6 in a logit).
        cuda_graphs: TensorRT only - True (default) captures each width's engine run into a CUDA graph at its first
        step and replays it after (less launch overhead per step); False always runs execute_async_v3.
        max_batch: requests decoded together (1: one at a time). N > 1 allocates the target's KV cache for N
        sequences and packs their rounds into shared steps: a row-addressed bundle (kv_mode rows: the specedge
        form's) on ort-cpu; other bundles and backends refuse it, saying what is missing."""
        check_load_options(bundle, verify, threads, precision, max_batch)
        bundle_dir = Path(bundle)
        manifest = read_manifest(bundle_dir, verify=verify)
        files = FileWatch(bundle_dir, manifest.files)  # before anything is read: a change during loading is found
        backend = resolve_backend(backend, manifest)
        target, draft, shared = open_runners(backend, bundle_dir, manifest, threads, precision, cuda_graphs,
                                             target_min_width=plain_width(manifest, invariant),
                                             target_slots=max_batch)
        try:
            dec = cls(bundle_dir, manifest, backend, target, draft, TextCodec(bundle_dir, manifest.tokenizer),
                      invariant, files)
        except BaseException:  # what opened is closed: device memory is not left to the garbage collector
            for runner in (draft, target):
                if runner is not None:
                    runner.close()
            close_shared(shared)
            raise
        dec._shared = shared
        dec.threads = threads
        dec.precision = precision or ("fp32" if backend != "trt" else manifest.engine_set("trt").precision)
        return dec

    # ---------------------------------------------------------------- drafters
    def make_drafter(self, kind: str | None = None) -> Drafter:
        """kind: auto (default) | hybrid | model | prompt-lookup (lookup) | none (off)."""
        return make_drafter(kind, self.manifest, self.draft_cache, self.cost_model)

    def cost_model(self, say=None) -> CostModel:  # noqa: ANN001
        """The measured step costs adaptive speculation decides with: timed once (or read from the kept costs:
        :mod:`.step_costs`), then refreshed by every round's own timings. ``say(message)`` is told when it times."""
        if self._costs is None:
            path = self.cost_cache_file()
            kept = read_step_costs(path)
            if kept is None:
                if say is not None:
                    say("timing the model steps auto decides with (once"
                        + (f"; kept a day in {path.parent})" if path is not None else ")") + " …")
                steps = self.time_steps(repeats=3, all_logits_only=True, roles=("target",))
                # the draft at every width, its prefill chunk too: what catching up on a prompt costs
                steps.update(self.time_steps(repeats=3, roles=("draft",)))
                kept = StepCosts(steps, cost_depth(self.manifest.max_context), self.time_slopes(repeats=3))
                write_step_costs(path, kept)
            target = {T: s for T, s in kept.steps["target"].items() if T >= self.target.min_width}
            draft = kept.steps.get("draft", {})
            self._costs = CostModel(target, draft.get(1), draft_widths=draft, base_depth=kept.depth,
                                    target_slope=kept.slopes.get("target", {}),
                                    draft_slope=kept.slopes.get("draft", {}).get(1, 0.0))
        return self._costs

    def cost_cache_file(self) -> Path | None:
        """Where this decoder's step costs are kept between processes (None: not kept)."""
        return cost_cache_file(self.bundle_dir, self.backend, self.precision, self.threads, self.target.min_width)

    # ------------------------------------------------------------------ public
    def encode_prompt(self, prompt: Prompt, chat: bool | None = None) -> list[int]:
        if self.target is None:
            raise OptionError("this decoder is closed; load the bundle again")
        return self.codec.encode_prompt(prompt, chat)

    def generate(self, prompt: Prompt, params: SamplingParams = SamplingParams(), **kw: Any) -> GenerationResult:
        text, ids, last = [], [], None
        for ev in self.stream(prompt, params, **kw):
            text.append(ev.text)
            ids += ev.token_ids
            last = ev
        assert last is not None and last.stats is not None
        return GenerationResult("".join(text), ids, last.finish_reason or "", last.stats)

    def stream(self, prompt: Prompt, params: SamplingParams = SamplingParams(), *, drafter: str | None = None,
               k: int | None = None, chat: bool | None = None, reuse_prefix: bool = True,
               tree: int | None = None) -> Iterator[StreamEvent]:
        """Yield text as tokens are accepted. drafter: auto (default: picks plain, prompt lookup or the draft
        model with its k every round) | hybrid | model | prompt-lookup | none; k: (maximum) draft length,
        1..K of the bundle (default K). reuse_prefix: start the prefill after the leading tokens whose rows the
        previous request left in the cache (a chat turn pays only for its new tokens; ``Stats.reused_tokens``), and
        let a model drafter keep the draft's rows that agree with the prompt; False: a new request's cost, nothing
        cached is reused (benchmarks: a configuration run after another on the same prompt would otherwise find the
        draft caught up on it). The output is the same either way.
        tree: branch rows a draft-model round may add to its chain, verified in the same step (:mod:`.trees`): None
        (default) lets auto and hybrid add up to TREE_MAX where they predict it pays, on a bundle that verifies trees
        (kv_mode rows on ort-cpu) with greedy or keyed sampling, and keeps the other drafters' chains; 0 never;
        B = 1..TREE_BRANCHES_MAX: auto adds up to B where it pays, the model drafter always its B likeliest
        runner-ups. The output is the same with or without trees."""
        k = draft_length(k, self.manifest.k)
        d = self.make_drafter(drafter)
        if k == 0:
            d = NoDrafter()
        self._set_tree(d, tree, params)
        ids = self.encode_prompt(prompt, chat)
        self.files.check()
        check_fits(self.manifest, len(ids), params)
        req = self._request(ids, params, d, k)
        if self.batch is not None:
            if d.name in ("auto", "hybrid", "prompt-lookup"):
                self.cost_model()  # what a batched round weighs its rows with (timed once, outside the lock)
            return self.batch.run(req, d, k, reuse_prefix)
        return self._run(req, d, k, reuse_prefix)

    def _set_tree(self, d: Drafter, tree: object, params: SamplingParams) -> None:
        """Check a request's ``tree`` and give the drafter its branch limit (see :meth:`stream`)."""
        if tree is not None and (isinstance(tree, bool) or not isinstance(tree, (int, np.integer))
                                 or not 0 <= tree <= TREE_BRANCHES_MAX):
            raise OptionError(f"tree must be a number of branch rows in 0..{TREE_BRANCHES_MAX} (or None: auto "
                              f"decides), got {tree!r}")
        # trees need tree rows (a row-addressed bundle on the CPU) and run in single-stream rounds
        where = (None if self.batch is None and tree_rows(self.target) else
                 "decoders loaded with max_batch 1 (batched rounds verify chains)" if self.batch is not None else
                 "row-addressed bundles (kv_mode rows: the specedge CPU form) on ort-cpu; this one is "
                 f"kv_mode {self.manifest.kv_mode} on {self.backend}")
        refusal = tree_refusal(params)
        if tree:
            if not isinstance(d, (AutoDrafter, ModelDrafter, PromptLookupDrafter)) or getattr(d, "model", d) is None:
                why = "has no draft model here" if isinstance(d, AutoDrafter) else "drafts nothing"
                raise OptionError(f"tree={tree}: trees branch a draft model's chain or prompt lookup's; drafter "
                                  f"{d.name!r} {why} (drafter 'model' or 'prompt-lookup', or 'auto' or 'hybrid' "
                                  "on a bundle with a draft model; or tree=0)")
            if where is not None:
                raise OptionError(f"tree={tree}: tree verification runs on {where}")
            if refusal is not None:
                raise OptionError(f"tree={tree}: {refusal}")
        limit = int(tree) if tree is not None else TREE_MAX if isinstance(d, AutoDrafter) else 0
        if where is not None or refusal is not None:
            limit = 0
        if isinstance(d, (AutoDrafter, ModelDrafter, PromptLookupDrafter)):
            d.tree = limit
        if isinstance(d, (ModelDrafter, PromptLookupDrafter)):
            d.tree_nodes = max(w.T for w in self.manifest.target.widths if w.L == w.T) - 1

    # ------------------------------------------------------------------- loop
    def _request(self, ids: list[int], params: SamplingParams, drafter: Drafter, k: int) -> Request:
        """A new request's state: its prompt, sampling state (a keyed sampler without a seed draws one) and stats."""
        if not params.greedy and params.sampler == "keyed" and params.seed is None:
            params = dataclasses.replace(params, seed=int(np.random.SeedSequence().entropy % (1 << 63)))
        drafter.reset()
        stats = Stats(drafter=drafter.name, k=k if drafter.name != "none" else 0, prompt_tokens=len(ids))
        tokens = np.zeros(self.manifest.max_context, dtype=np.int64)
        tokens[: len(ids)] = ids
        return Request(tokens, len(ids), len(ids), params, np.random.default_rng(params.seed), stats,
                       IncrementalDetokenizer(self.codec), stop_hold=max((len(s) for s in params.stop), default=1) - 1)

    def _run(self, req: Request, drafter: Drafter, k: int, reuse_prefix: bool = True) -> Iterator[StreamEvent]:
        stats = req.stats
        slot = self.slots[req.slot]
        tokens = req.tokens
        # The lock is held for one step of work at a time, never across a yield: a paused, abandoned or
        # interleaved stream blocks nobody. Whoever runs next writes the caches; a stream that finds other rows
        # there on resuming re-prefills its committed tokens first (see _resync). slot.rows is narrowed before a
        # write and widened after it: an exception anywhere leaves it claiming only rows written for its tokens.
        with self._lock:
            t_start = time.perf_counter()
            start = slot.rows.agree(tokens[: req.n]) if reuse_prefix else 0
            if not reuse_prefix and self.draft_cache is not None:  # nor the draft's rows: the drafter starts cold
                self.draft_cache.forget()
            slot.rows.writing(tokens, start)
            logits = feed(slot.runner, tokens[start: req.n], start, self.manifest.prefill_chunk,
                          lone_last=self.width1_exact)
            slot.rows.wrote(tokens, req.n)
            stats.reused_tokens = start
            ev = self._first_token(req, logits)
            stats.ttft_s = time.perf_counter() - t_start
        t_first = time.perf_counter()
        yield ev
        while req.finish is None:
            with self._lock:
                if self.target is None:
                    raise OptionError("this decoder was closed while the stream was paused; load the bundle again")
                if not slot.rows.holds(req.tokens, req.n - 1):
                    self._resync(req, drafter)
                ev = self._round(req, drafter, k)
            stats.decode_s = time.perf_counter() - t_first
            if ev.finished:
                stats.strategies = drafter.strategy_rounds() or {drafter.name: stats.rounds}
            yield ev

    def _first_token(self, req: Request, logits: np.ndarray) -> StreamEvent:
        """The token the prompt's last logits give, committed: the request's first event."""
        # damaged weights decode NaN logits, or all-equal ones (zeroed weights), to token 0: often an EOS, silently
        bad = ("not finite (NaN or inf)" if not np.isfinite(logits).all()
               else "all equal" if logits.min() == logits.max() else None)
        if bad:
            raise BundleError(f"the target's logits after the prompt are {bad}: its weights in "
                              f"{self.bundle_dir} are damaged, or the backend failed; `spec-export info "
                              f"{self.bundle_dir}` checks every file against its sha256")
        first = choose_next(logits, req.params, req.rng, position=req.n)
        return commit(req, self.manifest.tokenizer.eos_ids, [first])

    def _resync(self, req: Request, drafter: Drafter) -> None:
        """Another request used the caches since this one's last round: rebuild the target's rows for
        tokens[:n-1] (the invariant between rounds) from where they still agree, and make a model drafter
        catch up from scratch."""
        slot = self.slots[req.slot]
        start = slot.rows.agree(req.tokens[: req.n])
        slot.rows.writing(req.tokens, start)
        if start < req.n - 1:
            feed(slot.runner, req.tokens[start: req.n - 1], start, self.manifest.prefill_chunk,
                 lone_last=self.width1_exact)
        slot.rows.wrote(req.tokens, req.n - 1)  # a model drafter re-adopts the draft cache itself (ModelDrafter._adopt)
        req.stats.resyncs += 1

    def _round(self, req: Request, drafter: Drafter, k: int) -> StreamEvent:
        st = req.stats
        slot = self.slots[req.slot]
        remaining = req.params.max_new_tokens - req.generated
        t0 = time.perf_counter()
        # rows from n-1 on are the round's to write: a self draft writes them first (the verify step rewrites them)
        slot.rows.writing(req.tokens, req.n - 1)
        if self._costs is not None:
            self._costs.depth = req.n  # the round's steps attend over the request's context
        prop = drafter.propose(req.tokens[: req.n], min(k, remaining - 1), req.params, req.rng)
        guess = len(prop.tokens) == 0 and self.target.min_width >= 2
        if guess:  # a width-2 step anyway: let its second row check a free guess
            prop = self._free_guess(req)
        t1 = time.perf_counter()
        if prop.parents is not None:
            return self._tree_round(req, drafter, prop, t0, t1)
        verify_in = np.concatenate([req.tokens[req.n - 1: req.n], prop.tokens])  # [last committed, d_1..d_n]
        # greedy on a graph with next_ids: only the n+1 argmax ids leave the device (same rows, same argmax)
        ids_only = req.params.greedy and self.target.has_argmax
        slot.rows.writing(req.tokens, req.n - 1)
        out = (slot.runner.step(verify_in, req.n - 1, all_logits=True, ids_only=True) if ids_only  # [n+1]
               else slot.runner.step(verify_in, req.n - 1, all_logits=True))  # [n+1, V]
        t2 = time.perf_counter()
        if self._costs is not None:
            self._costs.observe_target(len(verify_in), t2 - t1)
        m, nxt = (accept_argmax(out, prop.tokens) if ids_only
                  else verify_round(out, prop.tokens, prop.q_draft, req.params, req.rng, req.n))
        if guess and self._costs is not None:
            self._costs.observe_guess(m)  # what plain rounds really yield, for auto's choice
        drafter.commit(0 if guess else m)
        if not guess:
            drafter.observe_next(m, nxt)
        if not ids_only and drafter.wants_confidence():  # auto's prior (greedy on next_ids graphs: no logits)
            drafter.observe_confidence(top1_probability(out[: m + 1]))  # the rows whose tokens this round commits
        ev = commit(req, self.manifest.tokenizer.eos_ids, [*prop.tokens[:m].tolist(), nxt])
        slot.rows.wrote(req.tokens, req.n - 1)  # the verify step wrote from n-1 on: rows before it never changed
        # accepted: the draft tokens the request kept (an eos or a stop string may end it inside the round)
        st.record_round(0 if guess else len(prop.tokens), 0 if guess else min(m, len(ev.token_ids)),
                        guessed=m if guess else None)
        t3 = time.perf_counter()
        st.time_draft_s += t1 - t0
        st.time_verify_s += t2 - t1
        st.time_host_s += t3 - t2
        drafter.observe_round(t3 - t0, len(ev.token_ids))
        return ev

    def _tree_round(self, req: Request, drafter: Drafter, prop: Proposal, t0: float, t1: float) -> StreamEvent:
        """A round whose proposal is a tree (:mod:`.trees`): the last committed token and every node in one step of
        tree rows, node i at cache row n + i; the walk down the target's own tokens; the accepted path's rows moved
        to the positions its tokens hold."""
        st, slot, n = req.stats, self.slots[req.slot], req.n
        assert prop.parents is not None
        rows_in = np.concatenate([req.tokens[n - 1: n], prop.tokens])
        positions = np.arange(n - 1, n + len(prop.tokens), dtype=np.int64)
        parents = np.concatenate([[-1], prop.parents + 1])  # step rows: node i is row i + 1, the root row 0
        ids_only = req.params.greedy and self.target.has_argmax
        slot.rows.writing(req.tokens, n - 1)
        out = slot.runner.step_tree(rows_in, positions, parents, ids_only=ids_only)  # type: ignore[attr-defined]
        t2 = time.perf_counter()
        if self._costs is not None:
            self._costs.observe_target(len(rows_in), t2 - t1)
        path, nxt = walk(out, prop.tokens, prop.parents, req.params, n, ids_only)
        src, dst = path_moves(path, n)
        slot.runner.move_rows(src, dst)  # type: ignore[attr-defined]
        along = next((j for j, node in enumerate(path) if node != j), len(path))  # the path's spine prefix
        drafter.commit(along)  # the draft's rows hold the spine: the rest of the path it catches up on
        drafter.observe_next(along, int(prop.tokens[path[along]]) if along < len(path) else nxt)
        rows = [0, *(node + 1 for node in path)]  # the rows whose tokens this round commits
        if not ids_only and drafter.wants_confidence():
            drafter.observe_confidence(top1_probability(out[rows]))
        ev = commit(req, self.manifest.tokenizer.eos_ids, [*prop.tokens[path].tolist(), nxt])
        slot.rows.wrote(req.tokens, req.n - 1)  # the path's rows in place: the committed tokens' but the last
        st.record_round(spine_length(prop.parents), min(len(path), len(ev.token_ids)), tree=shape(prop.parents),
                        branched=along < len(path))
        t3 = time.perf_counter()
        st.time_draft_s += t1 - t0
        st.time_verify_s += t2 - t1
        st.time_host_s += t3 - t2
        drafter.observe_round(t3 - t0, len(ev.token_ids))
        return ev

    def _free_guess(self, req: Request) -> Any:
        """One token to fill the second row of a plain round: what followed the last n-gram in the context
        (prompt lookup), else the last token again. Deterministic (q one-hot), so the acceptance rule keeps
        the output exact; an accepted guess is a free token."""
        prop = self._guesser.propose(req.tokens[: req.n], 1, req.params, req.rng)
        return prop if len(prop.tokens) else Proposal(req.tokens[req.n - 1: req.n].copy(), None)

    def time_steps(self, repeats: int = 5, past_len: int | None = None, all_logits_only: bool = False,
                   roles: tuple[str, ...] = ("target", "draft"), stat: str = "min") -> dict[str, dict[int, float]]:
        """Seconds of one step per model and declared width, {"target": {T: s}, "draft": {T: s}}: the fastest of
        ``repeats`` (what the hardware can do), or with ``stat="median"`` the typical step a run pays. The cost
        model's inputs (:func:`.step_costs.time_runner`); the dummy rows they write are never read, since a paused
        stream re-prefills. ``all_logits_only`` skips the prefill widths; ``roles`` limits it to some models."""
        reduce = {"min": np.min, "median": np.median}.get(stat)
        if reduce is None:
            raise OptionError(f"time_steps: stat must be 'min' or 'median', got {stat!r}")
        out: dict[str, dict[int, float]] = {}
        with self._lock:
            self.slots[0].rows.forget()  # dummy rows below (in slot 0): a paused stream there must re-prefill
            if self.draft_cache is not None:
                self.draft_cache.forget()
            for role, runner in (("target", self.target), ("draft", self.draft_runner)):
                if runner is not None and role in roles:
                    out[role] = time_runner(runner, self.manifest.max_context, repeats, past_len, all_logits_only,
                                            reduce)
        return out

    def time_slopes(self, repeats: int = 3) -> dict[str, dict[int, float]]:
        """Seconds each position of context adds to a step: the target's plain and widest verify widths (K + 1 rows
        at most) and the draft's one-token step, {"target": {T: s}, "draft": {1: s}} (:func:`.step_costs.
        time_slopes`; empty where S_max is too short to tell). The fastest of ``repeats``, like the cost model's
        steps; the same dummy rows as ``time_steps``."""
        out: dict[str, dict[int, float]] = {}
        widths = sorted(w.T for w in self.target.entry.widths
                        if w.L == w.T and self.target.min_width <= w.T <= self.manifest.k + 1)
        with self._lock:
            self.slots[0].rows.forget()
            if self.draft_cache is not None:
                self.draft_cache.forget()
            for role, runner, ws in (("target", self.target, [widths[0], widths[-1]] if widths else []),
                                     ("draft", self.draft_runner, [1])):
                if runner is not None and ws:
                    slopes = time_slopes(runner, self.manifest.max_context, sorted(set(ws)), repeats, np.min)
                    if slopes:
                        out[role] = slopes
        return out

    def close(self) -> None:
        """Release the sessions and buffers; later calls raise OptionError. Closing twice is harmless."""
        with self._lock:  # a step in progress on another thread finishes first
            if self.target is None:
                return
            self.target.close()
            if self.draft_runner is not None:
                self.draft_runner.close()
            self.target = self.draft_runner = None  # type: ignore[assignment]
            close_shared(self._shared)
