"""Benchmark statistics (pure functions) and one tiny end-to-end bench run (no speed assertions)."""

from __future__ import annotations

import json
import math

import pytest
from click.testing import CliRunner

from specedge.runtime.bench import (
    BenchPlan,
    best_k,
    ideal_speedup,
    load_prompts,
    paired_speedups,
    round_cost_in_plain_steps,
    run_bench,
    spread,
    suite_prompts,
    write_report,
)
from specedge.runtime.bench.analysis import expected_tokens_per_round
from specedge.runtime.cli import main as run_cli
from specedge.runtime.errors import PromptError, SamplingParamsError


def test_spread_median_min_max():
    assert spread([3.0, 1.0, 2.0, 10.0]) == {"median": 2.5, "min": 1.0, "max": 10.0, "n": 4}
    assert spread([])["n"] == 0 and math.isnan(spread([])["median"])


def _run(prompt, rep, drafter, k, tps, temp=0.0):
    return {"prompt_id": prompt, "repeat": rep, "temperature": temp, "drafter": drafter, "k": k, "decode_tok_s": tps}


def test_paired_speedups_divide_by_the_plain_run_of_the_same_prompt_and_repeat():
    runs = [_run("a", 0, "none", 0, 10.0), _run("b", 0, "none", 0, 20.0), _run("a", 1, "none", 0, 5.0),
            _run("a", 0, "model", 4, 15.0), _run("b", 0, "model", 4, 20.0), _run("a", 1, "model", 4, 10.0),
            _run("a", 0, "model", 4, 99.0, temp=0.7)]  # no sampled baseline: left out, never guessed
    assert paired_speedups(runs) == {("model", 4, 0.0): [1.5, 1.0, 2.0]}


def test_ideal_speedup_formula():
    assert ideal_speedup(0.0, 0.1, 4) == pytest.approx(1 / 1.4)  # nothing accepted: pure overhead
    assert ideal_speedup(1.0, 0.0, 4) == 5.0  # everything accepted, free draft: k+1 tokens per step
    assert ideal_speedup(0.8, 0.0, 4) == pytest.approx((1 - 0.8 ** 5) / 0.2)
    assert ideal_speedup(0.8, 0.05, 4) == pytest.approx(3.3616 / 1.2)
    assert expected_tokens_per_round(0.5, 1) == pytest.approx(1.5)
    with pytest.raises(ValueError):
        expected_tokens_per_round(1.2, 4)


def test_round_cost_in_plain_steps():
    assert round_cost_in_plain_steps(0.19, 0.1) == pytest.approx(1.9)


def test_best_k_picks_the_fastest_and_breaks_ties_toward_smaller_k():
    s = {("code", "model", 0.0, 2): 1.2, ("code", "model", 0.0, 4): 1.5, ("code", "model", 0.0, 6): 1.5,
         ("chat", "model", 0.0, 2): 0.9, ("chat", "model", 0.0, 4): 0.8}
    assert best_k(s) == {("code", "model", 0.0): (4, 1.5), ("chat", "model", 0.0): (2, 0.9)}


def test_prompt_files(tmp_path):
    f = tmp_path / "p.jsonl"
    f.write_text('{"text": "hi", "suite": "mine", "id": "x"}\n\n'
                 '{"messages": [{"role": "user", "content": "yo"}]}\n{"text": "raw", "raw": true}\n')
    ps = load_prompts(f)
    assert [(p.suite, p.id) for p in ps] == [("mine", "x"), ("custom", "p-3"), ("custom", "p-4")]
    assert (ps[0].as_request() == ("hi", True) and ps[1].as_request()[1] is False
            and ps[2].as_request() == ("raw", False))
    f.write_text('{"text": "ok"}\n{"text": "a", "messages": []}\n')
    with pytest.raises(PromptError, match=r"p.jsonl:2: .*exactly one of"):
        load_prompts(f)
    f.write_text("not json\n")
    with pytest.raises(PromptError, match=r"p.jsonl:1: not valid JSON"):
        load_prompts(f)
    with pytest.raises(PromptError, match="unknown suite"):
        suite_prompts(["code", "poetry"])
    with pytest.raises(SamplingParamsError, match="unknown drafter"):
        BenchPlan(drafters=("magic",))


def test_bench_end_to_end_writes_json_markdown_and_plots(decoders, tmp_path):
    dec = decoders["model"]
    plan = BenchPlan(suites=("chat",), per_suite=2, ks=(2, 4, 99), drafters=("model", "prompt-lookup", "auto"),
                     temperatures=(0.0, 0.8), max_new_tokens=12, ignore_eos=True)
    raw = run_bench(dec, plan, progress=lambda s: None)
    assert len(raw["runs"]) == 2 * 2 * (1 + 2 * 2 + 1)  # prompts x temperatures x (plain + drafters x k<=K + auto)
    files = write_report(raw, tmp_path / "out")
    data = json.loads(files["json"].read_text())
    rows = data["summary"]["rows"]
    greedy = [r for r in rows if r["temperature"] == 0]
    assert all(r["identical_to_plain"] == "2/2" for r in greedy)  # exactness, checked by the bench itself
    fixed = [r for r in rows if r["drafter"] in ("model", "prompt-lookup")]
    assert all(r["speedup"]["n"] == 2 and r["ideal_speedup"] > 0 and sum(r["round_cost"].values()) > 0 for r in fixed)
    auto = [r for r in rows if r["drafter"] == "auto"]
    assert len(auto) == 2 and all(sum(r["strategies"].values()) > 0 for r in auto)
    assert {(b["drafter"], b["temperature"]) for b in data["summary"]["best_k"]} == {
        ("model", 0.0), ("model", 0.8), ("prompt-lookup", 0.0), ("prompt-lookup", 0.8), ("auto", 0.0), ("auto", 0.8)}
    for name in ("speedup_vs_k", "acceptance_hist", "time_split"):
        assert files[name].read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "| chat | model | 4 | 0 |" in files["markdown"].read_text()


def test_spec_run_bench_cli(bundles, tmp_path):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"text": "def add(a, b):", "raw": true, "suite": "mine"}\n')
    out = tmp_path / "b"
    r = CliRunner().invoke(run_cli, ["bench", str(bundles["lookup"]), "--prompts", str(prompts), "--k", "2",
                                     "--max-new-tokens", "6", "--out", str(out), "--no-plots"])
    assert r.exit_code == 0, r.output
    assert (out / "results.json").is_file() and "| mine | prompt-lookup | 2 |" in r.output
    r = CliRunner().invoke(run_cli, ["bench", str(bundles["lookup"]), "--suite", "poetry"])
    assert r.exit_code == 2 and "unknown suite" in r.output


def test_bench_passes_the_cuda_graphs_flag_to_the_decoder(monkeypatch, bundles, tmp_path):
    from tests.runtime.test_trt_contexts import check_cuda_graphs_flag

    check_cuda_graphs_flag(monkeypatch, ["bench", str(bundles["lookup"]), "--out", str(tmp_path / "bench"),
                                         "--suite", "chat", "--max-new-tokens", "4"])
