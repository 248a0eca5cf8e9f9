"""Speculation that knows when it pays: a measured cost model and a per-round choice of drafter.

Each round the :class:`AutoDrafter` predicts tokens per second for every option it has —

    plain:               1 / t_v(1)
    prompt lookup (m):   E(alpha_lookup, m) / t_v(m+1)                       (drafting is free)
    draft model (k):     E(alpha_model, k) / (k * t_d + t_v(k+1))
    E(alpha, k) = (1 - alpha^(k+1)) / (1 - alpha)   tokens committed per round

— with t_v(n) the measured time of a target step at the width n tokens run in, t_d of one
draft step, and alpha the running per-token acceptance of each drafter — and proposes with
the best. ``hybrid`` takes prompt lookup whenever it has a match and the draft model
otherwise. When no speculative option beats plain decoding the round is plain ("auto-off");
after ``FIRST_PROBE`` plain rounds of a request the best option under an optimistic acceptance is
tried (if even that would not pay, nothing is), and the gap to the next probe doubles (it starts
at ``probe_every`` again after a round that drafted). A draft-model probe is ``PROBE_ROUNDS``
rounds of at most ``PROBE_K`` tokens, past the confidence gate, extended while its drafts all pass (each
such round twice as long as the last) and ended where the estimate picks prompt lookup. The
draft model's catch-up (the committed tokens it has not seen, priced per step of the plan
``feed`` will run: prefill chunks for a prompt, a single step for a round's leftover token) is
charged to the round that would use it (spread over the runs of model rounds seen so far where the
request copies its context, over the request where it does not), and a model round must be predicted
``MODEL_MARGIN`` faster than the alternatives (``PROMPT_MARGIN`` where it would first catch the draft up on the
prompt, a re-probe's too). In a gap between two lookup matches of a request that copies its
context, the options are weighed by the seconds they save rather than by tokens per second: what a round commits
past the gap (its expected length learned from the request's earlier gaps) lookup would have committed at the
request's own pace (``decide``'s ``gap`` and ``pace``). Prompt lookup is asked every round, so what it would
have proposed in rounds it did not run is checked against the committed text too: its acceptance
(and how much of the request it matches) is learned from every round. The step costs and the
draft's acceptance live in the decoder's :class:`CostModel`, so a request starts from what the
earlier ones measured; but until its own draft rounds speak, a request's prior for the draft is what its
target's confidence predicts (:class:`TargetSplit`: the share of its tokens the target was sure of, from the
top-1 probabilities the decoder passes for its first ``CONF_WINDOW`` tokens), not what other kinds of text left.

Inside a model round drafting stops early when the draft's top probability falls below a
threshold learned online: acceptance is tracked per confidence bin, and a token is drafted
only while its bin's acceptance beats the break-even ratio (t_d + marginal verify cost) / t_v(1).
The draw that stops a round is not verified by it, but when the round passes whole, the target's
next token tells whether it would have passed: the bins learn from those too.

None of this touches the acceptance rule: it only changes which tokens are proposed, so
greedy output and the sampled distribution stay exact.
"""

from __future__ import annotations

import time

import numpy as np

from .drafters import EMPTY, DrafterHooks, ModelDrafter, PromptLookupDrafter, Proposal, grow_proposal
from .policy import (
    MODEL_MARGIN,
    PROMPT_MARGIN,
    SPEC_MODES,
    Acceptance,
    CostModel,
    Decision,
    TargetSplit,
    decide,
    expected_tokens_per_round,
)
from .trees import Branch, best_branches, reach_of


class AutoDrafter(DrafterHooks):
    """Chooses plain, prompt lookup or the draft model (with its k) every round; see the module docstring."""

    OPTIMISTIC_ALPHA = 0.9  # what a re-probe assumes: is the option worth trying if its drafts were good?
    HORIZON_CAP = 256  # tokens a request is assumed to still run at most, when spreading the draft's catch-up
    CARRY_WEIGHT = 8.0  # tokens of evidence a request inherits about the draft's acceptance
    FIRST_PROBE = 4  # plain rounds before a request's first re-probe (then the gap doubles; probe_every after drafting)
    PROBE_ROUNDS = 3  # rounds a draft-model probe runs before its acceptance decides again
    PROBE_K = 2  # a probe's draft length (at most): enough to measure acceptance, cheap where the draft fails
    # share of a request's text its lookup matched from which its model runs are taken to be cut by lookup rounds
    # (the catch-up then spread over the runs learned, ``_streak_priced``; below it, over the request)
    COPYING = 0.2
    COPY_TOKENS = 24  # tokens before a request's share says it does not copy (a summary's first ones may not match)
    # ... and until then, the runs a catch-up is spread over are taken to be at least this share of the request
    UNSURE_SHARE = 0.2
    CONF_TOKENS = 4  # target confidences a request needs before their share of sure ones sets the draft's prior
    # ... and the request's first tokens whose confidences the decoder computes (a softmax over the vocabulary per
    # row: ~0.13 ms for Qwen's 151,936 logits, so not every round's; see ``wants_confidence``)
    CONF_WINDOW = 64
    clock = staticmethod(time.perf_counter)  # the request's pace is timed with it (tests set their own)
    # The guard on what the rounds really did: once a request has run GUARD_ROUNDS rounds of a drafter, the drafter is
    # chosen only while those rounds, timed whole by the decoder (drafting, the verify step, the host's work; a
    # draft's catch-up left out, which its plan prices), committed more tokens per second than plain rounds do on
    # this machine (``CostModel.plain_pace``). Each older round weighs GUARD_DECAY of the one after it, so a run of
    # good rounds lifts the bar as fast as bad ones set it; a barred drafter is still re-probed like an idle one.
    # The estimates decide() works from miss what they do not model (a wide step's real cost on this CPU, the
    # host's work per round, a draft step slower than timed at load), and they alone let auto run below plain.
    GUARD_ROUNDS = 3
    GUARD_DECAY = 0.75

    def __init__(self, costs: CostModel, lookup: PromptLookupDrafter, model: ModelDrafter | None,
                 mode: str = "auto", probe_every: int = 16):
        if mode not in SPEC_MODES:
            raise ValueError(f"mode must be one of {SPEC_MODES}, got {mode!r}")
        self.name = mode
        self.costs, self.lookup, self.model, self.mode = costs, lookup, model, mode
        self.probe_every = probe_every
        # The draft's acceptance is the decoder's, carried over from its earlier requests at the weight of a few
        # tokens: a JSON request then starts drafting at once, and a chat request after it stops within a few
        # rounds (carried whole, ~70 tokens of code's 0.9 kept auto drafting through a third of a chat answer).
        costs.model_acceptance.limit(self.CARRY_WEIGHT)
        self.alpha = {"prompt-lookup": Acceptance(), "model": costs.model_acceptance}
        self.gate = costs.gate
        self.rounds: dict[str, int] = {}
        self.tree = 0  # branch rows a model round may add (0: chains); the decoder sets it per request
        self._candidates: list[Branch] = []  # the last model round's runner-ups (taken into its tree or not)
        self.reset()

    def reset(self) -> None:
        if self.model is not None:
            self.model.reset()
        self._last: tuple[str, int] = ("none", 0)
        self._confs: list[float] = []
        self._plain_streak = 0
        # each request probes the draft early: what the earlier ones measured (carried at CARRY_WEIGHT tokens) may be
        # another kind of text (a chat answer's failures kept a 47-token JSON answer plain to its end)
        self._probe_gap = self.FIRST_PROBE
        self._probe_model_next = True
        self._probe_left = 0
        self._probe_k = self.PROBE_K
        self._probing = False
        self._unverified: tuple[float, int, int] | None = None  # a dropped draw (conf, token, position) to check
        self._shadow: tuple[int, np.ndarray] | None = None  # (position, tokens) a lookup not run would have proposed
        self._round_start = 0
        self.rounds = {}
        self._start: int | None = None  # context length at the request's first round
        self._t_first = 0.0  # clock at the request's first round
        self._gap_from: int | None = None  # context length where lookup's current gap (no match) began
        self._asked = 0  # context length at the last round lookup was asked at (_gap)
        self._gaps = (0, 0)  # tokens and number of this request's gaps between lookup matches, ended so far
        self._copied = 0  # tokens of this request's text its lookup proposals matched (run or not: ``_learn_lookup``)
        self._streak = 0  # model rounds in a row so far
        self._sure = [0, 0]  # this request's committed tokens the target was sure of (TargetSplit.SURE), and all
        self._paced: dict[str, tuple[float, float, int]] = {}  # drafter -> its rounds' (seconds, tokens) decayed, count
        self._round_catchup = 0.0  # seconds the last round's draft spent catching up (left out of its pace)

    def propose(self, tokens, k, params, rng) -> Proposal:  # noqa: ANN001
        self._candidates = []
        self._round_catchup = 0.0
        if k <= 0:  # the last token of a request: nothing to draft
            self._last = ("none", 0)
            self.rounds["none"] = self.rounds.get("none", 0) + 1
            return EMPTY
        if self._unverified is not None:
            conf, token, at = self._unverified
            self._unverified = None
            if at < len(tokens):
                self.gate.record([conf], accepted=int(tokens[at] == token))
        if self._shadow is not None:  # what the last round's lookup would have proposed, against what was committed
            self._learn_lookup(tokens, *self._shadow)
            self._shadow = None
        look = self.lookup.propose(tokens, k, params, rng)
        # what the draft must feed first
        plan = self.model.catchup_plan(len(tokens), tokens) if self.model is not None else []
        catchup = self.costs.catchup_time(plan)
        if self._start is None:
            self._start, self._t_first = len(tokens), self.clock()  # the prompt and the token its prefill produced
        horizon = min(self.HORIZON_CAP, max(1, params.max_new_tokens - 1 - (len(tokens) - self._start)))
        if self.model is not None and catchup > 0 and self._copying(len(tokens) - self._start):
            catchup = self._streak_priced(catchup, horizon, k, sure=len(tokens) - self._start >= self.COPY_TOKENS)
        if self.model is not None and not self.rounds.get("model") and self._sure[1] >= self.CONF_TOKENS:
            # until the request's own draft rounds speak, its prior is what its target's confidence predicts, not what
            # the earlier requests carried: a JSON answer after chats and summaries carried their 0.71 and ran plain
            # where model:4 ran 1.4-1.8x (docs/benchmarks.md)
            self.alpha["model"].reseed(self.costs.target_split.predict(self._sure[0] / self._sure[1]),
                                       self.CARRY_WEIGHT)
        alpha_model = self.alpha["model"].alpha if self.model is not None else None
        gap, pace = self._gap(tokens, len(look.tokens) > 0, params, rng)
        behind_prompt = sum(plan) > len(tokens) - self._start + 1  # the draft has not seen the whole prompt
        d = decide(self.costs, self.alpha["prompt-lookup"].alpha, len(look.tokens), alpha_model, k, self.mode,
                   model_overhead=catchup, horizon=horizon, gap=gap, pace=pace,
                   margin=PROMPT_MARGIN if behind_prompt else MODEL_MARGIN)
        if self.mode == "auto" and d.kind != "none" and self.losing(d.kind):  # below plain: plain (re-probes try it)
            d = Decision("none", 0, self.costs.rate_plain(), 1.0 + self.costs.guess_alpha)
        self._probing = False
        if d.kind == "prompt-lookup":
            self._probe_left = 0
        if self._probe_left > 0 and self.mode == "auto" and self.losing("model"):
            self._probe_left = 0  # the probe's rounds ran below plain on the wall clock: it ends, however they passed
        if self._probe_left > 0 and self.model is not None:  # a draft-model probe runs PROBE_ROUNDS rounds
            self._probe_left -= 1
            if d.kind != "model":  # (once the estimate itself says draft, the rounds are no longer probes)
                hope = self.OPTIMISTIC_ALPHA
                d = self._probe_size(decide(self.costs, hope, 0, hope, k, self.mode, model_overhead=catchup,
                                            horizon=horizon))
                self._probing = d.kind == "model"
        elif d.kind == "none":
            self._plain_streak += 1
            untried = self.model is not None and not self.costs.model_tried
            if self._plain_streak >= (self.FIRST_PROBE if untried else self._probe_gap):
                # Re-probe: would any option pay if its drafts were good? Then try it once, so a stale acceptance
                # estimate can recover; the gap doubles each time, so hopeless probing fades out. Probes alternate
                # between the drafters: under the same optimistic acceptance a free lookup match always looks
                # better than the draft model, so on code (short matches everywhere) auto never learned that the
                # 0.5B draft pays there (a whole request plain and lookup at 31 tok/s, model:3 39.5).
                self._plain_streak, self._probe_gap = 0, min(2 * self._probe_gap, 256)
                hope = self.OPTIMISTIC_ALPHA
                model_turn = self.model is not None and (untried or self._probe_model_next)
                self._probe_model_next = not model_turn
                # a probe that would first catch the draft up on the prompt is that investment too (PROMPT_MARGIN):
                # at MODEL_MARGIN, short chat answers paid a ~150 ms prompt catch-up for a probe near their end and
                # ran slower than plain
                d = decide(self.costs, hope, 0 if model_turn else len(look.tokens),
                           hope if self.model is not None else None, k, self.mode, model_overhead=catchup,
                           horizon=horizon, margin=PROMPT_MARGIN if behind_prompt else MODEL_MARGIN)
                if d.kind == "model":  # one round is weak evidence (code's first draft round: 1 of 5 accepted)
                    self._probe_left, self._probe_k = self.PROBE_ROUNDS - 1, self.PROBE_K
                    d = self._probe_size(d)
                    self._probing = True
        else:
            self._plain_streak, self._probe_gap = 0, self.probe_every
        self.rounds[d.kind] = self.rounds.get(d.kind, 0) + 1
        if d.kind != "prompt-lookup" and len(look.tokens):
            self._shadow = (len(tokens), look.tokens)
        if d.kind == "model":
            self._streak += 1
        elif self._streak:
            self.costs.model_streak = 0.7 * self.costs.model_streak + 0.3 * self._streak
            self._streak = 0
        if d.kind == "prompt-lookup":
            look = Proposal(look.tokens[: d.k] if d.k else look.tokens, None)
            self._last = ("prompt-lookup", len(look.tokens))
            return look
        if d.kind == "model":
            assert self.model is not None
            threshold = self.costs.break_even_acceptance(k)
            self._round_start = len(tokens)  # draft i goes to position len(tokens) + i
            t0 = self.model.time_catch_up
            # a probe drafts its whole (short) length: it is there to measure, and the confidence gate, shared with
            # the earlier requests, would cut it to one token where their drafts failed
            keep = None if self._probing else (lambda conf: self.gate.acceptance(conf) >= threshold)
            prop = self.model.propose(tokens, d.k, params, rng, keep=keep, keep_last=self._worth_verifying,
                                      branches=min(self.tree, self.BRANCHES_PER_DEPTH))
            self._round_catchup = self.model.time_catch_up - t0
            self.costs.observe_catchup(plan, self._round_catchup)
            self.costs.model_tried = True
            self._confs = self.model.confidences
            if self.model.step_time is not None:
                self.costs.observe_draft(self.model.step_time)
            self._last = ("model", len(prop.tokens))
            return self._grow(prop)
        self._last = ("none", 0)
        return EMPTY

    BRANCHES_PER_DEPTH = 2  # runner-ups a model round notes at each shallow depth (tree candidates)

    def _grow(self, prop: Proposal) -> Proposal:
        """A model round's chain, with the branches (runner-ups at its shallow depths) that raise its predicted
        tokens per second: each adds its expected tokens (the spine fails at its depth, priced by the confidence
        gate, and the branch is the target's token, priced by ``CostModel.branch_odds``) for one more verify row."""
        self._candidates = self.model.branches
        if not self.tree or not self.model.branches or not len(prop.tokens):
            return prop
        confs = self.model.confidences
        reach = reach_of([self.gate.acceptance(c) for c in confs])
        odds = self.costs.branch_odds
        k = len(prop.tokens)
        tokens = 1.0 + sum(reach[1: k + 1])
        seconds = k * self.costs.draft_time() + self.costs.verify_time(k + 1)
        take: list[Branch] = []
        for gain, b in best_branches(self.model.branches, reach, lambda b: odds.odds(b.prob), self.tree):
            more = self.costs.verify_time(k + 2 + len(take)) - self.costs.verify_time(k + 1 + len(take))
            if (tokens + gain) / (seconds + more) <= tokens / seconds:
                break
            take.append(b)
            tokens, seconds = tokens + gain, seconds + more
        if not take:
            return prop
        return Proposal(*grow_proposal(prop, take))

    def observe_next(self, depth: int, token: int) -> None:
        """The last model round's runner-ups at the depth its chain failed at teach ``branch_odds`` whether they were
        the target's token there, whether the round verified them as branches or ran a chain: the odds keep
        learning in rounds that did not branch."""
        for b in self._candidates:
            if b.depth == depth:
                self.costs.branch_odds.record(b.prob, b.token == token)
        self._candidates = []

    def _streak_priced(self, catchup: float, horizon: int, k: int, sure: bool = True) -> float:
        """The catch-up as ``decide`` spreads it over ``horizon`` tokens, re-priced by what it buys: it serves the
        run of model rounds it starts, and then auto turns to another kind and the draft falls behind again. So it
        is spread over a run as long as they have lasted (``CostModel.model_streak`` rounds, running across
        requests; prior 32: the whole request), not over the request. Spread over the request, a model round after
        a few lookup rounds looks cheap on edit and summarize prompts and is not.

        Only where the request copies (its lookup's proposals matched at least ``COPYING`` of the tokens it has
        committed, ``_copying``): runs are short because lookup rounds cut them, and runs learned on edits would
        price a JSON or code request's prompt catch-up (and its probes) out for the whole request, where lookup
        rarely matches and a model run lasts the request.

        Not ``sure`` (the request's first ``COPY_TOKENS``, taken to copy before it has shown whether it does): a run
        is taken to last at least ``UNSURE_SHARE`` of the horizon, so that very short runs learned on a summary do
        not keep the JSON answers after it plain for their first tokens (measured: json-0 0.69 -> 0.95x model:4,
        docs/benchmarks.md). Where the target's confidence already says more, more (``_unsure_share``)."""
        run = max(1.0, self.costs.model_streak * expected_tokens_per_round(self.alpha["model"].alpha, min(k, 4)))
        if not sure:
            run = max(run, self._unsure_share() * horizon)
        return catchup * max(1.0, horizon / run)

    def _unsure_share(self) -> float:
        """The share of the request a run of model rounds is taken to last while the request has not shown whether
        it copies: ``UNSURE_SHARE``, or, where its lookup has matched nothing yet and the target's confidence is
        known (``CONF_TOKENS``), the share of its tokens the target was sure of, if more. The draft's run lasts
        until lookup cuts in or the draft fails, and where the target is sure it seldom fails: a JSON answer
        (every token sure, nothing copied) after a chat answer whose runs lookup had cut short would otherwise price
        its long prompt's catch-up over a fifth of the request and run plain for most of it. The cost: an edit whose
        first tokens the target is half sure of may start model runs that lookup then cuts short
        (``docs/benchmarks.md``)."""
        if self._copied or self._sure[1] < self.CONF_TOKENS:
            return self.UNSURE_SHARE
        return max(self.UNSURE_SHARE, self._sure[0] / self._sure[1])

    def _gap(self, tokens: np.ndarray, matched: bool, params, rng) -> tuple[float, float]:  # noqa: ANN001
        """(expected tokens until lookup matches again, the request's tokens/s) for ``decide``, where this round is
        in a gap of a copying request (lookup has no match; its proposals matched ``COPYING`` of the text, past
        ``COPY_TOKENS``) whose earlier gaps say how long one lasts (their mean: ~2 tokens through summarize-2, 4-11
        through the edits, 13-16 through code); else (inf, 0): the fastest option, as without it. A summary
        realigns with its source within a token or two, so a draft-model round in its gap commits what lookup would
        have committed at ~150 tok/s: scored by tokens per second alone, such rounds (predicted faster than plain,
        slower with their catch-up) ran summarize-2 at 0.76-0.85x fixed lookup. A longer gap (an edit
        writing new lines) keeps the model rounds that pay there. A gap ends where lookup would have matched again,
        which may be inside the round that ended it: measured to the round's end, a model round's 3-4 tokens made
        summarize-2's gaps look 4.5 tokens long, and its rounds kept their place there."""
        n_tokens = len(tokens)
        if matched and self._gap_from is not None:  # a gap ends: where, within the last round? (earlier rounds'
            # starts were asked at the time: no match)
            end = next((p for p in range(max(self._gap_from, self._asked) + 1, n_tokens)
                        if len(self.lookup.propose(tokens[:p], 1, params, rng).tokens)), n_tokens)
            self._gaps = (self._gaps[0] + end - self._gap_from, self._gaps[1] + 1)
            self._gap_from = None
        elif not matched and self._gap_from is None:
            self._gap_from = n_tokens
        self._asked = n_tokens
        committed, seconds = n_tokens - (self._start or 0), self.clock() - self._t_first
        if matched or not self._gaps[1] or seconds <= 0 or committed < self.COPY_TOKENS \
                or not self._copying(committed):
            return float("inf"), 0.0
        return self._gaps[0] / self._gaps[1], committed / seconds  # (gaps taken as memoryless: their mean)

    def _copying(self, committed: int) -> bool:
        """Whether this request copies its context: the lookup's proposals (in its own rounds and, asked for free,
        in the others) matched at least ``COPYING`` of the tokens committed so far. (Lookup rounds were 0.38-0.72 of
        the rounds of the Qwen pair's edit and summarize prompts, 0-0.27 of code, JSON and chat ones.) Until
        ``COPY_TOKENS`` are committed it is taken to copy: the learned runs price the draft."""
        return committed < self.COPY_TOKENS or self._copied >= self.COPYING * committed

    def _learn_lookup(self, tokens: np.ndarray, start: int, proposed: np.ndarray) -> None:
        """The lookup's acceptance from a round it did not run: asking it costs nothing, and once the round has
        committed, the tokens at its positions say how much of its proposal the target would have taken (greedy:
        exactly; sampled: equality stands in for the acceptance test, as for the gate's dropped draw). Learned only
        from its own rounds, a lookup at its 50 % prior behind a good draft model was never chosen, so never
        corrected. Tokens past what the round committed are unknown: a proposal that agrees that far counts no
        failure."""
        seen = tokens[start: start + len(proposed)]
        if len(seen) == 0:
            return
        diff = np.flatnonzero(proposed[: len(seen)] != seen)
        agree = int(diff[0]) if len(diff) else len(seen)
        self.alpha["prompt-lookup"].update(min(len(seen), agree + 1), agree)
        self._copied += agree

    def _worth_verifying(self, conf: float, n: int) -> bool:
        """The draw that stopped a round, its draft step already paid: proposed as the round's n-th token when its
        expected worth (its confidence bin's acceptance times a plain step, the time a token costs without it) beats
        the extra row it adds to the verify step. On 2 EPYC cores a row of a 2-5 token step costs 1-3 ms against a
        33 ms plain step, so a draw that passes a tenth of the time pays; dropping it threw away a draft step
        (~11 ms for the Qwen 0.5B draft) a round."""
        extra = self.costs.verify_time(n + 1) - self.costs.verify_time(n)
        return self.gate.acceptance(conf) * self.costs.verify_time(1) > extra

    def _probe_size(self, d: Decision) -> Decision:
        """A probe is chosen at the draft length that would pay if the draft were good, and run shorter: it is there
        to measure the acceptance, which a 2-token round measures as well, at half the cost where it fails. Each
        probe round whose drafts all pass doubles the next one's length (a 2-token round also pays an extra draft
        step for the bonus token the draft has not seen: half again the drafting of a 4-token round)."""
        return Decision(d.kind, min(d.k, self._probe_k), d.rate) if d.kind == "model" else d

    def strategy_rounds(self) -> dict[str, int]:
        return dict(self.rounds)

    def wants_confidence(self) -> bool:
        """Whether the decoder should pass the round just committed's target confidences (``observe_confidence``):
        only with a draft model, and only in the request's first ``CONF_WINDOW`` tokens. Its prior needs them only
        before its first draft-model round, and ``TargetSplit`` learns well enough from every request's first
        ones."""
        return self.model is not None and self._sure[1] < self.CONF_WINDOW

    def observe_confidence(self, confs: list[float]) -> None:
        """The target's top-1 probability at each row of the round just committed (rows 0..m: the m accepted drafts'
        and the target's own token): a draft-model round's rows teach ``CostModel.target_split`` what the draft
        passes where the target is sure, and every round's rows add to the request's share of sure tokens."""
        kind, n = self._last
        if kind == "model" and n:
            self.costs.target_split.record(confs[:n], min(len(confs) - 1, n))
        self._sure[0] += sum(c > TargetSplit.SURE for c in confs)
        self._sure[1] += len(confs)

    def losing(self, kind: str) -> bool:
        """Whether this request's rounds of ``kind`` have committed fewer tokens per second than plain rounds run at
        (the guard: GUARD_ROUNDS)."""
        seconds, tokens, rounds = self._paced.get(kind, (0.0, 0.0, 0))
        return rounds >= self.GUARD_ROUNDS and seconds > 0 and tokens / seconds < self.costs.measured_plain_rate()

    def observe_round(self, seconds: float, tokens: int) -> None:
        kind = self._last[0]
        if kind == "none":
            self.costs.observe_plain_round(seconds, tokens)
            return
        s, t, n = self._paced.get(kind, (0.0, 0.0, 0))
        g = self.GUARD_DECAY
        self._paced[kind] = (g * s + max(0.0, seconds - self._round_catchup), g * t + tokens, n + 1)

    def commit(self, n_accepted: int) -> None:
        kind, n = self._last
        if kind == "none":
            return
        if kind == "model" and self.model.last_was_stopper:
            # the draw the gate stopped at rode along for free: the acceptance the next rounds are priced by is that
            # of the tokens the gate lets through (with the stopper's misses in it, auto drafted less where the draft
            # is good); its confidence bin learns from it below all the same
            self.alpha[kind].update(n - 1, min(n_accepted, n - 1))
        else:
            self.alpha[kind].update(n, n_accepted)
        if kind == "prompt-lookup":
            self._copied += n_accepted
        if kind == "model" and self._probing and 0 < n == n_accepted:
            # a probe whose drafts all pass goes on, longer: three 2-token rounds cannot outweigh the acceptance an
            # earlier request carried over (a JSON answer after a chat one went back to plain with the draft at 6/6)
            self._probe_left = max(self._probe_left, 1)
            self._probe_k = min(2 * self._probe_k, 16)
        if kind == "model":
            assert self.model is not None
            self.gate.record(self._confs, n_accepted)
            # The draw the gate dropped is checked for free when the round passes whole: the target's next token
            # (the round's bonus token, at the dropped draw's position) is what it would have been verified
            # against (under sampling, equality stands in for the acceptance test). Without this, a confidence
            # bin whose prior sits below break-even never learns, as its draws are never verified: on chat the
            # Qwen 0.5B draft's tokens at 40-70 % confidence passed 67-100 % of the time (model:4), the prior
            # said 45-65 %, and auto's rounds mostly drafted one token.
            dropped = self.model.dropped
            if dropped is not None and n_accepted == n:
                self._unverified = (dropped[1], dropped[0], self._round_start + n)
            self.model.commit(n_accepted)
