"""`spec-run bench`: speculative vs plain decoding on the same prompts, measured in one run.

    from specedge.runtime.bench import (BenchPlan, check_bundle_prompts, check_out_dir, run_bench, write_report,
                                        write_results)
    plan = BenchPlan(suites=("code", "chat"), ks=(2, 4), drafters=("model", "prompt-lookup"))
    check_bundle_prompts("engines/qwen-coder", plan)   # every prompt fits, before a model loads
    out = check_out_dir("bench/qwen-coder")            # new, empty or a previous bench output; writable
    raw = run_bench(SpecDecoder.load("engines/qwen-coder"), plan, on_run=lambda r: write_results(r, out))
    write_report(raw, out)                             # results.json, report.md, *.png

Modules: ``suites`` (built-in prompts, JSONL prompt files), ``runner`` (the interleaved
measurement loop, machine facts, step costs), ``analysis`` (pure statistics: medians,
paired speedups, the cost model, best K), ``report`` (JSON, Markdown, PNG plots).
Nothing here imports torch; matplotlib is imported only to draw plots.
"""

from .analysis import best_k, ideal_speedup, paired_speedups, round_cost_in_plain_steps, spread
from .report import check_out_dir, write_report, write_results
from .runner import BenchPlan, check_bundle_prompts, check_prompts, run_bench
from .suites import SUITES, BenchPrompt, load_prompts, suite_prompts

__all__ = ["BenchPlan", "run_bench", "write_report", "write_results", "check_out_dir", "check_prompts",
           "check_bundle_prompts", "SUITES", "BenchPrompt", "load_prompts", "suite_prompts", "best_k", "ideal_speedup",
           "round_cost_in_plain_steps", "paired_speedups", "spread"]
