"""The cost model and the per-round decision, on synthetic timings and a scripted draft model."""

from __future__ import annotations

import numpy as np
import pytest

from specedge.runtime import SamplingParams
from specedge.runtime.adaptive import AutoDrafter
from specedge.runtime.drafters import NoDrafter, PromptLookupDrafter, Proposal
from specedge.runtime.policy import (
    Acceptance,
    ConfidenceGate,
    CostModel,
    TargetSplit,
    decide,
    expected_tokens_per_round,
)
from specedge.runtime.trees import Branch, BranchOdds

pytestmark = pytest.mark.fast  # torch-free: make test-fast


def costs(draft: float | None = 0.01) -> CostModel:
    # a CPU-like target: a 9-token verify costs 2x a 1-token step
    return CostModel({1: 0.100, 3: 0.120, 5: 0.140, 9: 0.200}, draft)


def test_expected_tokens():
    assert expected_tokens_per_round(0.0, 4) == 1.0
    assert expected_tokens_per_round(1.0, 4) == 5.0
    assert expected_tokens_per_round(0.5, 2) == pytest.approx(1.75)


def test_rates_follow_the_formulas():
    c = costs()
    assert c.rate_plain() == pytest.approx(10.0)
    # 4 draft steps, one more after the 0.8^4 of rounds that pass whole (the draft then catches up its last token)
    assert c.rate_model(0.8, 4) == pytest.approx(expected_tokens_per_round(0.8, 4) / ((4 + 0.8 ** 4) * 0.01 + 0.14))
    assert c.rate_lookup(0.8, 6) == pytest.approx(expected_tokens_per_round(0.8, 6) / 0.2)  # 7 tokens run at width 9
    assert c.break_even_acceptance(8) == pytest.approx((0.01 + 0.1 / 8) / 0.1)


def test_decide_picks_the_fastest_option_and_turns_speculation_off_when_it_cannot_pay():
    c = costs()
    d = decide(c, alpha_lookup=0.5, lookup_len=0, alpha_model=0.9, k_max=8)
    assert d.kind == "model" and d.rate > c.rate_plain()
    assert d.k == max(range(1, 9), key=lambda k: c.rate_model(0.9, k))
    assert decide(c, 0.5, 0, alpha_model=0.05, k_max=8).kind == "none"  # auto-off
    assert decide(c, 0.95, 8, alpha_model=0.3, k_max=8).kind == "prompt-lookup"
    assert decide(costs(draft=None), 0.5, 0, alpha_model=0.9, k_max=8).kind == "none"  # no model timing: no model
    assert decide(c, 0.5, 0, alpha_model=0.9, k_max=8, model_overhead=1.0).kind == "none"  # catch-up too dear
    # hybrid never decodes plainly while it has a drafter, and prefers a lookup match
    assert decide(c, 0.5, 0, alpha_model=0.05, k_max=8, mode="hybrid").kind == "model"
    assert decide(c, 0.1, 3, alpha_model=0.99, k_max=8, mode="hybrid").kind == "prompt-lookup"


def test_in_a_short_gap_between_lookup_matches_the_round_that_saves_most_time_wins():
    """Tokens per second compares rounds when the next one faces the same options again (a chat answer). A copying
    request's gap between two lookup matches does not: lookup resumes after it at 5-8 tokens a round, so what a
    round commits past the gap is worth only the request's pace. Each option is then scored by the seconds it
    saves: its tokens within the gap at the best rate now, past it at the pace, less its own seconds. A gap of a
    token or two (a summary realigning with its source) takes the short plain step; a long one (new lines of an
    edit), or none, the fastest option."""
    c = costs()
    fastest = decide(c, alpha_lookup=0.5, lookup_len=0, alpha_model=0.9, k_max=8)
    assert fastest.kind == "model"
    assert decide(c, 0.5, 0, 0.9, 8, gap=50.0, pace=100.0) == fastest  # a long gap: as without it
    assert decide(c, 0.5, 0, 0.9, 8, gap=1.0, pace=fastest.rate * 0.9) == fastest  # no faster pace: as without it
    assert decide(c, 0.5, 0, 0.9, 8, gap=1.0, pace=100.0).kind == "none"  # one token, then lookup at 10x plain
    # the shorter the gap, the shorter the round
    picks = [decide(c, 0.5, 0, 0.9, 8, gap=g, pace=100.0) for g in np.linspace(8.0, 1.0, 29)]
    seconds = [d.tokens / d.rate for d in picks]
    assert all(a >= b for a, b in zip(seconds, seconds[1:])) and len(set(seconds)) >= 3, picks


def test_cost_model_follows_observed_timings():
    c = costs()
    for _ in range(100):
        c.observe_target(4, 0.5)  # 4 tokens run at width 5
        c.observe_draft(0.05)
    assert c.verify_time(5) == pytest.approx(0.5, rel=1e-3) and c.draft_time() == pytest.approx(0.05, rel=1e-3)


def test_cost_model_moves_widths_not_run_with_the_machine():
    """A shared machine changes phase: every step runs 1.3x slower. auto runs width 5 only for a while; the widths
    it did not run must move too (averaged per width, T=1 kept the old phase's time and plain looked 1.3x cheaper
    than it was), and the shape (T=5 against T=1) stays what it was."""
    c = costs()
    shape = c.verify_time(5) / c.verify_time(1)
    for _ in range(60):
        c.observe_target(4, 1.3 * 0.14)  # width 5's shape is 0.14 s
    assert c.verify_time(5) == pytest.approx(1.3 * 0.14, rel=0.02)
    assert c.verify_time(1) == pytest.approx(0.13, rel=0.05)
    assert c.verify_time(5) / c.verify_time(1) == pytest.approx(shape, rel=0.05)
    assert c.draft_time() == pytest.approx(1.3 * 0.01, rel=0.05)  # the draft's step with them


def test_cost_model_learns_a_wrong_shape_from_widths_run_in_turn():
    """The load-time timing had width 5 at 1.4x width 1; it runs at 2x. Run in turn, the shape learns it (slowly),
    where a single speed could not fit both."""
    c = costs()
    for _ in range(400):
        c.observe_target(1, 0.1)
        c.observe_target(5, 0.2)
    assert c.verify_time(1) == pytest.approx(0.1, rel=0.05) and c.verify_time(5) == pytest.approx(0.2, rel=0.05)


def test_acceptance_estimate_and_confidence_gate():
    a = Acceptance()
    for _ in range(200):
        a.update(4, 4)  # everything accepted: no failures observed
    assert a.alpha > 0.95
    for _ in range(200):
        a.update(4, 0)
    assert a.alpha < 0.05
    g = ConfidenceGate()
    for _ in range(100):
        g.record([0.95, 0.15], accepted=1)  # confident token accepted, unsure one rejected
    assert g.acceptance(0.97) > 0.9 and g.acceptance(0.12) < 0.1


class ScriptedModel:
    """Stands in for ModelDrafter: proposes k fixed tokens at a fixed confidence."""

    last_was_stopper = False  # the last proposed token is never the draw a gate stopped at
    branches: list = []  # ModelDrafter's runner-ups (tree candidates): none here

    def __init__(self, confidence: float = 0.9):
        self.calls, self.rows, self.time_catch_up, self.confidence = 0, 0, 0.0, confidence
        self.dropped = None  # ModelDrafter's: the draw a gate stopped at (this one never names one)

    def reset(self):
        pass

    def propose(self, tokens, k, params, rng, keep=None, keep_last=None, branches=0):  # noqa: ANN001
        self.calls += 1
        n = k
        for i in range(1, k):
            if keep is not None and not keep(self.confidence):
                n = i
                break
        self.confidences, self.step_time = [self.confidence] * n, 0.01
        self.rows = len(tokens) - 1 + n  # always caught up: no catch-up cost
        return Proposal(np.full(n, 7, dtype=np.int64), None)

    def commit(self, n_accepted):
        pass

    def catchup_plan(self, n_tokens, tokens=None):
        return []  # always caught up


def test_auto_drafter_switches_strategy_when_acceptance_changes():
    model = ScriptedModel()
    auto = AutoDrafter(costs(), PromptLookupDrafter(), model, probe_every=16)
    tokens = np.arange(10, 40, dtype=np.int64)  # no repeated n-gram: prompt lookup has nothing
    params, rng = SamplingParams(), np.random.default_rng(0)
    model.rows = len(tokens) - 1  # the draft has seen the prompt: no catch-up to pay
    for _ in range(30):  # the draft is always right
        prop = auto.propose(tokens, 8, params, rng)
        auto.commit(len(prop.tokens))
    assert auto.rounds.get("model", 0) >= 28
    for _ in range(60):  # the draft turns useless: rejected at once
        prop = auto.propose(tokens, 8, params, rng)
        auto.commit(0)
    assert auto.alpha["model"].alpha < 0.5 and auto.rounds.get("none", 0) > 0  # it stopped drafting
    probes, last = [], -2
    for i in range(400):  # auto-off, re-probing with a doubling gap (each probe runs PROBE_ROUNDS model rounds)
        before = auto.rounds.get("model", 0)
        auto.propose(tokens, 8, params, rng)
        auto.commit(0)
        if auto.rounds.get("model", 0) > before:
            if i > last + 1:
                probes.append(i)
            last = i
    gaps = np.diff(probes)
    assert 2 <= len(probes) <= 6 and (gaps[1:] > gaps[:-1]).all(), probes
    assert auto.rounds["none"] >= 380
    repeated = np.array([5, 6, 7, 8, 9, 5, 6, 7], dtype=np.int64)  # a match appears: lookup is free
    auto.alpha["prompt-lookup"] = Acceptance(successes=50, failures=1)
    assert len(auto.propose(repeated, 8, params, rng).tokens) > 0 and auto._last[0] == "prompt-lookup"


def test_auto_probes_the_draft_model_early_and_even_where_lookup_always_matches():
    """Code has short prompt-lookup matches everywhere. Under the same optimistic acceptance a free match always
    looked better than the draft, so every probe went to lookup and auto never learned that the draft pays there.
    A decoder's untried draft is probed after FIRST_PROBE plain rounds, for PROBE_ROUNDS rounds, and probes
    alternate between drafters."""
    model = ScriptedModel()
    c = CostModel({1: 0.036, 2: 0.039, 4: 0.045, 5: 0.047, 9: 0.070}, 0.0137)  # the specedge Qwen pair's costs
    auto = AutoDrafter(c, PromptLookupDrafter(), model, probe_every=16)
    auto.alpha["prompt-lookup"] = Acceptance(successes=1, failures=20)  # its matches keep failing
    tokens = np.array([5, 6, 7, 8, 9, 5, 6, 7, 8, 9, 5, 6], dtype=np.int64)  # lookup has a match every round
    params, rng = SamplingParams(), np.random.default_rng(0)
    model.rows = len(tokens) - 1
    kinds = []
    for _ in range(40):
        prop = auto.propose(tokens, 8, params, rng)
        kinds.append(auto._last[0])
        first_model_round = auto._last[0] == "model" and kinds.count("model") == 1
        # the draft is right (but for its first round, wholly rejected: one round is weak evidence), lookup wrong
        auto.commit(len(prop.tokens) if auto._last[0] == "model" and not first_model_round else 0)
    first = kinds.index("model")
    assert first <= AutoDrafter.FIRST_PROBE, kinds
    assert kinds[first:].count("model") >= 0.8 * len(kinds[first:]), kinds


def test_plain_rate_counts_confirmed_free_guesses():
    c = CostModel({2: 0.1, 5: 0.2})
    assert c.rate_plain() == pytest.approx(10.0)  # 1 token per width-2 step until guesses are observed
    for _ in range(100):
        c.observe_guess(1)
    assert c.rate_plain() == pytest.approx(20.0, rel=1e-3)  # every guess confirmed: 2 tokens per step


def test_catch_up_is_amortized_over_the_tokens_left_to_generate():
    """The draft's one-off catch-up (the prompt it has not seen) buys every later model round, not just the first:
    charged to one round, a draft accepted 90 % of the time would never be tried on a long request (what happened
    on the Qwen pair: auto never ran the 0.5B draft while model k=8 gave 1.27x on JSON)."""
    c = costs()
    one_round = decide(c, 0.5, 0, alpha_model=0.9, k_max=8, model_overhead=1.0)
    assert one_round.kind == "none"
    long_request = decide(c, 0.5, 0, alpha_model=0.9, k_max=8, model_overhead=1.0, horizon=400)
    assert long_request.kind == "model"
    # the amortized rate is the rate over the rest of the request: R / (overhead + R / rate without it)
    r0 = c.rate_model(0.9, long_request.k)
    assert long_request.rate == pytest.approx(400 / (1.0 + 400 / r0))
    assert decide(c, 0.5, 0, alpha_model=0.9, k_max=8, model_overhead=1.0, horizon=3).kind == "none"  # not worth it


def test_catch_up_is_priced_per_step_of_its_feed_plan():
    """A prompt goes to the draft in prefill chunks, the token a fully accepted round leaves behind in one step. A
    per-token average of the two made a 50-token prompt cost 50 single steps: auto never drafted with the model
    again after its first request (Qwen 0.5B draft on 2 cores: 11.5 ms a token priced, ~4 ms real)."""
    c = CostModel({2: 0.040, 6: 0.080}, draft=0.015, draft_widths={1: 0.011, 64: 0.190})
    assert c.catchup_time([]) == 0.0
    # a plan's last step is the round's first draw, charged to the round's draft steps already
    assert c.catchup_time([1, 1]) == pytest.approx(0.015)  # a token behind, in single steps: the running step time
    assert c.catchup_time([41]) == pytest.approx(0.190 - 0.015)  # 40 tokens and the first draw in one 64-wide chunk
    assert c.catchup_time([64, 64, 1]) == pytest.approx(0.395 - 0.015)
    for _ in range(100):
        c.observe_catchup([64, 1], 2 * 0.205)  # catch-ups run twice as long as predicted: prices follow
    assert c.catchup_time([41]) == pytest.approx(0.380 - 0.015, rel=1e-3)


def test_a_round_that_leaves_the_draft_behind_is_priced_by_the_step_it_rides_in():
    """A fully accepted round leaves the draft one token behind; the next round feeds it with its first draw in the
    cheapest step of 2+ tokens (ModelDrafter.propose). Without such a width it is one more single step."""
    narrow = CostModel({2: 0.040, 6: 0.080}, draft=0.010, draft_widths={1: 0.010, 2: 0.011, 4: 0.013, 64: 0.1})
    wide = CostModel({2: 0.040, 6: 0.080}, draft=0.010, draft_widths={1: 0.010, 64: 0.1})
    assert narrow.behind_one() == pytest.approx(0.1) and wide.behind_one() == pytest.approx(1.0)
    # k = 4 at full acceptance: 4.1 draft steps + the verify, against 5 + the verify
    assert narrow.rate_model(1.0, 4) == pytest.approx(5 / (4.1 * 0.010 + 0.080))
    assert wide.rate_model(1.0, 4) == pytest.approx(5 / (5 * 0.010 + 0.080))


def test_the_confidence_gate_starts_calibrated():
    """Its prior is the draft's own confidence: a sure draw passes a break-even of 0.6 before anything is learned,
    an unsure one does not (a flat 50 % prior dropped every draw after a round's first)."""
    g = ConfidenceGate()
    assert g.acceptance(0.97) == pytest.approx(0.95) and g.acceptance(0.03) == pytest.approx(0.05)
    assert g.acceptance(0.92) >= 0.6 > g.acceptance(0.45)


def test_what_the_draft_passed_carries_over_to_the_next_request():
    """Requests of one decoder share its CostModel: a new AutoDrafter starts from the draft acceptance the earlier
    requests measured (a short request could not learn it from the prior), the lookup estimate starts afresh."""
    c = costs()
    first = AutoDrafter(c, PromptLookupDrafter(), ScriptedModel())
    for _ in range(40):
        first.alpha["model"].update(4, 4)
        first.gate.record([0.95, 0.95], accepted=2)
    second = AutoDrafter(c, PromptLookupDrafter(), ScriptedModel())
    assert second.alpha["model"].alpha > 0.95 and second.gate.acceptance(0.95) > 0.95
    assert second.alpha["prompt-lookup"].alpha == pytest.approx(0.5)
    # ... at the weight of a few tokens: a request whose drafts fail stops believing it within a few rounds
    for _ in range(5):
        second.alpha["model"].update(4, 0)
    assert second.alpha["model"].alpha < 0.6


def test_every_request_probes_the_draft_early_whatever_the_last_one_measured():
    """A decoder's requests share the draft's acceptance at the weight of a few tokens, so a request after one whose
    drafts failed (a chat answer) starts out believing the draft does not pay. A short request where it does (a
    47-token JSON answer, model:4 1.46x plain) then ran plain to its end: the first re-probe came after probe_every
    plain rounds. Each request probes the draft after FIRST_PROBE plain rounds, then the gap doubles."""
    c = CostModel({1: 0.036, 2: 0.039, 4: 0.045, 5: 0.047, 9: 0.070}, 0.0137)  # the specedge Qwen pair's costs
    tokens = np.arange(10, 40, dtype=np.int64)  # no repeated n-gram: prompt lookup has nothing
    params, rng = SamplingParams(), np.random.default_rng(0)
    chat = AutoDrafter(c, PromptLookupDrafter(), ScriptedModel(), probe_every=16)
    for _ in range(40):  # the draft fails throughout the first request
        prop = chat.propose(tokens, 8, params, rng)
        chat.commit(0)
    assert c.model_tried and c.model_acceptance.alpha < 0.3
    model = ScriptedModel()
    json_request = AutoDrafter(c, PromptLookupDrafter(), model, probe_every=16)
    kinds, sizes = [], []
    for _ in range(AutoDrafter.COPY_TOKENS + 4):  # now the draft is right every time
        prop = json_request.propose(tokens, 8, params, rng)
        kinds.append(json_request._last[0])
        sizes += [len(prop.tokens)] if kinds[-1] == "model" else []
        json_request.commit(len(prop.tokens))
    assert "model" in kinds[: AutoDrafter.FIRST_PROBE + 1], kinds
    assert kinds[-4:] == ["model"] * 4, kinds
    # a passing probe grows: 2-token rounds cost an extra draft step per round (the bonus token the draft has not
    # seen), half again the drafting of a 4-token round, so a request that stayed in them drafted at ~1.4x the cost
    assert sizes[0] <= AutoDrafter.PROBE_K and max(sizes[:3]) >= 2 * AutoDrafter.PROBE_K, sizes


class GatedModel(ScriptedModel):
    """Drafts token 7, the first draw 95 % sure and the others at ``confidence``; asks ``keep`` after every draw as
    ModelDrafter does, and says which draw the gate dropped."""

    def propose(self, tokens, k, params, rng, keep=None, keep_last=None, branches=0):  # noqa: ANN001
        self.calls, n, self.dropped = self.calls + 1, k, None
        confs = [0.95] + [self.confidence] * (k - 1)
        for i in range(k):
            if keep is not None and not keep(confs[i]) and i > 0:
                n, self.dropped = i, (7, confs[i])
                break
        self.confidences, self.step_time = confs[:n], 0.01
        self.rows = len(tokens) - 1 + n
        return Proposal(np.full(n, 7, dtype=np.int64), None)


def test_the_gate_learns_from_the_draw_it_dropped_when_the_round_passes_whole():
    """A round the gate cut short does not verify the draw it dropped, so a confidence bin whose prior sat below
    break-even never learned (on chat the 0.5B draft's 40-70 %-sure tokens passed 67-100 % of the time, and auto
    drafted one token a round). When the round passes whole, the target's next token says whether the dropped draw
    would have passed."""
    c = CostModel({1: 0.036, 2: 0.036, 3: 0.040, 5: 0.045, 9: 0.064}, 0.012)
    model = GatedModel(confidence=0.35)  # the prior says 35 % here, below break-even
    auto = AutoDrafter(c, NoDrafter(), model)  # (the text repeats itself: no lookup, to isolate the draft model)
    auto.alpha["model"] = Acceptance(successes=90, failures=10)
    c.model_tried = True
    assert auto.gate.acceptance(0.35) < c.break_even_acceptance(8)
    tokens, params, rng = list(range(10, 40)), SamplingParams(), np.random.default_rng(0)
    lengths = []
    for _ in range(30):
        model.rows = len(tokens) - 1
        prop = auto.propose(np.array(tokens, dtype=np.int64), 8, params, rng)
        n = len(prop.tokens)
        if auto._last[0] == "model":
            lengths.append(n)
        auto.commit(n)  # every draft passes, and the target's next token is the draft's too
        tokens += [7] * (n + 1)
    assert auto.gate.acceptance(0.35) > c.break_even_acceptance(8)
    assert lengths[0] == 1 and lengths[-1] > 1, lengths


def test_auto_verifies_the_draw_that_stopped_a_round_where_its_row_is_cheap():
    """The gate's stopping draw has its draft step paid: auto proposes it when its bin's acceptance times a plain
    step beats the extra verify row (a 4-token round's fourth row), not where it would widen the step from 6 to 9."""
    c = CostModel({1: 0.033, 2: 0.034, 3: 0.036, 4: 0.039, 5: 0.041, 6: 0.047, 9: 0.062}, 0.011)
    auto = AutoDrafter(c, NoDrafter(), GatedModel(confidence=0.35))
    assert auto._worth_verifying(0.35, 3)  # 0.35 x 33 ms against 3 ms: worth it
    assert not auto._worth_verifying(0.35, 6)  # against 15 ms (width 7 runs as 9): not
    assert not auto._worth_verifying(0.02, 2)  # a draw that passes 2 % of the time: 0.7 ms against 2 ms


def test_a_stopper_that_rode_along_does_not_lower_the_drafts_priced_acceptance():
    """A round whose last token was the gate's stopping draw (proposed because its row was cheap) counts for the
    draft's acceptance as the round the gate let through: the stopper's miss is not a failure of the gated draft."""
    c = CostModel({1: 0.033, 2: 0.034, 3: 0.036, 5: 0.041, 9: 0.062}, 0.011)
    model = GatedModel(confidence=0.9)
    auto = AutoDrafter(c, NoDrafter(), model)
    auto.alpha["model"] = Acceptance(successes=9, failures=1, decay=1.0)
    auto._last = ("model", 3)
    model.last_was_stopper, model.dropped = True, None
    auto._confs = [0.95, 0.9, 0.3]
    auto.commit(2)  # the two gated drafts passed, the stopper did not
    assert (auto.alpha["model"].successes, auto.alpha["model"].failures) == (11, 1)
    model.last_was_stopper = False
    auto._last = ("model", 3)
    auto.commit(2)  # a gated draft failed: a failure
    assert (auto.alpha["model"].successes, auto.alpha["model"].failures) == (13, 2)


def test_the_drafts_catch_up_is_spread_over_the_runs_of_model_rounds_it_serves():
    """A catch-up serves the run of model rounds it starts; then auto turns to lookup or plain and the draft falls
    behind again. Spread over the whole request (the prior, 32 rounds), a model round after a few lookup rounds
    looked cheap on edit and summarize prompts (auto 0.77-0.87x fixed lookup); spread over the runs measured, it
    is priced as it is paid."""
    c = CostModel({1: 0.033, 2: 0.034, 3: 0.036, 5: 0.041, 9: 0.062}, 0.011)
    auto = AutoDrafter(c, NoDrafter(), GatedModel(confidence=0.9))
    auto.alpha["model"] = Acceptance(successes=9, failures=1)
    assert auto._streak_priced(0.1, 90, 8) == pytest.approx(0.1)  # the prior: spread over the whole request
    catchup, horizon = 0.12, 90  # 10 tokens behind, as single draft steps
    before = decide(c, 0.5, 0, 0.9, 8, model_overhead=catchup, horizon=horizon)
    c.model_streak = 2.0  # runs of two model rounds
    after = decide(c, 0.5, 0, 0.9, 8, model_overhead=auto._streak_priced(catchup, horizon, 8), horizon=horizon)
    assert before.kind == "model" and after.kind == "none", (before, after)
    # the run length is learned from the rounds: a run of 3 model rounds ending moves the estimate towards 3
    c.draft, c.model_streak = None, 32.0  # (no draft price: the round is plain)
    auto._streak = 3
    auto.propose(np.arange(10, 40, dtype=np.int64), 8, SamplingParams(), np.random.default_rng(0))
    assert c.model_streak == pytest.approx(0.7 * 32 + 0.3 * 3) and auto._streak == 0


@pytest.mark.parametrize("gaps,kind", [((40, 4), "model"), ((6, 4), "none"), ((0, 0), "model")])
def test_a_copying_requests_gap_is_decided_by_how_long_its_gaps_last(gaps, kind):
    """In a gap of a copying request (lookup has no match now; its proposals matched most of the text) the gaps it
    has had say how soon lookup takes over again: ~2 tokens through summarize-2, where a draft-model round
    (predicted 46-58 tok/s, run at 43-45 with its catch-up) cost auto 0.76-0.85x fixed lookup; 10 through an
    edit writing new lines, where model rounds pay. Before its first gap has ended, the fastest option."""
    c = CostModel({1: 0.033, 2: 0.034, 3: 0.036, 5: 0.041, 9: 0.062}, 0.006)
    c.model_tried = True
    c.model_acceptance = Acceptance(successes=95, failures=5)
    auto = AutoDrafter(c, PromptLookupDrafter(ngram_max=3, ngram_min=2), ScriptedModel())
    now = [100.0]
    auto.clock = lambda: now[0]
    tokens = np.arange(10, 100, dtype=np.int64)  # its last tokens match nothing: a gap
    auto._start, auto._t_first, auto._copied = 30, now[0] - 0.3, 50  # 60 tokens at 200 tok/s, 50 matched by lookup
    auto._gaps = gaps  # (tokens, count) of the gaps ended so far
    auto.propose(tokens, 8, SamplingParams(max_new_tokens=200), np.random.default_rng(0))
    assert auto._last[0] == kind
    assert auto._gap_from == len(tokens)  # a gap began


def test_a_gap_between_lookup_matches_ends_where_lookup_would_have_matched_again():
    """Measured to the end of the round that closed it, a model round's 3-4 tokens made summarize-2's gaps look 4.5
    tokens long (they are ~2): the gap ends at the first position where lookup has a match."""
    auto = AutoDrafter(costs(), PromptLookupDrafter(ngram_max=3, ngram_min=2), None)
    params, rng = SamplingParams(), np.random.default_rng(0)
    text = list(range(10, 30))  # nothing repeats: no match
    auto._gap(np.array(text), False, params, rng)
    text += [40, 41, 10, 11, 12, 13]  # a round of 6 tokens: lookup matches again after "10 11", 4 tokens in
    auto._gap(np.array(text), True, params, rng)
    assert auto._gaps == (4, 1) and auto._gap_from is None
    text += [50]
    auto._gap(np.array(text), False, params, rng)  # a gap begins ...
    text += [51, 52]
    auto._gap(np.array(text), False, params, rng)
    text += [10, 11]
    auto._gap(np.array(text), True, params, rng)  # ... and ends at the round's end: 4 tokens
    assert auto._gaps == (8, 2)


class BehindModel(ScriptedModel):
    """A draft that has not seen this request's prompt: its first round catches up on ``behind`` tokens."""

    def __init__(self, behind: int):
        super().__init__()
        self.behind = behind

    def catchup_plan(self, n_tokens, tokens=None):
        return [self.behind + 1] if self.behind else []  # with the first draw (ModelDrafter.catchup_plan)

    def propose(self, tokens, k, params, rng, keep=None, keep_last=None, branches=0):  # noqa: ANN001
        self.behind = 0
        return super().propose(tokens, k, params, rng, keep=keep, keep_last=keep_last)


@pytest.mark.parametrize("behind", [0, 40])
def test_catching_the_draft_up_on_a_prompt_needs_a_wider_margin(behind):
    """A model round predicted 7 % faster than plain is taken where the draft holds the prompt (MODEL_MARGIN), not
    where it would first catch up on it (PROMPT_MARGIN): that is an investment made before the request has shown
    whether lookup will serve it (the first edit after code prompts paid it in its first round, lookup then running
    at twice the model's rate)."""
    from specedge.runtime.policy import MODEL_MARGIN, PROMPT_MARGIN

    assert MODEL_MARGIN < 1.07 < PROMPT_MARGIN
    c = CostModel({1: 0.033, 2: 0.034, 3: 0.036, 5: 0.041, 9: 0.062}, 0.011, draft_widths={1: 0.011, 64: 0.011})
    c.model_tried, c.model_acceptance = True, Acceptance(successes=95, failures=5)
    auto = AutoDrafter(c, NoDrafter(), BehindModel(behind=behind))
    params = SamplingParams(max_new_tokens=4096)  # the catch-up (one draft step's worth) spread to nothing
    tokens = np.arange(10, 80, dtype=np.int64)
    for c.draft in np.linspace(0.002, 0.03, 400):  # a draft step that puts the model ~7 % ahead of plain
        if 1.06 < decide(c, 0.5, 0, c.model_acceptance.alpha, 8, margin=1.0).rate / c.rate_plain() < 1.08:
            break
    else:
        pytest.fail("no draft step time puts the model 6-8 % ahead of plain")
    auto.propose(tokens, 8, params, np.random.default_rng(0))
    assert auto._last[0] == ("model" if behind == 0 else "none")


@pytest.mark.parametrize("behind", [0, 40])
def test_a_probe_that_would_catch_the_draft_up_on_the_prompt_needs_the_wider_margin_too(behind):
    """The same for a re-probe, priced at its optimistic acceptance: at MODEL_MARGIN, short chat answers pay a
    ~150 ms prompt catch-up for a probe near their end and run slower than plain."""
    from specedge.runtime.policy import MODEL_MARGIN, PROMPT_MARGIN

    c = CostModel({1: 0.033, 2: 0.034, 3: 0.036, 5: 0.041, 9: 0.062}, 0.011, draft_widths={1: 0.011, 64: 0.011})
    c.model_tried, c.model_acceptance = True, Acceptance(successes=30, failures=70)  # no round pays: plain
    auto = AutoDrafter(c, NoDrafter(), BehindModel(behind=behind))
    hope = AutoDrafter.OPTIMISTIC_ALPHA
    for c.draft in np.linspace(0.002, 0.03, 400):  # a draft step that puts a hoped-for round ~7 % ahead of plain
        if 1.06 < decide(c, hope, 0, hope, 8, margin=1.0).rate / c.rate_plain() < 1.08:
            break
    else:
        pytest.fail("no draft step time puts the model 6-8 % ahead of plain")
    assert MODEL_MARGIN < 1.06 and PROMPT_MARGIN > 1.08
    auto._plain_streak = auto._probe_gap - 1  # this round re-probes
    auto.propose(np.arange(10, 80, dtype=np.int64), 8, SamplingParams(max_new_tokens=4096), np.random.default_rng(0))
    assert auto._last[0] == ("model" if behind == 0 else "none") and auto._probing == (behind == 0)

@pytest.mark.parametrize("copying", [False, True])
def test_short_model_runs_of_copying_requests_do_not_price_the_draft_out_of_others(copying):
    """The catch-up is priced over the run of model rounds it serves, as long as runs have lasted (learned across
    requests). Copy-heavy requests run ~2 model rounds between lookup rounds; spread over that, a new JSON or code
    request's prompt catch-up priced every model round out, and its probes too: whole JSON and code requests ran
    plain after a few edits (26-39 tok/s where the draft runs 40-45). Runs are short where lookup rounds cut
    them: a request whose lookup has had a match in few of its rounds spreads the catch-up over the request; one
    that copies keeps the learned runs."""
    # the catch-up: a 64-wide step less the first draw's single step, 0.10 s
    c = CostModel({1: 0.033, 2: 0.034, 3: 0.036, 5: 0.041, 9: 0.062}, 0.011, draft_widths={1: 0.011, 64: 0.111})
    c.model_tried, c.model_streak = True, 2.0
    c.model_acceptance = Acceptance(successes=95, failures=5)
    auto = AutoDrafter(c, PromptLookupDrafter(ngram_max=3, ngram_min=2), BehindModel(behind=50))
    auto.UNSURE_SHARE = 0.0  # its first COPY_TOKENS priced as a copying request's (the test after this one: how not)
    # a text without repeats (no lookup match) or one that repeats itself throughout (a match every round)
    text = list(np.tile(np.arange(10, 22), 5)) if copying else list(range(10, 70))
    params, rng = SamplingParams(max_new_tokens=512), np.random.default_rng(0)
    kinds = []
    for _ in range(AutoDrafter.COPY_TOKENS + 4):
        prop = auto.propose(np.array(text, dtype=np.int64), 8, params, rng)
        kinds.append(auto._last[0])
        auto.commit(len(prop.tokens))  # everything passes
        text += list(prop.tokens)
        text.append(text[-12] if copying else text[-1] + 1)  # the period goes on (the tokens passed are its own)
    if copying:  # the learned runs: the prompt's catch-up spread over 2 rounds does not pay, lookup does ...
        assert "model" not in kinds and "prompt-lookup" in kinds, kinds
        assert len(text) - auto._start >= AutoDrafter.COPY_TOKENS  # (it has shown that it copies)
        text += [999, 998]  # ... nor in a gap, where lookup has no match
        auto.propose(np.array(text, dtype=np.int64), 8, params, rng)
        assert auto._last[0] == "none"
    else:  # after its first rounds (which may not match in a copying request either), the draft
        assert "model" in kinds, kinds


class PeriodicModel(ScriptedModel):
    """A draft that knows the periodic text: it proposes the true continuation, 90 % sure."""

    def __init__(self, period: list[int]):
        super().__init__()
        self.period = period

    def propose(self, tokens, k, params, rng, keep=None, keep_last=None, branches=0):  # noqa: ANN001
        self.calls += 1
        n = len(tokens)
        self.confidences, self.step_time = [0.9] * k, 0.006
        self.rows = n - 1 + k
        return Proposal(np.array([self.period[(n + i) % len(self.period)] for i in range(k)], dtype=np.int64), None)


def test_the_lookups_acceptance_is_learned_from_the_rounds_it_did_not_run():
    """Prompt lookup costs nothing to ask, so every round can tell what it would have proposed and, once the round
    commits, how much of it the target took. Learned only from its own rounds, a lookup that started at its 50 %
    prior behind a good draft model was never chosen, so never corrected (summaries whose lookup rounds run 70-90
    tok/s ran model rounds at 35-39 for whole requests); it also measures how much of a request's text lookup
    matches (``_copying``)."""
    period = list(range(100, 112))
    c = CostModel({1: 0.033, 2: 0.034, 3: 0.036, 5: 0.041, 9: 0.062}, 0.006)  # a cheap draft: model rounds first
    c.model_tried = True
    c.model_acceptance = Acceptance(successes=95, failures=5)
    auto = AutoDrafter(c, PromptLookupDrafter(ngram_max=3, ngram_min=2), PeriodicModel(period))
    tokens, params, rng = period * 2, SamplingParams(max_new_tokens=256), np.random.default_rng(0)
    kinds = []
    for _ in range(12):
        prop = auto.propose(np.array(tokens, dtype=np.int64), 8, params, rng)
        kinds.append(auto._last[0])
        truth = [period[(len(tokens) + i) % len(period)] for i in range(len(prop.tokens) + 1)]
        m = next((i for i, (a, b) in enumerate(zip(prop.tokens, truth)) if a != b), len(prop.tokens))
        auto.commit(m)
        tokens += truth[: m + 1]
    assert kinds[0] == "model" and "prompt-lookup" in kinds[:6], kinds
    assert auto.alpha["prompt-lookup"].alpha > 0.8
    assert auto._copied > 0.8 * (len(tokens) - 2 * len(period))  # the text is all copies


def test_a_probe_ends_where_the_estimate_picks_prompt_lookup():
    """A probe whose drafts all pass goes on (each round longer), so that a good draft is learned against what
    earlier requests carried over. It stops where the estimate chooses prompt lookup: run on, an edit whose draft
    passes every probe round runs the draft model to its end where lookup runs at 2.09x plain against the model's
    1.50x."""
    model = ScriptedModel()
    auto = AutoDrafter(costs(), PromptLookupDrafter(ngram_max=3, ngram_min=2), model)
    auto.alpha["prompt-lookup"] = Acceptance(successes=50, failures=1)  # lookup's matches pass
    params, rng = SamplingParams(), np.random.default_rng(0)
    tokens = np.array([5, 6, 7, 8, 9, 5, 6, 7], dtype=np.int64)  # lookup has a match
    model.rows = len(tokens) - 1
    auto._probe_left, auto._probe_k = 1, 8  # a probe going on
    assert decide(auto.costs, auto.alpha["prompt-lookup"].alpha, 3, auto.alpha["model"].alpha, 8).kind \
        == "prompt-lookup"
    auto.propose(tokens, 8, params, rng)
    assert auto._last[0] == "prompt-lookup" and auto._probe_left == 0


def test_until_a_request_shows_whether_it_copies_its_catch_up_is_not_priced_over_short_runs():
    """A request is taken to copy until COPY_TOKENS are committed, and a copying request's catch-up is priced over
    the runs of model rounds learned. A summary whose model rounds alternate with lookup rounds leaves runs of ~2
    rounds, which would keep the JSON answers after it plain for their first 24 tokens. Until the request shows
    whether it copies, a run is taken to last at least UNSURE_SHARE of it."""
    c = CostModel({1: 0.033, 2: 0.034, 3: 0.036, 5: 0.041, 9: 0.062}, 0.011, draft_widths={1: 0.011, 64: 0.111})
    c.model_tried, c.model_streak = True, 2.0
    c.model_acceptance = Acceptance(successes=95, failures=5)
    auto = AutoDrafter(c, PromptLookupDrafter(ngram_max=3, ngram_min=2), BehindModel(behind=50))
    assert auto._streak_priced(0.1, 90, 8, sure=False) == pytest.approx(0.1 / AutoDrafter.UNSURE_SHARE)
    assert auto._streak_priced(0.1, 90, 8) > 0.1 / AutoDrafter.UNSURE_SHARE  # the learned runs, once it is known
    text = list(range(10, 70))  # no repeats: nothing for lookup
    auto.propose(np.array(text, dtype=np.int64), 8, SamplingParams(max_new_tokens=96), np.random.default_rng(0))
    assert auto._last[0] == "model"



@pytest.mark.parametrize("sure, copied, drafts", [(None, 0, False), ((8, 8), 0, True), ((6, 8), 0, True),
                                                  ((4, 8), 0, False), ((8, 8), 3, False)])
def test_a_request_the_target_is_sure_of_and_lookup_does_not_serve_prices_its_catch_up_over_itself(sure, copied,
                                                                                                  drafts):
    """Until a request shows whether it copies, its catch-up is spread over UNSURE_SHARE of it at least; where its
    lookup has matched nothing and the target is sure of most of its tokens, over that share. Otherwise a JSON
    answer after a chat answer whose runs lookup had cut to ~2 rounds prices its long prompt's catch-up over a fifth
    of itself and, where the draft's prefill is slow, runs most of its rounds plain."""
    c = CostModel({1: 0.033, 2: 0.034, 3: 0.036, 5: 0.041, 9: 0.062}, 0.011, draft_widths={1: 0.011, 64: 0.3})
    c.model_tried, c.model_streak = True, 2.0
    c.model_acceptance = Acceptance(successes=95, failures=5)
    auto = AutoDrafter(c, PromptLookupDrafter(ngram_max=3, ngram_min=2), BehindModel(behind=63))
    if sure is not None:
        auto._sure = list(sure)
    auto._copied = copied
    expect = AutoDrafter.UNSURE_SHARE if sure is None or copied else max(AutoDrafter.UNSURE_SHARE, sure[0] / sure[1])
    assert auto._unsure_share() == pytest.approx(expect)
    assert auto._streak_priced(0.1, 90, 8, sure=False) == pytest.approx(0.1 / expect)
    text = np.arange(10, 70, dtype=np.int64)  # no repeats: nothing for lookup
    auto.propose(text, 8, SamplingParams(max_new_tokens=96), np.random.default_rng(0))
    assert (auto._last[0] == "model") == drafts, auto._last

def test_the_target_split_learns_how_often_the_draft_passes_where_the_target_is_sure_and_where_not():
    split = TargetSplit()
    assert split.predict(1.0) == pytest.approx(0.95) and split.predict(0.0) == pytest.approx(0.65)  # the prior
    for _ in range(200):
        split.record([0.99, 0.97, 0.5, 0.99], accepted=2)  # the sure rows' drafts passed, the unsure one failed
        split.record([0.4], accepted=1)  # ... an unsure one passed (a round's rows are its drafts': no bonus row)
    lo, hi = split.agreed / split.seen
    assert hi > 0.98 and lo == pytest.approx(0.5, abs=0.02)
    assert split.predict(0.5) == pytest.approx((hi + lo) / 2)


QWEN = {1: 0.036, 2: 0.039, 4: 0.045, 5: 0.047, 9: 0.070}  # the specedge Qwen pair's step costs


def run_request(auto: AutoDrafter, rounds: int, sure: float, passes: bool) -> list[tuple[str, int]]:
    """Rounds of a request with no repeated n-gram, the decoder's way: propose, commit (the draft's tokens all pass
    or all fail), then the committed rows' target confidences (``sure`` each) while the drafter asks for them."""
    tokens = np.arange(10, 40, dtype=np.int64)
    params, rng = SamplingParams(max_new_tokens=200), np.random.default_rng(0)
    kinds = []
    for _ in range(rounds):
        prop = auto.propose(tokens, 8, params, rng)
        kinds.append((auto._last[0], len(prop.tokens)))
        m = len(prop.tokens) if passes else 0
        auto.commit(m)
        if auto.wants_confidence():
            auto.observe_confidence([sure] * (m + 1))
    return kinds


def test_a_request_the_target_is_sure_of_drafts_in_full_whatever_the_last_ones_carried(monkeypatch):
    """The draft's acceptance carries over from request to request. After chat answers, whose drafts failed, a JSON
    answer started believing the draft does not pay: plain rounds, then short probes, where model:4 ran 1.4-1.8x
    plain. Where the target is sure of most tokens the draft mostly agrees with it, so until its own draft rounds
    speak, the request's prior is what its target's confidence predicts (``TargetSplit``)."""
    c = CostModel(dict(QWEN), 0.0137)
    chat = AutoDrafter(c, PromptLookupDrafter(), ScriptedModel(confidence=0.4))  # the draft is unsure there too
    run_request(chat, 40, sure=0.5, passes=False)
    assert c.model_tried and c.model_acceptance.alpha < 0.3
    monkeypatch.setattr(AutoDrafter, "FIRST_PROBE", 2 * AutoDrafter.CONF_TOKENS)  # no probe in the way
    json_answer = AutoDrafter(c, PromptLookupDrafter(), ScriptedModel())
    kinds = run_request(json_answer, 12, sure=0.99, passes=True)
    first = next(i for i, (kind, _) in enumerate(kinds) if kind == "model")
    assert first == AutoDrafter.CONF_TOKENS and kinds[first][1] > AutoDrafter.PROBE_K, kinds  # drafting, not a probe


def test_a_request_the_target_is_unsure_of_does_not_draft_on_what_the_last_ones_carried():
    """The converse: after JSON answers (the draft passed), a summary copies its first sentence from the prompt
    (prompt lookup) and then writes its own, where the target is unsure. The carried acceptance would run the draft
    there; the target's confidence says it will not pay."""
    c = CostModel(dict(QWEN), 0.0137)
    run_request(AutoDrafter(c, PromptLookupDrafter(), ScriptedModel()), 40, sure=0.99, passes=True)  # JSON
    assert c.model_acceptance.alpha > 0.9
    summary = AutoDrafter(c, PromptLookupDrafter(ngram_max=3, ngram_min=2), ScriptedModel())
    summary.alpha["prompt-lookup"] = Acceptance(successes=50, failures=1)
    params, rng = SamplingParams(max_new_tokens=200), np.random.default_rng(0)
    copying = np.array([5, 6, 7, 8, 9, 5, 6, 7], dtype=np.int64)  # lookup has a match
    kinds = []
    for tokens in [copying] * 3 + [np.arange(10, 40, dtype=np.int64)] * 6:  # then no match
        prop = summary.propose(tokens, 8, params, rng)
        kinds.append((summary._last[0], len(prop.tokens)))
        m = len(prop.tokens) if kinds[-1][0] == "prompt-lookup" else 0
        summary.commit(m)
        summary.observe_confidence([0.3] * (m + 1))
    assert kinds[:3] == [("prompt-lookup", 4)] * 3, kinds
    # at most one short round where the gap's pace tempts it (carried, the draft ran 21 tokens in 5 rounds here)
    assert sum(n for kind, n in kinds[3:] if kind == "model") <= 3 and kinds[-4:] == [("none", 0)] * 4, kinds


def test_a_draft_rounds_rows_teach_the_split_what_its_drafts_did():
    c = CostModel(dict(QWEN), 0.0137)
    c.model_tried, c.model_acceptance = True, Acceptance(successes=95, failures=5)
    auto = AutoDrafter(c, PromptLookupDrafter(), ScriptedModel())
    tokens, params, rng = np.arange(10, 40, dtype=np.int64), SamplingParams(max_new_tokens=200), np.random.default_rng()
    split = c.target_split
    for commit, confs, seen, agreed in [(4, [0.99] * 5, [0, 4], [0, 4]),  # all passed: row 4 is the target's own
                                        (1, [0.99, 0.5], [1, 1], [0, 1])]:  # the second draft failed, the target unsure
        before = split.seen.copy(), split.agreed.copy()
        auto.propose(tokens, 4, params, rng)
        assert auto._last == ("model", 4)
        auto.commit(commit)
        auto.observe_confidence(confs)
        np.testing.assert_allclose(split.seen - before[0], seen)
        np.testing.assert_allclose(split.agreed - before[1], agreed)


def test_target_confidences_are_asked_for_in_a_requests_first_tokens_only_and_teach_the_split():
    c = CostModel(dict(QWEN), 0.0137)
    auto = AutoDrafter(c, PromptLookupDrafter(), ScriptedModel())
    seen = c.target_split.seen.copy()
    kinds = run_request(auto, 60, sure=0.99, passes=True)
    assert not auto.wants_confidence() and AutoDrafter.CONF_WINDOW <= auto._sure[1] < AutoDrafter.CONF_WINDOW + 9
    drafted = sum(n for kind, n in kinds if kind == "model")
    assert drafted > AutoDrafter.CONF_WINDOW  # the request drafted past its window: ...
    assert 0 < (c.target_split.seen - seen)[1] < AutoDrafter.CONF_WINDOW  # ... its split learned inside it only
    assert not AutoDrafter(c, PromptLookupDrafter(), None).wants_confidence()  # no draft model: nothing to predict


class BranchingModel(ScriptedModel):
    """Drafts token 7 at a middling confidence and notes runner-up 9 at depth 1 (ModelDrafter's ``branches``)."""

    def propose(self, tokens, k, params, rng, keep=None, keep_last=None, branches=0):  # noqa: ANN001
        prop = super().propose(tokens, k, params, rng, keep, keep_last)
        self.branches = [Branch(1, 9, 0.4)] if branches and len(prop.tokens) > 1 else []
        return prop


def test_auto_adds_a_branch_while_it_pays_and_stops_when_branches_never_hit():
    model = BranchingModel(confidence=0.5)
    # two more rows cost little (3 -> 5 rows: +4 %): at the prior odds a branch pays
    auto = AutoDrafter(CostModel({1: 0.100, 3: 0.120, 5: 0.125, 9: 0.200}, 0.01), PromptLookupDrafter(), model)
    tokens = np.arange(10, 40, dtype=np.int64)
    params, rng = SamplingParams(), np.random.default_rng(0)
    model.rows = len(tokens) - 1
    auto.tree = 2
    first = None
    for _ in range(40):
        prop = auto.propose(tokens, 8, params, rng)
        first = prop if first is None else first
        if prop.parents is None:
            break
        assert 9 in prop.tokens.tolist() and prop.parents[prop.tokens.tolist().index(9)] == 0
        auto.commit(1)
        auto.observe_next(1, 8)  # the spine failed at depth 1 and its sibling, the branch, was no better
    assert first is not None and first.parents is not None
    assert prop.parents is None and len(prop.tokens) > 1  # still drafting, no longer branching
    assert auto.costs.branch_odds.odds(0.4) < BranchOdds.PRIOR
    for _ in range(10):  # chain rounds where the runner-up was the target's token: the odds learn it, trees return
        auto.commit(1)
        auto.observe_next(1, 9)
        prop = auto.propose(tokens, 8, params, rng)
    assert prop.parents is not None
    auto.tree = 0
    assert auto.propose(tokens, 8, params, rng).parents is None


@pytest.mark.parametrize("slow", [False, True])
def test_a_drafter_whose_rounds_run_below_plain_on_the_wall_clock_is_set_aside(slow):
    """The estimates say the draft pays (cheap steps, every draft accepted), but the decoder times each round whole:
    where the model rounds really commit fewer tokens per second than plain rounds run at (a wide step dearer than
    its timing, host work the model leaves out), auto goes plain after GUARD_ROUNDS of them and stays there but for
    its re-probes; where they run as predicted it drafts on."""
    c = costs()
    c.model_tried = True
    c.model_acceptance = Acceptance(successes=95, failures=5)
    model = ScriptedModel()
    auto = AutoDrafter(c, PromptLookupDrafter(), model, probe_every=16)
    tokens = np.arange(10, 40, dtype=np.int64)  # lookup has nothing
    params, rng = SamplingParams(max_new_tokens=10_000), np.random.default_rng(0)
    c.observe_plain_round(0.1, 1)  # plain rounds: 10 tok/s
    kinds = []
    for _ in range(60):
        prop = auto.propose(tokens, 8, params, rng)
        kind = auto._last[0]
        kinds.append(kind)
        n = len(prop.tokens)
        auto.commit(n)
        # a model round of n drafts committed n + 1 tokens in 0.25 s (predicted ~0.28 s): 36 tok/s; slow, 2.5 s: 3.6
        auto.observe_round((2.5 if slow else 0.25) if kind == "model" else 0.1, n + 1 if kind == "model" else 1)
    model_rounds = kinds.count("model")
    if slow:
        assert kinds[:AutoDrafter.GUARD_ROUNDS] == ["model"] * AutoDrafter.GUARD_ROUNDS
        assert auto.losing("model") and model_rounds <= AutoDrafter.GUARD_ROUNDS + 6, "".join(k[0] for k in kinds)
    else:
        assert model_rounds == 60 and not auto.losing("model")


def test_the_guard_leaves_a_drafts_catch_up_out_of_its_rounds_pace_and_hybrid_alone():
    """A round's catch-up (the draft feeding a prompt) is an investment its plan prices, not the pace of the round:
    it is left out. And hybrid, which never decodes plainly while it has a drafter, is not barred."""
    c = costs()
    auto = AutoDrafter(c, PromptLookupDrafter(), ScriptedModel())
    c.observe_plain_round(0.1, 1)
    auto._last = ("model", 4)
    for _ in range(AutoDrafter.GUARD_ROUNDS):
        auto._round_catchup = 2.0  # 2 s of catch-up in a 2.2 s round that committed 5 tokens
        auto.observe_round(2.2, 5)
    assert not auto.losing("model")  # 5 tokens in 0.2 s of the round's own work
    hybrid = AutoDrafter(c, PromptLookupDrafter(), ScriptedModel(), mode="hybrid")
    hybrid._paced["model"] = (10.0, 1.0, 5)  # far below plain
    tokens = np.arange(10, 40, dtype=np.int64)
    hybrid.propose(tokens, 8, SamplingParams(), np.random.default_rng(0))
    assert hybrid._last[0] == "model"


def test_cost_model_prices_a_step_at_its_own_context():
    """A step's attention grows with the context it reads, and the widths grow apart with it: the cost model adds
    each width's seconds per position (timed for some widths, linear in the width between them) over the context the
    steps were timed at, for the target and the draft alike; a step observed as predicted at its depth moves neither
    the machine's speed nor the width's shape."""
    c = CostModel({1: 0.030, 3: 0.040, 9: 0.080}, 0.012, base_depth=128, target_slope={1: 2e-6, 9: 18e-6},
                  draft_slope=1e-6)
    assert c.verify_time(1, 128) == pytest.approx(0.030)
    assert c.verify_time(1, 4128) == pytest.approx(0.030 + 4000 * 2e-6)
    assert c.verify_time(3, 4128) == pytest.approx(0.040 + 4000 * 6e-6)  # 2e-6 + 16e-6 * 2 / 8 per position
    assert c.verify_time(2, 4128) == c.verify_time(3, 4128)  # two tokens run in the 3-row step
    assert c.verify_time(1, 0) == pytest.approx(0.030 - 128 * 2e-6)
    assert c.draft_time() == pytest.approx(0.012 - 128 * 1e-6)  # depth 0 until the decoder sets it
    c.depth = 8128
    assert c.draft_time() == pytest.approx(0.012 + 8000 * 1e-6) and c.verify_time(9) == pytest.approx(0.080 + 0.144)
    # deep in a context the verify rows cost more against a plain step: a lookup round of 2 pays less there
    shallow = CostModel(dict(c.target), 0.012)
    assert c.rate_lookup(0.5, 2) / c.rate_plain() < 0.95 * shallow.rate_lookup(0.5, 2) / shallow.rate_plain()
    before = dict(c.target)
    c.observe_target(3, c.verify_time(3, 2128), depth=2128)
    c.observe_draft(c.draft_time())
    assert c.speed == pytest.approx(1.0) and c.target == pytest.approx(before) and c.draft == pytest.approx(0.012)
    c.observe_target(9, 2 * c.verify_time(9))  # the machine slows down: every width and depth with it
    assert c.speed > 1.0 and c.verify_time(1, 128) == pytest.approx(0.030 * c.speed)
    flat = CostModel({1: 0.030, 5: 0.050})  # no slopes timed (a short S_max): the timed costs at every depth
    assert flat.verify_time(5, 30000) == pytest.approx(0.050)
    one = CostModel({1: 0.030, 5: 0.050}, base_depth=100, target_slope={1: 1e-6})  # one width timed: per row
    assert one.verify_time(5, 1100) == pytest.approx(0.050 + 1000 * 5e-6)
    assert CostModel({1: 0.030}, base_depth=1000, target_slope={1: 1e-4}).verify_time(1, 0) == pytest.approx(0.015)
