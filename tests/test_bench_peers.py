"""tools/bench_peers.py's round merging (the engines themselves need llama.cpp / onnxruntime-genai builds)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

TOOL = Path(__file__).resolve().parent.parent / "tools" / "bench_peers.py"


def _tool():
    spec = importlib.util.spec_from_file_location("bench_peers", TOOL)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


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
