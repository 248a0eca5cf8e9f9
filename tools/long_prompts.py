#!/usr/bin/env python3
"""Long prompts end to end: an edit of a whole source file, and a question over several thousand tokens, decoded
greedily by each drafter; every drafter's tokens must be plain decoding's, and each one's speed is set beside plain.

    python tools/long_prompts.py engines/qwen32k [--file runtime/sampling.py --rename process_logits=shape_logits]
        [--question-tokens 6000] [--max-new-tokens 256] [--drafters none,prompt-lookup,auto]

The edit: the file given whole, a rename asked, the whole file asked back (what prompt lookup is for). The question:
about ``--question-tokens`` tokens of the project's own sources, then a question about them. Each request runs
after the previous one of the same prompt, so its prompt's rows are reused (the first request pays the prefill:
its TTFT is reported); decode tok/s counts from the first token on. Exit status 1 if any drafter's text differs
from plain decoding's.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from specedge.runtime import SamplingParams, SpecDecoder
from specedge.runtime.bench.runner import machine_info

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).resolve().parent))
from long_context import long_prompt  # noqa: E402


def edit_prompt(path: Path, old: str, new: str) -> list[dict]:
    code = path.read_text(encoding="utf-8")
    if old not in code:
        raise SystemExit(f"{path} has no {old!r} to rename")
    return [{"role": "user", "content": f"Here is a Python file, {path.name}:\n\n```python\n{code}```\n\nRename "
                                        f"`{old}` to `{new}` everywhere in it (the definition and every use) and "
                                        "reply with the whole file, changed, in one code block and nothing else."}]


def question_prompt(dec: SpecDecoder, tokens: int) -> list[dict]:
    return [{"role": "user", "content": "Here is some Python source code:\n\n```python\n" + long_prompt(dec, tokens)
             + "```\n\nWhich functions above read the KV cache, and what does each one do with it? Quote the "
               "relevant lines."}]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("bundle")
    ap.add_argument("--file", type=Path, default=ROOT / "runtime" / "sampling.py")
    ap.add_argument("--rename", default="process_logits=shape_logits", help="OLD=NEW")
    ap.add_argument("--question-tokens", type=int, default=6000, help="0: no question prompt")
    ap.add_argument("--max-new-tokens", type=int, default=256)
    ap.add_argument("--drafters", default="none,prompt-lookup,auto")
    a = ap.parse_args()
    old, sep, new = a.rename.partition("=")
    if not sep or not old or not new:
        ap.error(f"--rename {a.rename!r}: OLD=NEW")
    drafters = [d for d in a.drafters.split(",") if d]
    if drafters[:1] != ["none"]:
        drafters = ["none", *[d for d in drafters if d != "none"]]  # plain first: the reference
    dec = SpecDecoder.load(a.bundle)
    m, info = dec.manifest, machine_info()
    print(f"Machine: {info['cpu']} ({info.get('cpu_flags', '')}), {info['cpus']} CPUs; onnxruntime "
          f"{info['onnxruntime']}")
    print(f"Bundle: {a.bundle}: KV {m.kv_dtype}, S_max {m.max_context}, K={m.k}; greedy, {a.max_new_tokens} new "
          "tokens a request")
    prompts = [("edit", edit_prompt(a.file, old, new))]
    if a.question_tokens:
        prompts.append(("question", question_prompt(dec, a.question_tokens)))
    params = SamplingParams(max_new_tokens=a.max_new_tokens)
    print("\n| prompt | prompt tokens | drafter | TTFT s | decode tok/s | vs plain | accepted / drafted | "
          "tokens as plain's |")
    print("|---|---|---|---|---|---|---|---|")
    differ = 0
    for name, messages in prompts:
        if not m.tokenizer.chat_template:  # a base model's file: the messages' text as it is
            messages = "\n".join(x["content"] for x in messages)
        n = len(dec.encode_prompt(messages))
        if n + a.max_new_tokens > m.max_context:
            raise SystemExit(f"{name}: {n} + {a.max_new_tokens} tokens do not fit S_max={m.max_context}")
        plain = None
        for d in drafters:
            r = dec.generate(messages, params, drafter=d)
            s = r.stats
            if plain is None:
                plain = r
            same = r.token_ids == plain.token_ids
            differ += not same
            print(f"| {name} | {n} | {d} | {s.ttft_s:.2f} | {s.decode_tok_s:.1f} | "
                  f"{s.decode_tok_s / plain.stats.decode_tok_s:.2f}× | {s.accepted} / {s.drafted} | "
                  f"{'yes' if same else 'NO'} ({len(r.token_ids)}) |", flush=True)
    dec.close()
    return 1 if differ else 0


if __name__ == "__main__":
    sys.exit(main())
