#!/usr/bin/env python3
"""Our runtime next to other engines on the same models and prompts, in one run.

    pip install -e '.[export,peers]'                      # transformers + torch (CPU)
    pip install llama-cpp-python                           # llama.cpp (builds from source)
    python tools/bench_peers.py engines/qwen-coder --peers hf --spec model:4 --suite code,chat
    python tools/bench_peers.py engines/qwen-int4 --peers llamacpp --spec model:4,prompt-lookup:8
    python3 tools/build_ortgenai.py venv                   # onnxruntime-genai 0.18 in ~/.cache/specedge/peers-venv
    python tools/bench_peers.py engines/qwen-int4 --peers ortgenai --spec model:4,prompt-lookup:8

Every engine gets the same prompt token ids (from the bundle's tokenizer and chat template) and
decodes greedily from the weights the bundle was exported from (its GGUF or HF directory).

* ours: plain (drafter none) and each ``--spec drafter:k``.

* hf (transformers, torch CPU, fp32): plain; assisted generation with the bundle's draft model
  (``assistant_model``, constant ``num_assistant_tokens`` = k) for ``model:k``; prompt lookup
  (``prompt_lookup_num_tokens`` = k) for ``prompt-lookup:k``.
* llamacpp-native (llama.cpp's own binaries, built by tools/build_llama_cpp.sh): plain = ``llama-bench`` tg
  (max_new_tokens tokens at the prompt's depth, ``-d``: after as many context tokens as the prompt has);
  ``prompt-lookup:k`` = ``llama-lookup --spec-draft-n-max k``; ``model:k`` = ``llama-speculative-simple --spec-type
  draft-simple --spec-draft-n-max k`` with the bundle's draft GGUF; speed from their own "decoded N tokens ... t/s"
  line; output compared with ours as text (llama.cpp prints text).
* ortgenai (onnxruntime-genai 0.18, its own generator loop, run in the peers venv by tools/build_ortgenai.py, which
  also builds its models from the bundle's source GGUFs with onnxruntime-genai's model builder, cached): plain
  greedy; ``prompt-lookup:k`` = its n-gram decoding (``ngram_size`` N from ``--ortgenai-ngram-size``,
  ``max_draft_tokens`` k); ``model:k`` = its draft-model speculative decoding (``model.draft``, the bundle's draft
  built the same way, ``max_draft_tokens`` k). Weights: the bundle's precision, MatMulNBits block / accuracy level /
  symmetry and lm_head width, a float embedding; 2 intra-op threads. Our prompt ids go in with ``append_tokens``;
  its ttft_s is that prompt forward (append_tokens, both models for model:k) and decode counts everything after it
  (its speculative strategies run a whole round inside the first generate_next_token; first_token_s has that time).
  A variant this onnxruntime-genai cannot run is reported as "not available in onnxruntime-genai X.Y: reason".
* llamacpp (llama-cpp-python, the GGUF as is): plain, and prompt lookup
  (``LlamaPromptLookupDecoding(num_pred_tokens=k)``) for ``prompt-lookup:k``; llama-cpp-python has
  no two-model speculation, so ``model:k`` has no llama.cpp counterpart here.

The report: every configuration's per-prompt speeds, then per prompt and per suite (one configuration for all of a
suite's prompts, time-weighted: ``--per-suite 3`` for the whole suite) our best against the best peer and auto against
our plain and our best fixed configuration.

Decode tok/s = tokens after the first / time after the first token (HF: first-token time from a
separate max_new_tokens=1 call; ortgenai: time after the prompt's forward). Every output is compared with our
plain greedy output.

Interleaved: within a round every prompt runs on every engine and configuration before the next prompt starts, the
order rotated per prompt and round (``interleaved``). A shared VM's speed drifts by tens of percent within minutes;
engines run in blocks minutes apart measured that drift, not the engines (docs/benchmarks.md).
Ours stays loaded in this process, onnxruntime-genai in one worker process of its own venv
(``build_ortgenai.py serve``), llama.cpp's binaries start per prompt. The Python peers (hf, llamacpp) still run in a
block after each round.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import sys
import time
from pathlib import Path

from specedge.runtime import SamplingParams, SpecDecoder
from specedge.runtime.bench import suite_prompts
from specedge.runtime.bench.runner import machine_info


def say(s: str) -> None:
    print(s, file=sys.stderr, flush=True)


def _record(rows: list[dict], i: int, name: str, ids: list[int], ttft: float, total: float,
            rounds: dict | None = None) -> None:
    """One run's row; ``rounds``: how many rounds each strategy ran (ours; for reading `auto`'s choices)."""
    n = len(ids)
    rows[i][name] = {"decode_tok_s": (n - 1) / (total - ttft) if n > 1 and total > ttft else 0.0,
                     "e2e_tok_s": n / total if total else 0.0, "ttft_s": ttft, "new_tokens": n, "ids": ids}
    if rounds:
        rows[i][name]["rounds"] = rounds
    say(f"{rows[i]['id']} {name}: {rows[i][name]['decode_tok_s']:.2f} tok/s, {n} tokens"
        + (f", rounds {rounds}" if rounds else ""))


class Ours:
    """Our runtime on one bundle, loaded once for every round; its rows are ``{engine} plain`` and
    ``{engine} drafter:k`` (engine "ours", or "ours[DIRNAME]" for an ``--also`` bundle)."""

    def __init__(self, bundle: str, prompts, specs, max_new: int, engine: str = "ours"):
        self.engine = engine
        self.dec = SpecDecoder.load(bundle, verify="size")
        self.manifest = self.dec.manifest
        self.params = SamplingParams(max_new_tokens=max_new)
        self.dec.generate("Hello", SamplingParams(max_new_tokens=8))  # warm-up
        self.requests = [p.as_request(bool(self.manifest.tokenizer.chat_template)) for p in prompts]
        self.ids_list = [self.dec.encode_prompt(text, chat) for text, chat in self.requests]
        self.configs = []
        for d, k in [("none", 0), *specs]:
            if k > self.manifest.k:  # a longer draft than this bundle verifies: run by the bundles that can
                NOTES.append(f"{engine} {d}:{k} skipped: the bundle's K is {self.manifest.k}")
            else:
                self.configs.append((d, k))

    def run(self, i: int, cfg: tuple[str, int], rows: list[dict]) -> None:
        d, k = cfg
        text, chat = self.requests[i]
        # a new request each time: no configuration finds the prompt cached by the one before it (the target's rows:
        # its prefill is timed; the draft's: its catch-up on the prompt is part of the first model round)
        r = self.dec.generate(text, self.params, drafter=d, k=k, chat=chat, reuse_prefix=False)
        _record(rows, i, f"{self.engine} plain" if d == "none" else f"{self.engine} {d}:{k}", r.token_ids,
                r.stats.ttft_s, r.stats.ttft_s + r.stats.decode_s, dict(r.stats.strategies or {}))

    def close(self) -> None:
        self.dec.close()
        del self.dec
        gc.collect()


def interleaved(units: list, n_prompts: int, r: int):
    """The order of one round: every prompt runs on every (engine, config) unit before the next prompt starts (a
    shared VM's speed drifts by tens of percent within minutes, so engines run in blocks minutes apart are not
    comparable), the units rotated by one place per prompt and per round so that none always runs first."""
    for i in range(n_prompts):
        s = (i + r) % len(units) if units else 0
        for unit in units[s:] + units[:s]:
            yield i, unit


def run_hf(manifest, ids_list, specs, max_new: int, rows: list[dict]) -> dict:
    import torch
    import transformers
    from transformers import AutoModelForCausalLM

    def load(entry):
        src = Path(entry.source["path"])
        if src.suffix == ".gguf":
            return AutoModelForCausalLM.from_pretrained(src.parent, gguf_file=src.name,
                                                        torch_dtype=torch.float32).eval()
        return AutoModelForCausalLM.from_pretrained(src, torch_dtype=torch.float32).eval()

    torch.set_num_threads(os.cpu_count() or 1)
    say("transformers: loading …")
    target = load(manifest.target)
    assistant = load(manifest.draft) if manifest.draft is not None and any(d == "model" for d, _ in specs) else None
    eos = list(manifest.tokenizer.eos_ids)

    def gen(ids, n, **kw):
        x = torch.tensor([ids])
        t0 = time.perf_counter()
        with torch.inference_mode():
            y = target.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=n, do_sample=False,
                                eos_token_id=eos, pad_token_id=eos[0], **kw)
        return y[0, len(ids):].tolist(), time.perf_counter() - t0

    gen(ids_list[0][:8], 4)  # warm-up
    for i, ids in enumerate(ids_list):
        _, ttft = gen(ids, 1)
        out, dt = gen(ids, max_new)
        _record(rows, i, "hf plain", out, ttft, dt)
        for drafter, k in specs:
            if drafter == "model" and assistant is not None:
                assistant.generation_config.num_assistant_tokens = k
                assistant.generation_config.num_assistant_tokens_schedule = "constant"
                out, dt = gen(ids, max_new, assistant_model=assistant)
            elif drafter == "prompt-lookup":
                out, dt = gen(ids, max_new, prompt_lookup_num_tokens=k)
            else:
                continue
            _record(rows, i, f"hf {drafter}:{k}", out, ttft, dt)
    return {"transformers": transformers.__version__, "torch": torch.__version__}


def run_llamacpp(manifest, ids_list, specs, max_new: int, rows: list[dict]) -> dict:
    import llama_cpp
    from llama_cpp import Llama
    from llama_cpp.llama_speculative import LlamaPromptLookupDecoding

    path = manifest.target.source["path"]
    eos = set(manifest.tokenizer.eos_ids)
    threads = os.cpu_count() or 1
    configs = [("plain", None)] + [(f"{d}:{k}", k) for d, k in specs if d == "prompt-lookup"]
    for name, k in configs:
        say(f"llama.cpp {name}: loading {path} …")
        llm = Llama(model_path=path, n_ctx=manifest.max_context, n_threads=threads, n_threads_batch=threads,
                    n_batch=512, verbose=False,
                    draft_model=LlamaPromptLookupDecoding(num_pred_tokens=k) if k else None)
        for i, ids in enumerate(list(ids_list[:1]) + list(ids_list)):  # the first pass is a warm-up
            out: list[int] = []
            t0 = time.perf_counter()
            ttft = 0.0
            for tok in llm.generate(ids, top_k=1, top_p=1.0, temp=0.0, repeat_penalty=1.0, reset=True):
                if not out:
                    ttft = time.perf_counter() - t0
                if tok in eos:
                    break
                out.append(tok)
                if len(out) >= max_new:
                    break
            if i > 0:
                _record(rows, i - 1, f"llama.cpp {name}", out, ttft, time.perf_counter() - t0)
        del llm
        gc.collect()
    return {"llama_cpp_python": llama_cpp.__version__}


def _llama_bin() -> Path:
    """llama.cpp's own binaries, built natively by tools/build_llama_cpp.sh (or $SPECEDGE_LLAMA_BIN)."""
    import subprocess

    if os.environ.get("SPECEDGE_LLAMA_BIN"):
        return Path(os.environ["SPECEDGE_LLAMA_BIN"])
    script = Path(__file__).with_name("build_llama_cpp.sh")
    say("llama.cpp native: building (cached) …")
    return Path(subprocess.run(["bash", str(script)], check=True, capture_output=True, text=True).stdout.strip())


def llama_bench_tg(bench: str | Path, gguf: str, n: int, depth: int, threads: int | str) -> float:
    """llama.cpp's own plain decode speed: ``llama-bench`` tg ``n`` after ``depth`` context tokens (``-d``), one
    repetition after its warm-up, tok/s."""
    import subprocess

    out = subprocess.run([str(bench), "-m", gguf, "-p", "0", "-n", str(n), "-d", str(depth), "-t", str(threads),
                          "-r", "1", "-o", "json"], capture_output=True, text=True, check=True)
    return json.loads(out.stdout)[0]["avg_ts"]


def _speed(log: str) -> tuple[float, int]:
    """(decode tok/s, tokens) from llama.cpp's 'decoded N tokens in S seconds, speed: X t/s' line."""
    import re

    m = re.findall(r"decoded\s+(\d+) tokens in\s+([\d.]+) seconds, speed:\s+([\d.]+) t/s", log)
    return (float(m[-1][2]), int(m[-1][0])) if m else (0.0, 0)


class LlamaNative:
    """llama.cpp's own binaries, natively, one process per prompt and config: ``llama-bench`` plain tg at the prompt's
    depth (``-d``: its tg runs after that many context tokens, 1 repetition after its warm-up), ``llama-lookup``
    (prompt lookup, --spec-draft-n-max k) and ``llama-speculative-simple`` (draft model), greedy, 2 threads, on the
    bundle's source GGUFs and the same prompt text (ids decoded with special tokens kept, re-tokenized by llama.cpp
    with special parsing)."""

    def __init__(self, manifest, ids_list, texts, specs, max_new: int):
        import tempfile

        self.bin_dir = _llama_bin()
        self.threads = str(min(os.cpu_count() or 1, 2))
        self.manifest, self.ids_list, self.texts, self.max_new = manifest, ids_list, texts, max_new
        self.target = manifest.target.source["path"]
        self.draft = manifest.draft.source["path"] if manifest.draft is not None else None
        self.configs = [("plain", 0)] + [(d, k) for d, k in specs
                                         if d == "prompt-lookup" or (d == "model" and self.draft)]
        self.files = []
        for text in texts:
            with tempfile.NamedTemporaryFile("w", suffix=".txt", delete=False) as f:
                f.write(text)
            self.files.append(f.name)
        self.versions = {"llama.cpp": f"native build ({self.bin_dir})"}

    def run(self, i: int, cfg: tuple[str, int], rows: list[dict]) -> None:
        import subprocess

        d, k = cfg
        if d == "plain":
            depth = len(self.ids_list[i])
            tg = llama_bench_tg(self.bin_dir / "llama-bench", self.target, self.max_new, depth, self.threads)
            rows[i]["llama.cpp plain"] = {"decode_tok_s": tg, "e2e_tok_s": tg, "ttft_s": 0.0, "depth": depth,
                                          "new_tokens": self.max_new, "ids": None}
            say(f"{rows[i]['id']} llama.cpp plain (llama-bench tg{self.max_new} at depth {depth}): {tg:.2f} tok/s")
            return
        if d == "prompt-lookup":
            cmd = [str(self.bin_dir / "llama-lookup"), "-m", self.target]
        else:
            cmd = [str(self.bin_dir / "llama-speculative-simple"), "-m", self.target, "-md", self.draft,
                   "--spec-type", "draft-simple", "--spec-draft-n-min", "0"]
        cmd += ["-f", self.files[i], "-n", str(self.max_new), "--spec-draft-n-max", str(k), "-t", self.threads,
                "--temp", "0", "-c", str(self.manifest.max_context)]
        r = subprocess.run(cmd, capture_output=True, text=True)
        speed, n = _speed(r.stdout + r.stderr)
        text = self.texts[i]
        out_text = r.stdout.split(text, 1)[1] if text in r.stdout else r.stdout
        rows[i][f"llama.cpp {d}:{k}"] = {"decode_tok_s": speed, "e2e_tok_s": speed, "ttft_s": 0.0,
                                         "new_tokens": n, "ids": None, "text": out_text}
        say(f"{rows[i]['id']} llama.cpp {d}:{k}: {speed:.2f} tok/s ({n} tokens)"
            + ("" if r.returncode == 0 else f" rc={r.returncode}"))

    def close(self) -> None:
        for f in self.files:
            os.unlink(f)


NOTES: list[str] = []  # lines printed under the table (variants a peer could not run, and why)


class OrtGenai:
    """onnxruntime-genai natively: tools/build_ortgenai.py (in the peers venv) builds the target (and draft) from the
    bundle's source weights, then one worker process of that venv (``serve``) keeps every config's model loaded
    and decodes one prompt per request (plain, n-gram = prompt-lookup:k, draft model = model:k), so that it
    interleaves with the other engines prompt by prompt."""

    def __init__(self, manifest, ids_list, specs, max_new: int, ngram_size: int = 3, genai_defaults: bool = False):
        import subprocess

        script = Path(__file__).with_name("build_ortgenai.py")
        py = os.environ.get("SPECEDGE_PEERS_PYTHON") or str(
            Path(os.environ.get("SPECEDGE_CACHE", Path.home() / ".cache" / "specedge")) / "peers-venv" / "bin"
            / "python")
        if not Path(py).exists():
            raise SystemExit(f"--peers ortgenai needs the peers venv ({py}): python3 {script} venv")
        threads = min(os.cpu_count() or 1, 2)
        self.manifest, self.ids_list, self.specs, self.ngram_size = manifest, ids_list, specs, ngram_size

        def build(entry) -> str:
            cmd = [py, str(script), "build", entry.source["path"], "--threads", str(threads)]
            q = entry.quant or {}
            if entry.precision in ("int4", "int8"):
                cmd += ["--precision", entry.precision, "--block", str(q.get("block", 32)),
                        "--accuracy-level", str(q.get("accuracy_level", 4))]
                cmd += [] if q.get("symmetric", True) else ["--asymmetric"]
                # (our "gguf" head: the GGUF's Q6_K blocks, which the builder's int4/int8 choice cannot hold; its int8)
                head = q.get("lm_head") or "int8"
                cmd += ["--genai-defaults"] if genai_defaults else ["--lm-head", "int8" if head == "gguf" else head]
            else:
                cmd += ["--precision", "fp32"]
            say(f"onnxruntime-genai: building (cached) {Path(entry.source['path']).name} {entry.precision} …")
            return subprocess.run(cmd, check=True, stdout=subprocess.PIPE, text=True).stdout.strip().splitlines()[-1]

        target = build(manifest.target)
        configs = [{"name": "plain", "model": target, "speculative": None}]
        for d, k in specs:
            if d == "prompt-lookup":
                configs.append({"name": f"{d}:{k}", "model": target,
                                "speculative": {"ngram_size": ngram_size, "max_draft_tokens": k}})
            elif d == "model" and manifest.draft is not None:
                draft = build(manifest.draft)
                pair = subprocess.run([py, str(script), "pair", target, draft, "--k", str(k)], check=True,
                                      stdout=subprocess.PIPE, text=True).stdout.strip().splitlines()[-1]
                configs.append({"name": f"{d}:{k}", "model": pair, "speculative": {"max_draft_tokens": k}})
        self.proc = subprocess.Popen([py, str(script), "serve"], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     text=True)
        self._send({"threads": threads, "max_new": max_new, "eos": list(manifest.tokenizer.eos_ids),
                    "configs": configs, "warmup": list(map(int, ids_list[0]))})
        ready = self._receive()
        ver = ready["versions"]["onnxruntime_genai"]
        for name, err in ready["errors"].items():
            NOTES.append(f"ortgenai {name}: not available in onnxruntime-genai {ver}: {err}")
            say(NOTES[-1])
        self.configs = [c["name"] for c in configs if c["name"] not in ready["errors"]]
        self.versions = {"onnxruntime_genai": ver, "onnxruntime (genai)": ready["versions"]["onnxruntime"],
                         "ortgenai weights": Path(target).name}

    def _send(self, obj) -> None:
        self.proc.stdin.write(json.dumps(obj) + "\n")
        self.proc.stdin.flush()

    def _receive(self) -> dict:
        for line in self.proc.stdout:  # anything a library prints on stdout is skipped
            if line.startswith("{"):
                return json.loads(line)
        raise SystemExit(f"the onnxruntime-genai worker ended (exit code {self.proc.wait()}); its messages are above")

    def run(self, i: int, name: str, rows: list[dict]) -> None:
        self._send({"config": name, "ids": list(map(int, self.ids_list[i]))})
        g = self._receive()
        if "error" in g:  # this prompt failed: a speed of 0 (reported), the run goes on
            NOTES.append(f"ortgenai {name} on {rows[i]['id']}: {g['error']}")
            say(NOTES[-1])
            g = {"ids": [], "prefill_s": 0.0, "ttft_s": 0.0, "total_s": 0.0, "spec_stats": None}
        # decode = tokens after the first / time after the prompt's forward (append_tokens): its speculative
        # strategies run a whole round inside the first generate_next_token, which must count as decoding
        _record(rows, i, f"ortgenai {name}", g["ids"], g["prefill_s"], g["total_s"])
        rows[i][f"ortgenai {name}"]["first_token_s"] = g["ttft_s"]
        if g.get("spec_stats"):
            rows[i][f"ortgenai {name}"]["spec_stats"] = g["spec_stats"]

    def notes(self, rows: list[dict]) -> None:
        """Output comparisons over the merged rows, under the table."""
        if "ortgenai plain" in rows[0]:  # its weights are re-quantized by its builder, so divergence is expected
            pre = []
            for r in rows:
                a, b = r["ours plain"]["ids"], r["ortgenai plain"]["ids"]
                pre.append(next((j for j, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b))))
            NOTES.append("ortgenai plain vs ours plain, tokens in common before the first difference, per prompt: "
                         + ", ".join(f"{p}/{len(r['ours plain']['ids'])}" for p, r in zip(pre, rows)))
        for c in self.configs[1:]:  # speculation should not change the output: compare with its own plain
            n = f"ortgenai {c}"
            same = [r[n]["ids"] == r["ortgenai plain"]["ids"] for r in rows if n in r and "ortgenai plain" in r]
            if same:
                NOTES.append(f"{n}: output identical to ortgenai plain in {sum(same)}/{len(same)} prompts")
        if any(d == "model" for d, _ in self.specs) and self.manifest.draft is None:
            NOTES.append("ortgenai model:k: the bundle has no draft model")
        if any(d == "prompt-lookup" for d, _ in self.specs):
            NOTES.append(f"ortgenai prompt-lookup:k = n-gram decoding with ngram_size {self.ngram_size} (matches the "
                         f"last {self.ngram_size - 1} tokens), max_draft_tokens k, fixed width (min_adaptive_k 0), "
                         "no chained lookup")

    def close(self) -> None:
        self.proc.stdin.close()
        self.proc.wait()


OURS_ONLY = ("auto", "hybrid")  # our drafters without a peer counterpart: measured for ours, skipped for peers


def merge_rounds(rounds: list[list[dict]]) -> list[dict]:
    """Rows of several rounds of the same engines and prompts -> one row set whose speeds are the per-prompt
    medians (each round's values kept under ``*_rounds``, ours' strategy counts as a list under ``rounds``); ids, text
    and the rest come from the first round."""
    merged = []
    for i, first in enumerate(rounds[0]):
        row = dict(first)
        for name, cell in first.items():
            if not isinstance(cell, dict):
                continue
            cell = dict(cell)
            for key in ("decode_tok_s", "e2e_tok_s", "ttft_s"):
                if key in cell:
                    vals = [r[i][name][key] for r in rounds]
                    cell[key], cell[key + "_rounds"] = statistics.median(vals), vals
            if "rounds" in cell:  # what each round's run chose, strategy by strategy
                cell["rounds"] = [r[i][name].get("rounds") for r in rounds]
            row[name] = cell
        merged.append(row)
    return merged


def spread_table(rows: list[dict], names: list[str]) -> list[str]:
    """How far one configuration's rounds of the same prompt are apart: (fastest - slowest) / mean per prompt, the
    median and largest over the prompts. A fixed configuration makes the same rounds every time, so its spread is
    the machine's (a shared VM's phases: over two whole runs, neither round was faster across the board): what a ratio
    between two configurations can be trusted to. ``auto``'s adds its choices, which move with the step times it
    observes."""
    out = ["| engine / config | round-to-round spread, median over prompts | largest (prompt) |", "|---|---|---|"]
    for n in names:
        spread = []
        for r in rows:
            vals = r[n].get("decode_tok_s_rounds", [])
            if len(vals) > 1 and min(vals) > 0:
                spread.append(((max(vals) - min(vals)) / statistics.mean(vals), r["id"]))
        if spread:
            worst = max(spread)
            out.append(f"| {n} | {100 * statistics.median(v for v, _ in spread):.0f} % | "
                       f"{100 * worst[0]:.0f} % ({worst[1]}) |")
    return out if len(out) > 2 else []


def parse_specs(s: str) -> list[tuple[str, int]]:
    out = []
    for item in filter(None, s.split(",")):
        d, _, k = item.partition(":")
        if d not in ("model", "prompt-lookup", *OURS_ONLY) or not k.isdigit():
            raise SystemExit(f"--spec items are drafter:k with drafter model, prompt-lookup or (ours only) "
                             f"{', '.join(OURS_ONLY)}, got {item!r}")
        out.append((d, int(k)))
    return out


def _table_head(label: str) -> list[str]:
    return [f"| {label} | our best (tok/s) | best peer (tok/s) | ours / peer | auto / our plain "
            "| auto / our best fixed |", "|---|---|---|---|---|---|"]


def _comparison_row(label: str, tok: dict[str, float], names: list[str]) -> str:
    """One line of the comparison tables: our best configuration vs the best peer configuration, and auto against
    our plain and our best fixed configuration (``tok``: decode tok/s per configuration)."""
    ours = [n for n in names if n.startswith("ours")]  # "ours ..." and every --also bundle's "ours[...] ..."
    peers = [n for n in names if not n.startswith("ours")]
    # auto is judged against the fixed configurations of its own bundle (it cannot switch bundles)
    fixed = [n for n in ours if n.startswith("ours ") and not n.startswith(("ours auto", "ours hybrid"))]
    autos = [n for n in ours if n.startswith("ours auto")]
    ob = max(ours, key=tok.get)
    pb = max(peers, key=tok.get) if peers else None
    best_fixed = max(tok[n] for n in fixed)
    auto = max((tok[n] for n in autos), default=float("nan"))
    peer = f"{pb} {tok[pb]:.1f}" if pb else "—"
    ratio = f"{tok[ob] / tok[pb]:.2f}×" if pb else "—"
    return (f"| {label} | {ob} {tok[ob]:.1f} | {peer} | {ratio} | {auto / tok['ours plain']:.2f}× | "
            f"{auto / best_fixed:.2f}× |")


def per_prompt_table(rows: list[dict], names: list[str]) -> list[str]:
    """Per prompt: our best configuration vs the best peer configuration, and auto against our plain and our best
    fixed configuration."""
    return _table_head("prompt") + [_comparison_row(r["id"], {n: r[n]["decode_tok_s"] for n in names}, names)
                                    for r in rows]


def per_suite_table(rows: list[dict], names: list[str]) -> list[str]:
    """Per suite, one configuration for all its prompts (what a user picks for a kind of work): each configuration's
    speed over the suite is its decoded tokens over its decode time, summed over the prompts (time-weighted, so a
    configuration that wins one prompt and crawls on another is not the suite's best), then compared as per prompt.
    """
    suites: dict[str, list[dict]] = {}
    for r in rows:
        suites.setdefault(r["id"].rsplit("-", 1)[0], []).append(r)
    out = _table_head("suite (prompts)")
    for suite, rs in suites.items():
        tok = {}
        for n in names:
            tokens = [max(r[n]["new_tokens"] - 1, 0) for r in rs]
            if any(t and r[n]["decode_tok_s"] <= 0 for t, r in zip(tokens, rs)):  # failed on a prompt: no speed
                tok[n] = 0.0
                continue
            seconds = sum(t / r[n]["decode_tok_s"] for t, r in zip(tokens, rs))
            tok[n] = sum(tokens) / seconds if seconds else 0.0
        out.append(_comparison_row(f"{suite} ({len(rs)})", tok, names))
    return out


def main() -> None:
    # a benchmark times its own steps: auto starts from this process's measurement, not a kept one
    os.environ.setdefault("SPECEDGE_COST_CACHE", "off")
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("bundle")
    ap.add_argument("--peers", default="hf", help="comma list of hf, llamacpp (llama-cpp-python), llamacpp-native "
                                                  "(llama.cpp's own binaries, tools/build_llama_cpp.sh), ortgenai "
                                                  "(onnxruntime-genai, tools/build_ortgenai.py); '' for ours only")
    ap.add_argument("--ortgenai-ngram-size", type=int, default=3,
                    help="onnxruntime-genai n-gram decoding's ngram_size N (2-16: match the last N-1 tokens)")
    ap.add_argument("--ortgenai-genai-defaults", action="store_true",
                    help="build onnxruntime-genai's models with its builder's own lm_head/embedding formats "
                         "instead of the bundle's")
    ap.add_argument("--spec", default="model:4", help="our (and the peers') speculative configs, drafter:k,...")
    ap.add_argument("--suite", default="code,chat")
    ap.add_argument("--per-suite", type=int, default=2)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=1,
                    help="run every prompt on every engine this many times (each round interleaves the engines "
                         "prompt by prompt) and report per-prompt medians (a shared VM's speed drifts by +-20 %%)")
    ap.add_argument("--also", action="append", default=[], metavar="BUNDLE",
                    help="our runtime on another bundle of the same model too (e.g. another weight form), in the same "
                         "rounds, with the same --spec; its rows are named ours[DIRNAME] and compared with its own "
                         "plain output (repeatable)")
    ap.add_argument("--out", default="bench/peers")
    a = ap.parse_args()
    if a.rounds < 1:
        ap.error(f"--rounds must be >= 1, got {a.rounds}")
    specs = parse_specs(a.spec)
    peer_specs = [(d, k) for d, k in specs if d not in OURS_ONLY]
    prompts = suite_prompts(a.suite.split(","), a.per_suite)
    machine = machine_info()
    from tokenizers import Tokenizer

    peers = [p for p in a.peers.split(",") if p]  # --peers '': ours only (several bundles with --also)
    unknown = sorted(set(peers) - {"hf", "llamacpp", "llamacpp-native", "ortgenai"})
    if unknown:
        raise SystemExit(f"--peers {','.join(unknown)}: unknown; choose from hf, llamacpp, llamacpp-native, ortgenai")
    ours = Ours(a.bundle, prompts, specs, a.max_new_tokens)
    engines: list = [ours]
    for other in a.also:
        engines.append(Ours(other, prompts, specs, a.max_new_tokens, f"ours[{Path(other).name}]"))
        if engines[-1].ids_list != ours.ids_list:
            raise SystemExit(f"--also {other}: its tokenizer or chat template gives other prompt ids than "
                             f"{a.bundle}'s; compare bundles of the same model")
    manifest, ids_list = ours.manifest, ours.ids_list
    tok = Tokenizer.from_file(str(Path(a.bundle) / manifest.tokenizer.file))
    texts = [tok.decode(ids, skip_special_tokens=False) for ids in ids_list]  # the same prompt, as text
    versions = {}
    if "llamacpp-native" in peers:
        engines.append(LlamaNative(manifest, ids_list, texts, peer_specs, a.max_new_tokens))
    if "ortgenai" in peers:
        engines.append(OrtGenai(manifest, ids_list, peer_specs, a.max_new_tokens, a.ortgenai_ngram_size,
                                a.ortgenai_genai_defaults))
    for e in engines[len(a.also) + 1:]:
        versions.update(e.versions)
    units = [(e, c) for e in engines for c in e.configs]
    rounds: list[list[dict]] = []
    for r in range(a.rounds):
        if a.rounds > 1:
            say(f"round {r + 1}/{a.rounds}")
        rows = [{"id": p.id, "prompt_tokens": len(ids)} for p, ids in zip(prompts, ids_list)]
        for i, (engine, cfg) in interleaved(units, len(prompts), r):
            engine.run(i, cfg, rows)
        for peer in [p for p in peers if p in ("hf", "llamacpp")]:  # Python peers: in a block after the round
            versions.update({"hf": run_hf, "llamacpp": run_llamacpp}[peer](manifest, ids_list, peer_specs,
                                                                           a.max_new_tokens, rows))
        rounds.append(rows)
    for e in engines:
        e.close()
    rows = merge_rounds(rounds)
    for e in engines:
        if hasattr(e, "notes"):
            e.notes(rows)
    names = [k for k in rows[0] if isinstance(rows[0][k], dict)]
    for row in rows:
        for n in names:
            engine = n.rsplit(" ", 1)[0]
            if engine.startswith("ours["):  # another bundle's weights: the same text as its own plain decoding
                row[n]["identical_to_ours_plain"] = row[n]["ids"] == row[f"{engine} plain"]["ids"]
            elif row[n]["ids"] is not None:
                row[n]["identical_to_ours_plain"] = row[n]["ids"] == row["ours plain"]["ids"]
            elif row[n].get("text") is not None:  # llama.cpp's binaries print text: compare the common length
                ours = tok.decode(row["ours plain"]["ids"])
                m = min(len(ours), len(row[n]["text"]))
                row[n]["identical_to_ours_plain"] = m > 0 and ours[:m] == row[n]["text"][:m]
            else:
                row[n]["identical_to_ours_plain"] = None
    med = {n: statistics.median(r[n]["decode_tok_s"] for r in rows) for n in names}
    t = manifest.target
    lines = [
        f"Machine: {machine['cpu']} ({machine.get('cpu_flags', '')}), {machine['cpus']} CPUs, "
        f"copy bandwidth {machine['copy_bandwidth_gbs']} GB/s; "
        f"onnxruntime {machine['onnxruntime']}; " + ", ".join(f"{k} {v}" for k, v in versions.items()) + ".",
        f"Bundle `{a.bundle}` (target {t.precision}, kv_mode {manifest.kv_mode}); source "
        f"`{Path(t.source.get('path', '')).name}`; greedy; max_new_tokens {a.max_new_tokens}; "
        f"prompts {', '.join(r['id'] for r in rows)}"
        + "".join(f"; ours[{Path(o).name}]: `{o}`" for o in a.also)
        + (f"; {a.rounds} rounds, every speed the per-prompt median." if a.rounds > 1 else "."), "",
        "| engine / config | decode tok/s, median (per prompt) | vs ours plain | vs the same engine's plain "
        "| output identical to ours plain (ours[...]: to its own plain) |", "|---|---|---|---|---|"]
    for n in names:
        engine = n.rsplit(" ", 1)[0]
        base = med.get(f"{engine} plain", float("nan"))
        known = [r[n]["identical_to_ours_plain"] for r in rows if r[n]["identical_to_ours_plain"] is not None]
        same = f"{sum(known)}/{len(known)}" if known else "not compared"
        per_prompt = ", ".join(f"{r[n]['decode_tok_s']:.1f}" for r in rows)
        lines.append(f"| {n} | **{med[n]:.2f}** ({per_prompt}) | "
                     f"{med[n] / med['ours plain']:.2f}× | {med[n] / base:.2f}× | {same} |")
    lines += ["", *per_prompt_table(rows, names), "", *per_suite_table(rows, names)]
    spread = spread_table(rows, names)
    if spread:
        lines += ["", "Round to round, the same prompt (a fixed configuration's spread is the machine's):", "", *spread]
    notes = list(dict.fromkeys(NOTES))  # every round adds the same ones
    if notes:
        lines += ["", *(f"* {n}" for n in notes)]
    md = "\n".join(lines) + "\n"
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "peers.json").write_text(json.dumps({"machine": machine, "versions": versions, "args": vars(a),
                                                 "notes": notes, "rows": rows}, indent=1))
    (out / "peers.md").write_text(md)
    print(md)


if __name__ == "__main__":
    main()
