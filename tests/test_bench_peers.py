"""tools/bench_peers.py's round merging (the engines themselves need llama.cpp / onnxruntime-genai builds)."""

from __future__ import annotations

import pytest

from .tools_loader import load_tool

pytestmark = pytest.mark.fast  # torch-free: make test-fast

def _tool():
    return load_tool("bench_peers")


def test_rounds_merge_into_per_prompt_medians_and_keep_every_value():
    def cell(v, ids):
        return {"decode_tok_s": v, "e2e_tok_s": v / 2, "ttft_s": 0.1, "new_tokens": 3, "ids": ids}

    rounds = [[{"id": "code-0", "prompt_tokens": 9, "ours plain": cell(v, [1, 2, 3]), "peer plain": cell(w, None)}]
              for v, w in ((20.0, 30.0), (26.0, 24.0), (23.0, 27.0))]
    (row,) = _tool().merge_rounds(rounds)
    assert row["id"] == "code-0" and row["prompt_tokens"] == 9
    assert row["ours plain"]["decode_tok_s"] == 23.0 and row["ours plain"]["decode_tok_s_rounds"] == [20.0, 26.0, 23.0]
    assert row["peer plain"]["decode_tok_s"] == 27.0 and row["peer plain"]["e2e_tok_s"] == 13.5
    assert row["ours plain"]["ids"] == [1, 2, 3] and rounds[0][0]["ours plain"]["decode_tok_s"] == 20.0  # not mutated
    assert "rounds" not in row["peer plain"]


def test_merged_rounds_keep_what_auto_chose_in_each_round():
    def cell(v, chose):
        return {"decode_tok_s": v, "e2e_tok_s": v, "ttft_s": 0.1, "new_tokens": 3, "ids": [1], "rounds": chose}

    rounds = [[{"id": "json-0", "ours auto:8": cell(v, chose)}]
              for v, chose in ((50.0, {"none": 3, "model": 9}), (70.0, {"model": 7}))]
    (row,) = _tool().merge_rounds(rounds)
    assert row["ours auto:8"]["rounds"] == [{"none": 3, "model": 9}, {"model": 7}]


def test_another_bundle_of_ours_counts_as_ours_not_as_a_peer():
    def cell(v):
        return {"decode_tok_s": v}

    row = {"id": "edit-0", "ours plain": cell(20.0), "ours auto:8": cell(22.0), "ours[int8] plain": cell(15.0),
           "ours[int8] prompt-lookup:8": cell(34.0), "llama.cpp plain": cell(25.0)}
    names = [n for n in row if n != "id"]
    (line,) = _tool().per_prompt_table([row], names)[2:]
    # auto against our plain, and against the best fixed configuration of its own bundle (20.0, not 34.0)
    assert line == "| edit-0 | ours[int8] prompt-lookup:8 34.0 | llama.cpp plain 25.0 | 1.36× | 1.10× | 1.10× |"


def test_a_suite_is_judged_by_one_configuration_over_all_its_prompts_time_weighted():
    def cell(v, n=11):
        return {"decode_tok_s": v, "new_tokens": n}

    rows = [{"id": "summarize-0", "ours plain": cell(20.0), "ours prompt-lookup:8": cell(40.0),
             "ours auto:8": cell(30.0), "ours model:4": cell(25.0), "peer plain": cell(25.0),
             "peer n-gram": cell(20.0)},
            {"id": "summarize-1", "ours plain": cell(20.0), "ours prompt-lookup:8": cell(10.0),
             "ours auto:8": cell(20.0), "ours model:4": cell(25.0), "peer plain": cell(25.0),
             "peer n-gram": cell(50.0)},
            {"id": "chat-0", "ours plain": cell(30.0, 21), "ours prompt-lookup:8": cell(30.0, 21),
             "ours auto:8": cell(33.0, 21), "ours model:4": cell(20.0, 21), "peer plain": cell(30.0, 21),
             "peer n-gram": cell(15.0, 21)}]
    names = [n for n in rows[0] if n != "id"]
    head, _, summarize, chat = _tool().per_suite_table(rows, names)
    assert head.startswith("| suite (prompts) |")
    # lookup:8 wins one prompt 40 to 25 but loses the other 10 to 25: 20 tokens in 0.25 + 1.0 s = 16 tok/s, so
    # the suite's best fixed configuration is model:4 (25); the peers' best over both prompts is plain (25 tok/s,
    # n-gram 20 / (0.5 + 0.2) = 28.6 beats it)
    assert summarize == ("| summarize (2) | ours model:4 25.0 | peer n-gram 28.6 | 0.88× | 1.20× | 0.96× |")
    assert chat == "| chat (1) | ours auto:8 33.0 | peer plain 30.0 | 1.10× | 1.10× | 1.10× |"


def test_every_prompt_runs_on_every_engine_before_the_next_and_no_unit_always_runs_first():
    units = ["ours plain", "ours auto:8", "llama.cpp plain", "ortgenai plain"]
    for r in range(2):
        order = list(_tool().interleaved(units, 5, r))
        assert len(order) == 5 * len(units)
        # prompt by prompt: all of a prompt's runs are adjacent, every unit once
        for i in range(5):
            block = order[i * len(units):(i + 1) * len(units)]
            assert {p for p, _ in block} == {i} and sorted(u for _, u in block) == sorted(units)
        firsts = [order[i * len(units)][1] for i in range(5)]
        assert len(set(firsts)) == len(units)  # the first place rotates
    assert list(_tool().interleaved(units, 1, 0))[0][1] != list(_tool().interleaved(units, 1, 1))[0][1]


def _ortgenai_tool():
    return load_tool("build_ortgenai")


class _FakeParams:
    def set_speculative_options(self, **kw):
        pass


class _FakeOg:
    """Stands in for onnxruntime_genai (not in this venv): the tool's own _load and _run_one are replaced."""
    GeneratorParams = _FakeParams


def _fake_ortgenai(monkeypatch):
    """build_ortgenai with onnxruntime-genai's calls replaced; returns (tool, loaded, ran). A prompt [13] fails."""
    tool = _ortgenai_tool()
    loaded, ran = [], []

    def fake_load(og, model_dir, threads):
        loaded.append((model_dir, threads))
        return model_dir

    def fake_run(og, model, ids, max_new, eos, spec):
        ran.append((model, tuple(ids), max_new, spec))
        if list(ids) == [13]:
            raise RuntimeError("out of memory")
        return [5, 6, 7], 0.1, 0.11, 0.5, ({"rounds": 1} if spec else None)

    monkeypatch.setattr(tool, "_load", fake_load)
    monkeypatch.setattr(tool, "_run_one", fake_run)
    monkeypatch.setattr(tool, "_versions", lambda: {"onnxruntime_genai": "0.18.0", "onnxruntime": "1.32.0"})
    return tool, loaded, ran


def test_the_ortgenai_worker_loads_each_model_once_and_answers_one_line_per_prompt(monkeypatch):
    """build_ortgenai.py serve's line protocol, with onnxruntime-genai's calls replaced (it is not in this venv)."""
    import io
    import json

    tool, loaded, ran = _fake_ortgenai(monkeypatch)
    head = {"threads": 2, "max_new": 8, "eos": [2], "warmup": [1, 2], "configs": [
        {"name": "plain", "model": "/t", "speculative": None},
        {"name": "prompt-lookup:8", "model": "/t", "speculative": {"ngram_size": 3, "max_draft_tokens": 8}},
        {"name": "model:4", "model": "/pair", "speculative": {"max_draft_tokens": 4}}]}
    lines = [head, {"config": "plain", "ids": [9, 9]}, {"config": "model:4", "ids": [9, 9]},
             {"config": "plain", "ids": [13]}, {"config": "nope", "ids": [9]}]
    out = io.StringIO()
    tool.serve(_FakeOg, io.StringIO("".join(json.dumps(x) + "\n" for x in lines)), out)
    replies = [json.loads(x) for x in out.getvalue().splitlines()]
    assert loaded == [("/t", 2), ("/pair", 2)]  # the target once for plain and n-gram
    assert replies[0]["ready"] and replies[0]["errors"] == {}
    assert [r[1] for r in ran[:3]] == [(1, 2)] * 3 and all(r[2] == 8 for r in ran[:3])  # each config warmed up
    assert replies[1] == {"ids": [5, 6, 7], "prefill_s": 0.1, "ttft_s": 0.11, "total_s": 0.5, "spec_stats": None}
    assert ran[4] == ("/pair", (9, 9), 8, {"max_draft_tokens": 4}) and replies[2]["spec_stats"] == {"rounds": 1}
    assert replies[3] == {"error": "RuntimeError: out of memory"}  # the worker goes on after a failed prompt
    assert "unknown config" in replies[4]["error"] and len(replies) == 5


def test_an_ortgenai_job_runs_through_the_worker_config_by_config(monkeypatch, capsys):
    """build_ortgenai.py generate: the whole job's results per config, a config with a failed prompt reported as
    its error, the others kept."""
    import io
    import json
    import sys
    import types

    tool, _, ran = _fake_ortgenai(monkeypatch)
    monkeypatch.setitem(sys.modules, "onnxruntime_genai", types.SimpleNamespace(GeneratorParams=_FakeParams))
    job = {"threads": 2, "max_new": 8, "eos": [2], "prompts": [[9], [13]], "warmup": False, "configs": [
        {"name": "plain", "model": "/t", "speculative": None},
        {"name": "prompt-lookup:8", "model": "/t", "speculative": {"ngram_size": 3, "max_draft_tokens": 8}}]}
    monkeypatch.setattr(sys, "stdin", io.StringIO(json.dumps({**job, "prompts": [[9], [9]]})))
    tool.cmd_generate(types.SimpleNamespace(job="-"))
    res = json.loads(capsys.readouterr().out)
    assert res["versions"]["onnxruntime_genai"] == "0.18.0"
    assert [r["ids"] for r in res["results"]["plain"]] == [[5, 6, 7]] * 2
    assert res["results"]["prompt-lookup:8"][0]["spec_stats"] == {"rounds": 1}
    spec = job["configs"][1]["speculative"]
    assert [r[3] for r in ran] == [None, None, spec, spec]  # config after config, no warm-up asked
    monkeypatch.setattr(sys, "stdin", io.StringIO(json.dumps(job)))
    tool.cmd_generate(types.SimpleNamespace(job="-"))
    res = json.loads(capsys.readouterr().out)
    assert res["results"]["plain"] == {"error": "RuntimeError: out of memory"}


def test_the_spread_between_rounds_is_reported_per_configuration():
    """Each configuration's rounds of one prompt, (fastest - slowest) / mean: the median and the largest over the
    prompts, with the prompt it was on; nothing with a single round, a failed run left out."""
    def cell(*v):
        return {"decode_tok_s": sorted(v)[len(v) // 2], "decode_tok_s_rounds": list(v)}

    rows = [{"id": "code-0", "ours plain": cell(40.0, 60.0), "peer plain": cell(30.0, 30.0)},
            {"id": "json-0", "ours plain": cell(45.0, 55.0), "peer plain": cell(0.0, 30.0)},
            {"id": "chat-0", "ours plain": cell(50.0, 50.0), "peer plain": cell(33.0, 27.0)}]
    table = _tool().spread_table(rows, ["ours plain", "peer plain"])
    assert table[2] == "| ours plain | 20 % | 40 % (code-0) |"
    assert table[3] == "| peer plain | 10 % | 20 % (chat-0) |"
    assert _tool().spread_table([{"id": "x-0", "ours plain": {"decode_tok_s": 1.0, "decode_tok_s_rounds": [1.0]}}],
                                ["ours plain"]) == []
