"""`spec-run bench`: speculative vs plain decoding on the same prompts, measured in one run.

    from specedge.runtime.bench import BenchPlan, run_bench, write_report
    plan = BenchPlan(suites=("code", "chat"), ks=(2, 4), drafters=("model", "prompt-lookup"))
    raw = run_bench(SpecDecoder.load("engines/qwen-coder"), plan)
    write_report(raw, "bench/qwen-coder")        # results.json, report.md, *.png

Modules: ``suites`` (built-in prompts, JSONL prompt files), ``runner`` (the interleaved
measurement loop, machine facts, step costs), ``analysis`` (pure statistics: medians,
paired speedups, the cost model, best K), ``report`` (JSON, Markdown, PNG plots).
Nothing here imports torch; matplotlib is imported only to draw plots.
"""

from .analysis import best_k, ideal_speedup, round_cost_in_plain_steps, paired_speedups, spread
from .report import write_report
from .runner import BenchPlan, run_bench
from .suites import SUITES, BenchPrompt, load_prompts, suite_prompts

__all__ = ["BenchPlan", "run_bench", "write_report", "SUITES", "BenchPrompt", "load_prompts", "suite_prompts",
           "best_k", "ideal_speedup", "round_cost_in_plain_steps", "paired_speedups", "spread"]
