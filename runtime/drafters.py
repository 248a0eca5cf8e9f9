"""Drafters: who proposes the K tokens the target verifies.

All share one interface. ``propose`` reads the committed tokens and returns a
:class:`Proposal`; ``commit`` tells the drafter how many of its tokens the target
accepted so it can roll its own state back. A drafter never decides what is
emitted — the acceptance rule in :mod:`sampling` does — so any drafter keeps the
output exact; a bad one is only slower.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np

from .backends import GraphRunner
from .cache_rows import common_prefix
from .manifest import DEFAULT_NGRAM_MAX
from .sampling import SamplingParams, keyed_exponentials, keyed_sample, process_logits, sample
from .trees import TREE_DEPTH, Branch, best_branches, grow, reach_of, sibling_odds, trie


@dataclass
class Proposal:
    tokens: np.ndarray  # [n] int64 draft tokens d_1..d_n (n may be 0)
    q_draft: np.ndarray | None  # [n, V] processed draft distributions; None = deterministic (one-hot)
    # a tree (:mod:`.trees`): node i follows node parents[i] (-1: the last committed token); None: a chain
    parents: np.ndarray | None = None


EMPTY = Proposal(np.zeros(0, dtype=np.int64), None)


class Drafter(Protocol):
    name: str

    def propose(self, tokens: np.ndarray, k: int, params: SamplingParams, rng: np.random.Generator) -> Proposal:
        """tokens: committed tokens [n_committed]; propose up to k continuations."""

    def commit(self, n_accepted: int) -> None:
        """The target accepted the first n_accepted proposed tokens (and appended one of its own)."""

    def reset(self) -> None:
        """Forget all state (new request)."""

    def wants_confidence(self) -> bool:
        """Whether the decoder should pass this round's committed rows' top-1 probabilities (observe_confidence)."""

    def observe_confidence(self, top1: list[float]) -> None:
        """The target's top-1 probability at each row the round commits (auto's prior for the draft)."""

    def strategy_rounds(self) -> dict[str, int] | None:
        """Rounds per strategy a request ran (auto and hybrid choose per round); None: every round was this one's."""

    def observe_next(self, depth: int, token: int) -> None:
        """The round accepted ``depth`` of the proposal's chain (a tree's spine) and the target's token after them is
        ``token`` (for a tree, the branch the path took there, or the round's next token)."""

    def observe_round(self, seconds: float, tokens: int) -> None:
        """The round that ``commit`` ended took ``seconds`` of wall time (drafting, the verify step, the host's work)
        and committed ``tokens`` tokens."""


class DrafterHooks:
    """What a drafter that needs none of the optional hooks of :class:`Drafter` does with them."""

    def wants_confidence(self) -> bool:
        return False

    def observe_confidence(self, top1: list[float]) -> None:
        pass

    def strategy_rounds(self) -> dict[str, int] | None:
        return None

    def observe_next(self, depth: int, token: int) -> None:
        pass

    def observe_round(self, seconds: float, tokens: int) -> None:
        pass


class _Stateless(DrafterHooks):
    """Drafters that keep no state between rounds: commit and reset do nothing."""

    def commit(self, n_accepted: int) -> None:
        pass

    def reset(self) -> None:
        pass


class NoDrafter(_Stateless):
    """Plain decoding through the same loop: proposes nothing, so the target runs its 1-token width."""

    name = "none"

    def propose(self, tokens, k, params, rng) -> Proposal:  # noqa: ANN001
        return EMPTY




class PromptLookupDrafter(_Stateless):
    """n-gram match over prompt + output: find the earlier occurrence of the context's last tokens that agrees with
    the most of them (at least ``ngram_min``, compared up to ``ngram_max``; the most recent among equals) and
    propose what followed it. No weights.

    The default ``ngram_max`` (DEFAULT_NGRAM_MAX, 32) lets the context choose between occurrences of a short
    phrase: an edit that copies one of two similar functions continues the one whose preceding lines it has
    copied, where the most recent 3-token match was often the other (replayed over the Qwen pair's greedy traces,
    tools/dev/lookup_replay.py: auto's lookup rounds 1.05-1.07x on three of the six edit and summary prompts, the
    others within 1 %)."""

    name = "prompt-lookup"

    def __init__(self, ngram_max: int = DEFAULT_NGRAM_MAX, ngram_min: int = 1):
        if not 1 <= ngram_min <= ngram_max:
            raise ValueError(f"need 1 <= ngram_min <= ngram_max, got {ngram_min}, {ngram_max}")
        self.ngram_max, self.ngram_min = ngram_max, ngram_min
        # tree rows for what followed the other matches (the most context first, then the most recent), merged
        # with the chain where they agree (:func:`.trees.trie`); 0: the chain alone
        self.tree = 0
        self.tree_nodes = 0  # a tree's nodes at most (the target's widest verify step, less the root's row)

    def propose(self, tokens, k, params, rng) -> Proposal:  # noqa: ANN001
        if k <= 0:
            return EMPTY
        t = np.asarray(tokens)
        n_tok, n = len(t), self.ngram_min
        if n_tok - 1 < n:
            return EMPTY
        # every earlier occurrence of the last n tokens with at least one token after it ...
        windows = np.lib.stride_tricks.sliding_window_view(t[: n_tok - 1], n)
        hits = np.flatnonzero((windows == t[n_tok - n:]).all(axis=1))
        # ... extended backwards a token at a time, all at once, while more than one still agrees
        levels = [hits]  # the matches at each length, shortest first (a tree's other continuations)
        for d in range(min(self.ngram_max, n_tok - 1) - n):
            if len(hits) <= 1:
                break
            before = hits - 1 - d
            agree = hits[(before >= 0) & (t[np.maximum(before, 0)] == t[n_tok - n - 1 - d])]
            if not len(agree):
                break
            hits = agree
            levels.append(hits)
        if not len(hits):
            return EMPTY
        start = int(hits[-1]) + n
        spine = np.array(t[start: start + k], dtype=np.int64)
        if not self.tree:
            return Proposal(spine, None)
        others, seen = [], {start}
        for level in reversed(levels):
            for h in level[::-1]:
                s = int(h) + n
                if s not in seen and len(others) < 2 * self.tree:
                    seen.add(s)
                    others.append(t[s: s + k])
        tokens, parents = trie(spine, others, min(self.tree, self.tree_nodes - len(spine)))
        return Proposal(tokens, None, parents if len(tokens) > len(spine) else None)


@dataclass
class DraftCache:
    """A draft model's KV cache as the drafters that take turns on it see it: which drafter's rows it holds
    (``owner``), the committed tokens those rows are for (``rows_for``: a new request's drafter adopts the leading
    rows that agree with its own tokens), and the draft's measured step times (``clock``). One per draft runner,
    made by the decoder; :meth:`forget` after anything else wrote the cache."""

    runner: GraphRunner
    owner: object | None = None
    rows_for: np.ndarray | None = None
    clock: StepClock = field(default_factory=lambda: StepClock())

    def forget(self) -> None:
        """No drafter's rows are in the cache any more (a cold request, or dummy rows written by a timing)."""
        self.owner = self.rows_for = None


class ModelDrafter(DrafterHooks):
    """A separate draft model with its own KV cache.

    Invariant between rounds: the draft cache holds rows for ``tokens[:rows]``, a prefix of
    the committed tokens (``rows <= n_committed - 1``). ``propose`` first catches up (feeds the
    committed tokens it has not seen, in prefill chunks or single steps), then feeds the last
    committed token and its own draws one at a time. After drafting d_1..d_k its cache holds
    rows for the last committed token and d_1..d_{k-1}; if the target accepts m of them, rows
    for d_1..d_min(m, k-1) stay valid. When all k are accepted, d_k is caught up next round.
    """

    name = "model"

    def __init__(self, cache: DraftCache, target_vocab: int, prefill_chunk: int,
                 head_ids: np.ndarray | None = None):
        self.cache = cache
        self.runner = cache.runner
        self.target_vocab = target_vocab
        self.prefill_chunk = prefill_chunk
        # a partial draft head (HeadRows.ids(): logits column j is token head_ids[j]); ids the target lacks dropped
        self.head_ids = None if head_ids is None else np.asarray(head_ids, dtype=np.int64)
        self._keep = None if head_ids is None else self.head_ids < target_vocab
        if self._keep is not None and self._keep.all():
            self._keep = None
        if self._keep is not None:
            self.head_ids = self.head_ids[self._keep]
        self.rows = 0
        self.clock = cache.clock  # shared by every drafter on the cache: the catch-up takes its cheapest steps
        self.last_was_stopper = False  # whether the last proposed token is the draw keep() stopped at
        self.dropped: tuple[int, float] | None = None  # the draw the last proposal's keep() stopped at, if any
        self._base = 0  # committed tokens when the last proposal was made
        self._k = 0
        self.time_catch_up = 0.0  # seconds spent catching up (with the first draw's step where it rode along)
        self.step_time: float | None = None  # seconds of a single draft step in the last proposal (None: none ran)
        self.tree = 0  # branch rows each proposal adds (a tree of the B likeliest runner-ups; :mod:`.trees`)
        self.tree_nodes = 0  # a tree's nodes at most (the target's widest verify step, less the root's row)
        self.branches: list[Branch] = []

    def reset(self) -> None:
        self.rows = 0
        self._k = 0

    def catchup_plan(self, n_tokens: int, tokens: np.ndarray | None = None) -> list[int]:
        """Tokens per step that catching up with ``n_tokens`` committed tokens will take, the last committed token
        (the first draw's step) with them (empty: nothing to catch up; the first draw is then a step of its own).
        Given the tokens, counted from the rows ``propose`` will adopt from the draft cache (the rows another
        request left there that agree with them: a repeated or continued prompt is mostly there already)."""
        rows = self.rows if tokens is None else self._adoptable(tokens)
        behind = n_tokens - 1 - rows
        if behind <= 0:
            return []
        plan = feed_plan(self.runner, behind + 1, rows, self.prefill_chunk, cost=self.clock.cost, last_any=True)
        return [take for take, _ in plan]

    def _logits_for_target(self, logits: np.ndarray) -> np.ndarray:
        """Align the draft's vocabulary [.., V_draft] with the target's V_target (truncate or pad -inf). A partial
        head's logits stay in head order (``_token``, ``_spread`` map them to token ids)."""
        if self.head_ids is not None:
            return logits if self._keep is None else logits[..., self._keep]
        v = logits.shape[-1]
        if v == self.target_vocab:
            return logits
        if v > self.target_vocab:
            return logits[..., : self.target_vocab]
        pad = np.full(logits.shape[:-1] + (self.target_vocab - v,), -np.inf, dtype=logits.dtype)
        return np.concatenate([logits, pad], axis=-1)

    def propose(self, tokens, k, params, rng, keep=None, keep_last=None, branches: int = 0) -> Proposal:  # noqa: ANN001
        """Draft up to k tokens. ``branches``: at each of the first TREE_DEPTH depths also note that many runner-up
        tokens (the most likely after the drawn one; keyed: the next best keyed scores) in ``self.branches``, the
        candidates of a tree (:mod:`.trees`). ``keep(confidence)``, if given, is asked after each draw with the draft's
        top probability at that step, the first included; a False stops drafting and drops that draw (the first
        draw is always kept); ``self.dropped`` is then (the dropped token, its confidence), else None — unless
        ``keep_last(confidence, n)`` says to propose it all the same, as the last of n tokens: its draft step is
        already paid, and verifying it costs only a row of the target's step (``self.last_was_stopper`` then).
        ``self.confidences`` holds the kept tokens' confidences."""
        if self.tree and not branches:  # a tree of the B likeliest branches, the draft's confidences their odds
            prop = self.propose(tokens, k, params, rng, keep, keep_last, branches=self.tree)
            room = min(self.tree, self.tree_nodes - len(prop.tokens))
            take = best_branches(self.branches, reach_of(self.confidences), lambda b: sibling_odds(b, self.confidences),
                                 room) if room > 0 else []
            if not take:
                return prop
            return Proposal(*grow_proposal(prop, [b for _, b in take]))
        n = len(tokens)
        t0 = time.perf_counter()
        self._adopt(tokens)
        first = None  # the first draw's logits, if the catch-up computed them
        if self.rows < n - 1:
            # The catch-up takes the last committed token along: its step's last row gives the first draw's logits,
            # one step fewer (a fully accepted round leaves the draft a token behind: the next round ran it and the
            # first draw as two single steps, 12.8 ms for the Qwen 0.5B draft on 2 cores, where a 2-wide step takes 7.4)
            if k > 0:
                first = feed(self.runner, tokens[self.rows: n], self.rows, self.prefill_chunk, self.clock,
                             last_any=True)
            else:
                feed(self.runner, tokens[self.rows: n - 1], self.rows, self.prefill_chunk, self.clock)
            self.rows = n - 1
        self.cache.rows_for = tokens[: n - 1]  # committed tokens: never rewritten, so a view will do
        self.time_catch_up += time.perf_counter() - t0
        self._base, self._k = n, k
        self.confidences: list[float] = []
        self.dropped = None
        self.last_was_stopper = False  # whether the last proposed token is the draw keep() stopped at
        self.branches: list[Branch] = []
        if k <= 0:
            return EMPTY
        draft = np.zeros(k, dtype=np.int64)
        q = None if params.greedy else np.zeros((k, self.target_vocab))
        last, pos = int(tokens[-1]), n - 1
        noise = None  # keyed: this position's exponentials, shared by the draw and its runner-ups
        t1 = time.perf_counter()
        kept = steps = k
        for i in range(k):
            raw = first if i == 0 and first is not None else self.runner.step([last], pos, all_logits=False)[0]
            logits = self._logits_for_target(raw)
            if params.greedy:
                j = int(np.argmax(logits))
                last = j if self.head_ids is None else int(self.head_ids[j])
                conf = float(1.0 / np.exp(logits - logits[j]).sum()) if keep is not None or branches else 1.0
            else:
                probs = process_logits(logits[None], params.temperature, params.top_k, params.top_p)[0]
                if self.head_ids is None:
                    q[i] = probs
                else:  # the draft's distribution over the whole vocabulary: zero outside its head
                    q[i, self.head_ids] = probs
                # keyed: the same noise the target's token at this position will be drawn with (n + i)
                noise = keyed_exponentials(params.seed, n + i, self.target_vocab) if params.sampler == "keyed" else None
                last = keyed_sample(q[i], params.seed, n + i, noise) if noise is not None else sample(q[i], rng)
                conf = float(q[i].max())
            if branches and i < TREE_DEPTH:
                self.branches += self._runner_ups(logits, conf, q, noise, i, last, branches)
            if keep is not None and not keep(conf) and i > 0:
                steps = i + 1
                if keep_last is not None and keep_last(conf, i + 1):
                    draft[i] = last
                    self.confidences.append(conf)
                    kept = i + 1
                    self.last_was_stopper = True
                else:
                    kept = i
                    self.dropped = (last, conf)  # (a round that passes whole verifies it anyway: its bonus token)
                break
            draft[i] = last
            self.confidences.append(conf)
            pos += 1
        singles = steps - (first is not None)  # the single steps run here (not the one the catch-up took)
        self.step_time = (time.perf_counter() - t1) / singles if singles else None  # seconds per draft step
        if self.step_time is not None:
            self.clock.record(1, self.step_time)
        self._k = kept
        self.rows = n - 1 + kept  # rows for tokens[-1], d_1..d_{kept-1} (a dropped draw's row is not counted)
        self.branches = [b for b in self.branches if b.depth <= kept]
        return Proposal(draft[:kept], None if q is None else q[:kept])

    def draw(self, raw: np.ndarray, params: SamplingParams, position: int) -> int:
        """The token ``propose`` draws from the draft's logits row ``raw`` for sequence position ``position``, greedy or
        keyed (a batched round's draws: :mod:`.batch`)."""
        logits = self._logits_for_target(raw)
        if params.greedy:
            j = int(np.argmax(logits))
            return j if self.head_ids is None else int(self.head_ids[j])
        probs = process_logits(logits[None], params.temperature, params.top_k, params.top_p)[0]
        if self.head_ids is not None:
            full = np.zeros(self.target_vocab)
            full[self.head_ids] = probs
            probs = full
        return keyed_sample(probs, params.seed, position)

    def drafted_together(self, tokens: np.ndarray, k: int) -> None:
        """A batched round drafted k tokens for these committed tokens in this drafter's cache, the last committed
        token's row and d_1..d_{k-1}'s written: the state ``propose`` leaves, for :meth:`commit`."""
        n = len(tokens)
        self.cache.owner, self.cache.rows_for = self, tokens[: n - 1]
        self._base, self._k, self.rows = n, k, n - 1 + k
        self.confidences, self.branches, self.dropped, self.last_was_stopper = [], [], None, False

    def _runner_ups(self, logits: np.ndarray, conf: float, q: np.ndarray | None, noise: np.ndarray | None,
                    depth: int, drawn: int, count: int) -> list[Branch]:
        """The ``count`` best tokens after the drawn one at this depth, with the draft's probability for each:
        greedy, the next largest logits (``conf``, the top one's probability, prices them without another softmax);
        keyed, the next largest keyed scores q / noise (what the draw would have been without the drawn token)."""
        if q is None:
            score = logits
        else:
            probs = q[depth] if self.head_ids is None else q[depth, self.head_ids]
            score = probs / (noise if self.head_ids is None else noise[self.head_ids])  # type: ignore[index]
        top = np.argpartition(score, -(count + 1))[-(count + 1):]
        top = top[np.argsort(-score[top], kind="stable")]
        ids = top if self.head_ids is None else self.head_ids[top]
        prob = (np.exp(logits[top] - logits.max()) * conf) if q is None else probs[top]
        return [Branch(depth, int(t), float(p)) for t, p in zip(ids, prob) if int(t) != drawn][:count]

    def commit(self, n_accepted: int) -> None:
        if self._k > 0:
            self.rows = self._base + min(n_accepted, self._k - 1)

    def _adopt(self, tokens: np.ndarray) -> None:
        """Take over the draft cache: if another drafter (an earlier request, or another stream) used it last, keep
        only the rows that agree with these tokens — a chat turn's draft then catches up on its new tokens only."""
        if self.cache.owner is self:
            return
        self.rows = self._adoptable(tokens)
        self.cache.owner = self
        # the rows past these are about to be rewritten: an interrupted catch-up must not leave them counted
        self.cache.rows_for = tokens[: self.rows]

    def _adoptable(self, tokens: np.ndarray) -> int:
        """The draft cache's rows this drafter can use for these tokens: its own, or, where another drafter used the
        cache last, the leading rows that agree with them."""
        if self.cache.owner is self:
            return self.rows
        return common_prefix(self.cache.rows_for, tokens)


class SelfDrafter(ModelDrafter):
    """The target's own layers as the draft (a bundle's self draft: ``ModelEntry.layers``), on the target's cache.

    The draft's cache rows for the layers it runs are the target's, so it never catches up: between rounds the
    target holds rows for every committed token but the last, which is exactly what a draft model would have caught
    up on. Its steps write rows from the last committed token's position on, which the decoder has already stopped
    counting as the target's (``CacheRows.writing`` before the proposal), and the verify step then rewrites every row
    it verifies in every layer, so no row the draft wrote is ever read as the target's."""

    def catchup_plan(self, n_tokens: int, tokens: np.ndarray | None = None) -> list[int]:
        return []

    def _adopt(self, tokens: np.ndarray) -> None:
        self.rows = len(tokens) - 1  # the target's rows, which the decoder keeps in step (SpecDecoder._resync)
        self.cache.owner, self.cache.rows_for = self, None

    def _adoptable(self, tokens: np.ndarray) -> int:
        return len(tokens) - 1


def grow_proposal(prop: Proposal, take: list[Branch]) -> tuple[np.ndarray, None, np.ndarray]:
    """A chain proposal and the branches taken -> a tree proposal's (tokens, q_draft, parents) (no q: trees verify
    greedy and keyed draws only, which never read it)."""
    tokens, parents = grow(prop.tokens, take)
    return tokens, None, parents


class StepClock:
    """Measured seconds of one step of a runner at each width it has run (a moving average), for choosing the
    cheapest steps to feed a draft with (``feed_plan``'s ``cost``). A width not yet run is priced from a single
    step as 1 + (T - 1) / WIDE_RATE single steps (on 2 EPYC cores a 64-wide step of the Qwen 0.5B draft or of
    the 1.5B target cost 8.5-9 single steps); once run, its own time counts. Nothing measured: no price (None)."""

    WIDE_RATE = 8.0
    DECAY = 0.7

    def __init__(self) -> None:
        self.seconds: dict[int, float] = {}

    def record(self, width: int, seconds: float) -> None:
        old = self.seconds.get(width)
        self.seconds[width] = seconds if old is None else self.DECAY * old + (1 - self.DECAY) * seconds

    def cost(self, width: int) -> float | None:
        if width in self.seconds:
            return self.seconds[width]
        one = self.seconds.get(1)
        return None if one is None else one * (1.0 + (width - 1) / self.WIDE_RATE)


def _width_for(runner: GraphRunner, take: int, all_logits: bool) -> int:
    """The width a step of ``take`` tokens runs in (the smallest declared width that holds them, with every row's
    logits if asked)."""
    fits = [w.T for w in runner.entry.widths if w.T >= take and (w.L == w.T or not all_logits)]
    return min(fits) if fits else take


def lone_row_cost(width: int) -> float:
    """A target step's price in rows, for ``feed_plan``'s ``lone_last`` chunking: its width (a padding row costs what
    a real one does on a compute-bound CPU step), at least 8 (a narrow step reads every weight all the same), plus 4
    for the step itself (where two plans cost about the same, the one of fewer steps). Qwen2.5-Coder-1.5B on 2 EPYC
    Zen 4 cores, last row's logits only: 8 / 16 / 24 / 32 / 48 / 64 rows 53 / 99 / 131 / 172 / 256 / 331 ms, about
    5.2 ms a row. Fixed, not measured: a plan never depends on timings."""
    return max(width, 8) + 4.0


def feed_plan(runner: GraphRunner, n: int, past_len: int, prefill_chunk: int,
              cost=None, last_any: bool = False, lone_last: bool = False) -> list[tuple[int, bool]]:  # noqa: ANN001
    """The steps ``feed`` runs for n tokens at past_len: (tokens taken, all_logits) per step, in order.

    ``lone_last`` (a target whose kernels compute every row the same in any step, a lone logits row included: the
    specedge form, ``factory.width1_exact``): the chunking cannot change a bit of the result, so after the full
    chunks the rest goes in the steps :func:`lone_row_cost` prices cheapest, the last one asking for its last row's
    logits alone (the runner computes that row by itself: an ONNX Runtime width with one logits row).

    ``last_any`` (a draft model's catch-up with its first draw: ``ModelDrafter.propose``): the last token may ride
    in any width, its logits read from that step's last real row (a width with one logits row computes the row it is
    told to: ``logits_at``). The draft's logits are only proposals, so which kernels compute them does not matter.

    ``cost(width)`` (seconds of one step at that width, or None where unknown; ``StepClock.cost``): after the full
    chunks, the rest goes in the cheapest sequence of steps those prices give — for a draft model's catch-up, whose
    chunking never reaches the output. Without it (the target's feeds), or where a width has no price, the rule
    below, which needs no timings:

    Full chunks of P first; a remainder r uses the smallest width >= r when at most half of it is
    padding (a padded row costs as much as a real one on a compute-bound CPU step), else the widest
    width <= r, repeatedly. The last token's logits come from a
    width that computes every row's logits (verify widths, >= runner.min_width; unless ``lone_last``): a prefill
    width's single logits row runs the lm_head at M = 1, which ONNX Runtime computes with other
    kernels — so the first token does not depend on how the prompt was chunked (a prompt fed
    whole and one whose prefix was already cached give the same logits, bit for bit).
    """
    plan, i = [], 0
    all_widths = sorted(w.T for w in runner.entry.widths)
    lowest = runner.min_width
    if lone_last:
        cheapest = _cheapest_plan(runner, n, past_len, prefill_chunk, all_widths,
                                  {t for t in all_widths if t >= lowest}, lone_row_cost, False)
        if cheapest is not None:
            return cheapest
    full = [w.T for w in runner.entry.widths if w.L == w.T and w.T >= lowest]
    final = [t for t in all_widths if t >= lowest] if last_any else full  # the widths the last token may ride in
    if cost is not None and final:
        cheapest = _cheapest_plan(runner, n, past_len, prefill_chunk, all_widths, set(final), cost, not last_any)
        if cheapest is not None:
            return cheapest
    if last_any:
        full = []  # the rule below then never keeps the last token back for an all-logits step
    while i < n:
        rem = n - i
        # a runner that writes its padding rows into the cache can only use widths that end inside S_max
        widths = [t for t in all_widths
                  if not runner.pads_into_cache or past_len + i + t <= runner.max_context]
        if full and rem <= max(full):  # the rest, last token included, in one all-logits width
            plan.append((rem, not lone_last))
            return plan
        fit = [t for t in widths if t >= rem]
        if rem >= prefill_chunk:
            take = prefill_chunk
        elif fit and fit[0] <= 2 * rem:  # padding costs compute on a CPU: at most as much as the real tokens
            take = rem
        else:
            take = max([t for t in widths if t <= rem], default=1)
        if full and take == rem and not lone_last:  # keep the last token for an all-logits step
            take = rem - 1
        plan.append((take, False))
        i += take
    return plan


def _cheapest_plan(runner: GraphRunner, n: int, past_len: int, prefill_chunk: int, all_widths: list[int],
                   final: set[int], cost,  # noqa: ANN001
                   final_all_logits: bool = True) -> list[tuple[int, bool]] | None:
    """feed_plan by prices: full chunks while more than one is left, then the cheapest steps for the rest (the
    last token in a width of ``final``, all its rows' logits asked for if ``final_all_logits``), or None where a
    width it could use has no price."""
    plan, i = [], 0
    while n - i > prefill_chunk:  # a full chunk never takes the last token
        plan.append((prefill_chunk, False))
        i += prefill_chunk
    r0 = n - i
    best: list[tuple[float, tuple[int, bool]]] = [(0.0, (0, False))]  # best[r]: the last r tokens, first step
    for r in range(1, r0 + 1):
        at = past_len + n - r
        options = []
        for w in all_widths:
            if runner.pads_into_cache and at + w > runner.max_context:
                continue
            c = cost(w)
            if c is None:
                return None
            if w in final and w >= r:
                options.append((c, (r, final_all_logits)))
            t = min(w, r - 1)
            if t >= 1:
                options.append((c + best[r - t][0], (t, False)))
        if not options:
            return None
        best.append(min(options))
    r = r0
    while r > 0:
        take, all_logits = best[r][1]
        plan.append((take, all_logits))
        r -= take
    return plan


def feed(runner: GraphRunner, tokens: np.ndarray, past_len: int, prefill_chunk: int,
         clock: StepClock | None = None, last_any: bool = False, lone_last: bool = False) -> np.ndarray:
    """Feed many tokens at past_len.. in declared widths (``feed_plan``, priced by ``clock`` if given, which
    then records every step's time); return the last token's logits [V]."""
    i, logits, take, all_logits = 0, None, 0, False
    plan = feed_plan(runner, len(tokens), past_len, prefill_chunk, cost=None if clock is None else clock.cost,
                     last_any=last_any, lone_last=lone_last)
    for take, all_logits in plan:
        t0 = time.perf_counter()
        logits = runner.step(tokens[i: i + take], past_len + i, all_logits=all_logits)
        if clock is not None:
            clock.record(_width_for(runner, take, all_logits), time.perf_counter() - t0)
        i += take
    assert logits is not None, "feed() needs at least one token"
    return logits[take - 1] if all_logits else logits[0]
