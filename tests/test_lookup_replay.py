"""tools/dev/lookup_replay.py: the replay follows the decoder's round rules, and its bound is a bound."""

from __future__ import annotations

import numpy as np
import pytest

from specedge.runtime.adaptive import AutoDrafter
from specedge.runtime.drafters import NoDrafter, PromptLookupDrafter

from .tools_loader import load_tool

STEPS = {2: 0.040, 4: 0.060, 6: 0.080, 10: 0.115}  # an int4-like CPU target: plain rounds at width 2
K = 9


def load():
    return load_tool("lookup_replay")


def sequences():
    rng = np.random.default_rng(3)
    fresh = rng.permutation(1000)[:120].tolist()  # no token repeats: nothing to look up, no guess passes
    text = rng.permutation(500)[:60].tolist()
    copy = text + [999] + text[:50] + list(range(500, 530))  # a copy of the context, then new text
    return {"fresh": (fresh, 20), "copy": (copy, 61)}


def test_plain_replay_is_one_width_2_step_per_token_without_repeats():
    lr = load()
    seq, P = sequences()["fresh"]
    t, rounds = lr.replay(lambda c: NoDrafter(), seq, P, STEPS, K, 3)
    assert rounds == len(seq) - P - 1 and t == pytest.approx(rounds * STEPS[2])


def test_lookup_replay_commits_a_copied_span_in_few_rounds():
    lr = load()
    seq, P = sequences()["copy"]
    t_plain, r_plain = lr.replay(lambda c: NoDrafter(), seq, P, STEPS, K, 3)
    t_look, r_look = lr.replay(lambda c: lr._Fixed(PromptLookupDrafter(3, 2), 8), seq, P, STEPS, K, 3)
    assert r_look < 0.7 * r_plain and t_look < 0.9 * t_plain  # 9 tokens a round through the copy, 2 in plain


@pytest.mark.parametrize("width_1", [False, True])
@pytest.mark.parametrize("name", ["fresh", "copy"])
def test_bound_is_no_slower_than_any_replayed_lookup_policy(name, width_1):
    """Also where the target has a width-1 step (plain rounds there, no guess): a bound that priced plain rounds at
    width 2 sat above auto's replay on such a bundle."""
    lr = load()
    seq, P = sequences()[name]
    steps = {1: 0.030, **STEPS} if width_1 else STEPS
    best = lr.bound(seq, P, steps, K, 3, 2)
    policies = [lambda c: NoDrafter(), lambda c: AutoDrafter(c, PromptLookupDrafter(3, 2), None)]
    policies += [(lambda k: lambda c: lr._Fixed(PromptLookupDrafter(3, 2), k))(k) for k in (2, 4, 8)]
    times = [lr.replay(p, seq, P, steps, K, 3)[0] for p in policies]
    assert best <= min(times) + 1e-12
    if name == "fresh":  # nothing to gain: the bound is plain decoding
        assert best == pytest.approx(times[0])
    else:
        assert best < 0.85 * times[0]


def test_bound_on_a_sequence_worked_by_hand():
    """Prompt 10..17 99, the prefill gives 10; output 11 12 13 14 15 50 51 52. Plain rounds (width 2) cost 1,
    widths 3-4 1.5, 5-6 2. n=10: the guess 11 passes (1 -> n=12). n=12 (... 10 11 12): lookup proposes 13..17, 3
    pass: 3 tokens at width 4 (1.5 -> n=16) beat plain rounds whose guesses pass (13, then 15: 2 -> n=16).
    n=16, 17: new tokens, plain (2). Best 1 + 1.5 + 2 = 4.5; plain 5; a bound that assumed drafts pass: 3."""
    lr = load()
    seq = [10, 11, 12, 13, 14, 15, 16, 17, 99, 10, 11, 12, 13, 14, 15, 50, 51, 52]
    steps = {2: 1.0, 4: 1.5, 6: 2.0, 10: 3.0}
    assert lr.bound(seq, 9, steps, K, 3, 2) == pytest.approx(4.5)
    assert lr.replay(lambda c: NoDrafter(), seq, 9, steps, K, 3) == (pytest.approx(5.0), 5)


DRAFT = {1: 0.010, 2: 0.011, 4: 0.012, 64: 0.050}  # a draft model's step times by width (the prompt fits a chunk)


def replay_model(lr, seq, P, right=True, warm=False):
    """A recorded draft that proposes the text itself (right) or a token the text never has, 90 % sure."""
    nxt = [seq[n] if right else 5000 for n in range(P + 1, len(seq))]
    return lr.ReplayModel(nxt, [0.9] * len(nxt), P, DRAFT, 64, warm=warm)


@pytest.mark.parametrize("warm", [False, True])
def test_a_replayed_draft_pays_its_catch_up_and_its_draft_steps(warm):
    """model:4 through 24 new tokens of a draft that is always right: rounds of 5 tokens. A cold draft's first round
    catches up on the prompt with its first draw (one 64-wide step, the prompt fits), then 3 single steps; later
    rounds leave the draft one token behind (its last draw, never fed), caught up with the next first draw in a
    2-wide step; each verify runs at width 6 (the smallest that holds 5 tokens)."""
    lr = load()
    seq, P = sequences()["fresh"][0][:45], 20
    model = replay_model(lr, seq, P, warm=warm)
    t, rounds = lr.replay(lambda c: lr._FixedModel(model, 4), seq, P, STEPS, K, 3, model=model)
    assert rounds == 5  # 24 tokens: 5 + 5 + 5 + 5 + 4 (the last round drafts 3: the text ends)
    first = DRAFT[1] if warm else DRAFT[64]  # the first draw: alone (warm) or with the prompt's catch-up
    drafting = first + 3 * DRAFT[1] + 3 * (DRAFT[2] + 3 * DRAFT[1]) + DRAFT[2] + 2 * DRAFT[1]
    assert t == pytest.approx(4 * STEPS[6] + STEPS[4] + drafting)
    assert model.spent == pytest.approx(drafting)


def test_a_replayed_catch_up_takes_the_steps_the_decoders_draft_takes(decoders, monkeypatch):
    """A replayed draft catches up in the steps the decoder's own draft runs (``ModelDrafter.catchup_plan``: full
    chunks, then the cheapest steps its measured prices give), so a replay prices what a run pays. With the widest
    step dearer per token than smaller ones, some remainders split into several steps."""
    lr = load()
    drafter = decoders["model"].make_drafter("model")
    widths = sorted(w.T for w in drafter.runner.entry.widths)
    prices = {T: 0.010 + 0.004 * T for T in widths}
    prices[widths[-1]] *= 1.5
    monkeypatch.setattr(drafter.clock, "seconds", dict(prices))
    model = lr.ReplayModel([], [], 0, prices, drafter.prefill_chunk)
    ns = range(2, 2 * drafter.prefill_chunk + 6)
    plans = [model.catchup_plan(n) for n in ns]
    assert plans == [drafter.catchup_plan(n) for n in ns]
    assert any(len(p) > 1 and sum(p) <= drafter.prefill_chunk for p in plans)
    assert all(sum(p) == n for p, n in zip(plans, ns))


def test_replayed_auto_drafts_with_a_draft_that_is_right_and_not_with_one_that_is_not():
    lr = load()
    seq, P = sequences()["fresh"]
    times = {}
    for right in (True, False):
        model = replay_model(lr, seq, P, right=right, warm=True)
        times[right] = lr.replay(lambda c: AutoDrafter(c, PromptLookupDrafter(3, 2), model), seq, P, STEPS, K, 3,
                                 costs=lr.CostModel(dict(STEPS), DRAFT[1], draft_widths=dict(DRAFT)), model=model)[0]
    t_plain = lr.replay(lambda c: NoDrafter(), seq, P, STEPS, K, 3)[0]
    assert times[True] < 0.6 * t_plain  # several tokens a round, once its acceptance is learned
    assert times[False] < 1.15 * t_plain  # its probes cost a little, and then it decodes plainly


def test_replay_times_autos_pace_by_the_replayed_seconds():
    """auto's pace (``AutoDrafter._gap``) reads its clock: in a replay, the seconds replayed so far, not the host's
    (which replays a request in milliseconds: a pace of 40,000 tok/s)."""
    lr = load()
    seq, P = sequences()["copy"]
    seen = []

    class Watched(AutoDrafter):
        def propose(self, tokens, k, params, rng):  # noqa: ANN001
            seen.append(self.clock())
            return super().propose(tokens, k, params, rng)

    t, _ = lr.replay(lambda c: Watched(c, PromptLookupDrafter(3, 2), None), seq, P, STEPS, K, 3)
    assert seen[0] == 0.0 and all(a < b for a, b in zip(seen, seen[1:])) and seen[-1] < t


def test_a_drifting_machine_is_felt_by_auto_and_scored_at_the_measured_step_times():
    """``--drift``: the drafter observes the drifted seconds (its cost model's speed follows the machine, its pace
    is timed by them), while the seconds replay returns price its rounds at ``steps``: a drafter that never looks at
    the clock scores the same with and without drift, and a history is one seeded function of replayed time."""
    lr = load()
    seq, P = sequences()["fresh"][0][:45], 20
    a, b = lr.Drift(7), lr.Drift(7)
    assert [a.level(t) for t in np.linspace(0, 30, 61)] == [b.level(t) for t in np.linspace(0, 30, 61)]
    assert 0.8 <= min(a.levels) and max(a.levels) <= 1.25 and len(set(a.levels)) > 3
    slow = lr.Drift(0, low=1.5, high=1.5, jitter=0.0)  # one slow phase
    model = replay_model(lr, seq, P)
    steady = lr.replay(lambda c: lr._FixedModel(model, 4), seq, P, STEPS, K, 3, model=model)
    model = replay_model(lr, seq, P)
    assert lr.replay(lambda c: lr._FixedModel(model, 4), seq, P, STEPS, K, 3, model=model, drift=slow) == steady
    assert model.felt == pytest.approx(1.5 * model.spent)
    costs, seen = lr.CostModel(dict(STEPS), DRAFT[1], draft_widths=dict(DRAFT)), []

    class Watched(AutoDrafter):
        def propose(self, tokens, k, params, rng):  # noqa: ANN001
            seen.append(self.clock())
            return super().propose(tokens, k, params, rng)

    t, _ = lr.replay(lambda c: Watched(c, PromptLookupDrafter(3, 2), None), seq, P, STEPS, K, 3, costs=costs,
                     drift=slow)
    assert costs.verify_time(2) == pytest.approx(1.5 * STEPS[2], rel=0.02) and costs.speed > 1.3
    assert seen[-1] > 1.4 * t  # the pace was timed by the drifted seconds; t prices the rounds at STEPS


def test_traces_record_what_the_draft_proposes_in_a_real_round(decoders):
    """The recorded draft choices (one draft step per position) are what the decoder's own draft proposes in a
    round starting anywhere in the text, as far as its drafts agree with the text."""
    from specedge.runtime import SamplingParams

    lr = load()
    dec = decoders["model"]
    prompt = dec.encode_prompt("def fib(n):", False)
    out = dec.generate("def fib(n):", SamplingParams(max_new_tokens=24), drafter="none", chat=False).token_ids
    seq, P = prompt + out, len(prompt)
    nxt, conf = lr.draft_choices(dec, seq, P)
    assert len(nxt) == len(conf) == len(seq) - P - 1
    rng = np.random.default_rng(0)
    for n in (P + 1, P + 5, P + 13, len(seq) - 4):
        model = dec.make_drafter("model")
        prop = model.propose(np.asarray(seq[:n]), 3, SamplingParams(max_new_tokens=4), rng, keep=lambda c: True)
        assert prop.tokens[0] == nxt[n - P - 1] and model.confidences[0] == pytest.approx(conf[n - P - 1], rel=1e-3)
        for i in range(1, 3):
            if prop.tokens[i - 1] != seq[n + i - 1]:
                break
            assert prop.tokens[i] == nxt[n + i - P - 1]


def test_retime_keeps_the_traces_and_takes_every_width_at_the_stat_asked(decoders, monkeypatch):
    """``--retime``: saved traces replayed at step times taken now (another kernel build, another phase): the rows
    stay (the saved ones untouched), every width of the target and the draft is timed with the statistic asked for,
    at the traces' typical context length, and the kernel build is recorded."""
    lr = load()
    dec = decoders["model"]
    seen = []

    def time_steps(self, repeats=5, past_len=None, all_logits_only=False,  # noqa: ANN001
                   roles=("target", "draft"), stat="min"):
        seen.append((roles, stat, past_len))
        runner = self.target if roles == ("target",) else self.draft_runner
        return {roles[0]: {w.T: 0.01 * w.T for w in runner.entry.widths}}

    monkeypatch.setattr(type(dec), "time_steps", time_steps)
    run = {"bundle": "b", "k": dec.manifest.k, "ngram": [8, 2], "steps": {"2": 1.0}, "draft_steps": {"1": 1.0},
           "rows": [{"id": "x-0", "prompt": [1, 2, 3, 4], "output": [5, 6, 7, 8, 9, 10]}], "max_new_tokens": 8}
    out = lr.retime(run, dec, "median")
    assert out["rows"] == run["rows"] and out["step_stat"] == "median" and run["steps"] == {"2": 1.0}
    assert out["kernel_build"].startswith(("-march=", "-mcpu="))
    assert [s[:2] for s in seen] == [(("target",), "median"), (("draft",), "median")] and seen[0][2] == 4 + 3
    assert out["steps"] == {str(w.T): 0.01 * w.T for w in dec.target.entry.widths if w.T >= dec.target.min_width}
    assert out["draft_steps"] == {str(w.T): 0.01 * w.T for w in dec.draft_runner.entry.widths}


def test_retime_refuses_traces_of_another_bundle(bundles, tmp_path, monkeypatch, capsys):
    """``--retime`` with a bundle whose K or draft model differs from the traces', or without --traces: a usage
    error."""
    import json
    import sys

    lr = load()
    path = tmp_path / "traces.json"
    path.write_text(json.dumps({"bundle": "other", "k": 99, "ngram": [8, 2], "steps": {"2": 0.01},
                                "cpu": "x", "cpu_flags": "", "rows": [], "max_new_tokens": 8}))
    monkeypatch.setattr(sys, "argv", ["lookup_replay", "--traces", str(path), "--retime", str(bundles["model"])])
    with pytest.raises(SystemExit) as e:
        lr.main()
    assert e.value.code == 2 and "not the bundle of the traces" in capsys.readouterr().err
    monkeypatch.setattr(sys, "argv", ["lookup_replay", str(bundles["model"]), "--retime", str(bundles["model"])])
    with pytest.raises(SystemExit):
        lr.main()
    assert "give --traces" in capsys.readouterr().err


def test_requests_replay_in_the_order_of_suites_asked():
    lr = load()
    run = {"bundle": "b", "rows": [{"id": i} for i in ("code-0", "code-1", "edit-0", "json-0", "json-1", "chat-0")]}
    out = lr.in_order(run, "json, edit")
    assert [r["id"] for r in out["rows"]] == ["json-0", "json-1", "edit-0", "code-0", "code-1", "chat-0"]
    assert out["order"] == "json,edit" and [r["id"] for r in run["rows"]][0] == "code-0"  # (a copy)


def test_an_order_naming_a_suite_the_traces_lack_is_a_usage_error(tmp_path, monkeypatch, capsys):
    import json
    import sys

    lr = load()
    f = tmp_path / "t.json"
    f.write_text(json.dumps({"bundle": "b", "k": 4, "ngram": [8, 2], "steps": {"2": 0.04}, "cpu": "c",
                             "cpu_flags": "", "rows": [{"id": "code-0", "prompt": [1, 2], "output": [3, 4]}]}))
    monkeypatch.setattr(sys, "argv", ["lookup_replay.py", "--traces", str(f), "--order", "code,jsn"])
    with pytest.raises(SystemExit):
        lr.main()
    assert "jsn" in capsys.readouterr().err
