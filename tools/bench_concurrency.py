#!/usr/bin/env python3
"""Many users at once: `spec-run serve --max-batch` against llama.cpp's `llama-server -np`, in one run.

    python tools/bench_concurrency.py BUNDLE --gguf TARGET [--draft-gguf DRAFT] [--concurrency 1,2,4,8]
        [--prompts FILE | --suites code,chat,edit,summarize,json] [--requests 16] [--max-new-tokens 128]
        [--system FILE] [--threads 2] [--rounds 2] [--drafter auto] [--baseline-bundle B] [--no-llama] [--out DIR]

TARGET and DRAFT are the GGUF files llama-server runs (the bundle's own sources: a name `spec-export fetch` knows or
a path). Each system is a server process of its own on loopback. Every server starts (one at a time) and is warmed
up with one request before any load; then the loads run one at a time, interleaved: per round, per concurrency, per
system (the order reversed every other round), and the round of median aggregate speed is reported:

* ``specedge``: ``spec-run serve BUNDLE --max-batch <most concurrency>`` (requests decoded together), and
  ``specedge-1``: ``--max-batch 1`` (one request at a time), at concurrency 1 only: the single-user baseline.
* ``llama-server -np N`` per concurrency N (continuous batching, N slots, the context per slot the bundle's), and
  with ``--draft-gguf`` ``llama-server -np N -md DRAFT`` (a draft context per slot, --spec-draft-n-max = the
  bundle's K).

At every concurrency c the same ``--requests`` streaming chat requests are sent (greedy, ``max_tokens`` =
``--max-new-tokens``; request i is prompt i of the list, cycled), by c clients each sending its share one after
another (client u: requests u, u+c, u+2c, ...): every system and concurrency decodes the same requests. Per
request, from the client: time to first token (request sent -> first content chunk), time per output token
((last chunk - first chunk) / (tokens - 1), tokens from the response's usage). With ``--system FILE`` every
request's messages start with that file's text as a system message, as an application's fixed instructions do.
Per system and concurrency: aggregate tok/s (all completion tokens / wall time of the whole load), mean TTFT and
TPOT. Every load starts its messages with a salt of its own (the system message's, with ``--system``), so no prompt
is found in a server's prefix cache from an earlier load: each load pays for its prompts as new requests do, and
within a load a server may reuse what its requests share. Last, a check: the same requests (one salt) alone and at
the most concurrency, on ``specedge`` and on the llama-servers with that many slots: does each text stay what it is
alone (specedge: every request's tokens are its tokens alone; llama-server's batched kernels give no such promise)?
Writes
``results.json``, ``report.md`` and, with matplotlib, ``concurrency.png`` to ``--out`` (default bench-concurrency/).
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def post_stream(port: int, body: dict, timeout: float = 900) -> dict[str, Any]:
    """One streaming chat completion: its text, completion tokens and client-side times."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    t0 = time.perf_counter()
    conn.request("POST", "/v1/chat/completions", json.dumps(body), {"Content-Type": "application/json"})
    resp = conn.getresponse()
    if resp.status != 200:
        raise RuntimeError(f"HTTP {resp.status}: {resp.read()[:300]!r}")
    first = last = None
    text, usage = [], None
    for raw in resp:
        line = raw.decode().strip()
        if not line.startswith("data:"):
            continue
        data = line[5:].strip()
        if data == "[DONE]":
            break
        ch = json.loads(data)
        if ch.get("usage"):
            usage = ch["usage"]
        for c in ch.get("choices") or []:
            piece = (c.get("delta") or {}).get("content")
            if piece:
                now = time.perf_counter()
                first = first if first is not None else now
                last = now
                text.append(piece)
    conn.close()
    t_end = time.perf_counter()
    n = (usage or {}).get("completion_tokens")
    if n is None:
        raise RuntimeError("the server's stream carried no usage (stream_options.include_usage)")
    first = first if first is not None else t_end
    return {"text": "".join(text), "tokens": n, "ttft": first - t0,
            "tpot": (last - first) / (n - 1) if n > 1 and last is not None else None, "t0": t0, "t_end": t_end}


class ServerProcess:
    def __init__(self, argv: list[str], port: int, name: str, log: Path):
        self.name, self.port = name, port
        self.log = open(log, "w")
        self.proc = subprocess.Popen(argv, stdout=self.log, stderr=subprocess.STDOUT, start_new_session=True)
        deadline = time.time() + 900
        while time.time() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{name} exited with {self.proc.returncode} while starting; see {log}")
            try:
                c = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
                c.request("GET", "/health")
                if c.getresponse().status == 200:
                    return
            except OSError:
                pass
            time.sleep(0.5)
        self.stop()
        raise RuntimeError(f"{name} did not answer /health in 15 minutes; see {log}")

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGINT)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        self.log.close()


def load(port: int, model: str, prompts: list[Any], c: int, n: int, max_tokens: int,
         extra: dict, salt: str = "", system: str = "") -> dict[str, Any]:
    """n requests sent by c users, each sending its share one after another; their results and the wall time.
    ``salt`` starts every message (``[salt]`` and a space; the ``system`` message, where there is one): a load with a
    salt of its own finds none of its prompts in a server's prefix cache, so it pays for every prompt as new requests
    do."""
    results: list[list[dict]] = [[] for _ in range(c)]
    errors: list[str] = []

    def user(u: int) -> None:
        for j in range(u, n, c):
            i = j % len(prompts)
            first = system or prompts[i]
            first = f"[{salt}] {first}" if salt else first
            messages = ([{"role": "system", "content": first}, {"role": "user", "content": prompts[i]}] if system
                        else [{"role": "user", "content": first}])
            body = {"model": model, "messages": messages, "temperature": 0,
                    "max_tokens": max_tokens, "stream": True, "stream_options": {"include_usage": True}, **extra}
            try:
                r = post_stream(port, body)
            except Exception as e:  # noqa: BLE001 - reported with the result
                errors.append(f"user {u} prompt {i}: {e}")
                return
            r["prompt"] = j
            results[u].append(r)

    t0 = time.perf_counter()
    threads = [threading.Thread(target=user, args=(u,)) for u in range(c)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    flat = [r for rs in results for r in rs]
    if not flat:
        raise RuntimeError(f"every request failed: {errors[:3]}")
    tokens = sum(r["tokens"] for r in flat)
    tpots = [r["tpot"] for r in flat if r["tpot"] is not None]
    return {"concurrency": c, "requests": len(flat), "errors": errors, "tokens": tokens, "wall_s": wall,
            "tok_s": tokens / wall if wall > 0 else 0.0, "ttft_mean_s": statistics.mean(r["ttft"] for r in flat),
            "tpot_mean_s": statistics.mean(tpots) if tpots else None,
            "user_tok_s": statistics.mean(1 / t for t in tpots) if tpots else None,
            "texts": {str(r["prompt"]): r["text"] for r in flat}}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("bundle")
    ap.add_argument("--gguf", required=True, help="the target's GGUF for llama-server (a fetch name or a path)")
    ap.add_argument("--draft-gguf", default=None, help="the draft's GGUF: llama-server -md runs too")
    ap.add_argument("--concurrency", default="1,2,4,8")
    ap.add_argument("--prompts", default=None, help="a JSONL prompts file (spec-run bench's format)")
    ap.add_argument("--suites", default="code,chat,edit,summarize,json")
    ap.add_argument("--system", default=None, help="a text file: every request's system message (an application's "
                                                   "fixed instructions)")
    ap.add_argument("--requests", type=int, default=16, help="requests sent at every concurrency")
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=2, help="interleaved rounds (the median round is reported)")
    ap.add_argument("--drafter", default="auto", help="specedge's drafter (speculation.drafter)")
    ap.add_argument("--baseline-bundle", default=None,
                    help="another bundle served with --max-batch 1 at concurrency 1 (`baseline-1`): e.g. the same "
                         "models exported with --kv-mode ort-inplace, single-stream decoding as it was")
    ap.add_argument("--no-llama", action="store_true", help="specedge only")
    ap.add_argument("--systems", default=None, help="a comma-separated subset of the systems to run")
    ap.add_argument("--out", default="bench-concurrency")
    a = ap.parse_args()

    from specedge.export.fetch import resolve_model
    from specedge.runtime.bench.runner import machine_info
    from specedge.runtime.bench.suites import load_prompts, suite_prompts
    from specedge.runtime.manifest import read_manifest

    levels = sorted({int(x) for x in a.concurrency.split(",")})
    items = load_prompts(a.prompts) if a.prompts else suite_prompts(a.suites.split(","))
    prompts = [p.prompt if isinstance(p.prompt, str) else p.prompt[-1]["content"] for p in items]
    try:
        system = Path(a.system).read_text().strip() if a.system else ""
    except OSError as e:
        ap.error(f"cannot read --system {a.system}: {e.strerror}")
    man = read_manifest(Path(a.bundle), verify="none")
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    m = machine_info()
    print(f"machine: {m['cpu']} ({m['cpu_flags']}), {m['cpus']} CPUs; bundle {a.bundle} (kv_mode {man.kv_mode}, "
          f"K={man.k}); {len(prompts)} prompts, {a.requests} requests at every concurrency, max_tokens "
          f"{a.max_new_tokens}, {a.threads} threads", flush=True)
    spec_run = shutil.which("spec-run") or str(Path(sys.executable).with_name("spec-run"))
    systems: list[tuple[str, list[int], Any]] = [
        ("specedge", levels, lambda port, c: [spec_run, "serve", a.bundle, "--port", str(port), "--threads",
                                              str(a.threads), "--max-batch", str(max(levels)), "--log-level",
                                              "warning", "--max-queue", "64"]),
        ("specedge-1", [1], lambda port, c: [spec_run, "serve", a.bundle, "--port", str(port), "--threads",
                                             str(a.threads), "--max-batch", "1", "--log-level", "warning"]),
    ]
    if a.baseline_bundle:
        systems.append(("baseline-1", [1], lambda port, c: [spec_run, "serve", a.baseline_bundle, "--port", str(port),
                                                            "--threads", str(a.threads), "--max-batch", "1",
                                                            "--log-level", "warning"]))
    if not a.no_llama:
        bin_dir = Path(os.environ.get("SPECEDGE_LLAMA_BIN") or subprocess.run(
            ["bash", str(Path(__file__).with_name("build_llama_cpp.sh"))], check=True, capture_output=True,
            text=True).stdout.strip())
        server = str(bin_dir / "llama-server")
        target = str(resolve_model(a.gguf))

        def llama(port: int, c: int, draft: str | None = None) -> list[str]:
            argv = [server, "-m", target, "--port", str(port), "--host", "127.0.0.1", "-t", str(a.threads),
                    "-tb", str(a.threads), "-np", str(c), "-c", str(c * man.max_context), "--no-webui"]
            if draft:
                argv += ["-md", draft, "--spec-draft-n-max", str(man.k), "--spec-draft-n-min", "0", "-td",
                         str(a.threads)]
            return argv

        for lv in levels:
            systems.append((f"llama-server -np {lv}", [lv], lambda port, c: llama(port, c)))
        if a.draft_gguf:
            draft = str(resolve_model(a.draft_gguf))
            for lv in levels:
                systems.append((f"llama-server -np {lv} -md", [lv], lambda port, c, d=draft: llama(port, c, d)))
    if a.systems:
        keep = {s.strip() for s in a.systems.split(",")}
        systems = [s for s in systems if s[0] in keep or s[0].split(" -np")[0] + (" -md" if s[0].endswith("-md")
                                                                                    else "") in keep]
    # Every server up front, idle but one at a time, then the loads interleaved: for each round, each concurrency,
    # each system that serves it (the order of the systems reversed every other round). A shared VM's speed drifts by
    # tens of percent within minutes: loads timed in blocks minutes apart would say when each ran, not which is faster.
    servers: list[tuple[str, list[int], ServerProcess, str, dict]] = []
    runs: dict[tuple[str, int], list[dict]] = {}
    checks: dict[str, str] = {}
    try:
        for name, cs, argv in systems:
            port = free_port()
            print(f"{name}: starting …", flush=True)
            srv = ServerProcess(argv(port, max(cs)), port, name, out / f"{name.replace(' ', '_')}.log")
            ours = name.startswith(("specedge", "baseline"))
            extra = {"speculation": {"drafter": a.drafter}} if ours else {}
            model = Path(a.baseline_bundle if name == "baseline-1" else a.bundle).resolve().name if ours else "m"
            servers.append((name, cs, srv, model, extra))
            load(port, model, prompts[:1], 1, 1, 16, extra, system=system)  # warm-up (specedge: auto's step timings)
        for rnd in range(a.rounds):
            for c in levels:
                for name, cs, srv, model, extra in (servers if rnd % 2 == 0 else servers[::-1]):
                    if c not in cs:
                        continue
                    r = load(srv.port, model, prompts, c, a.requests, a.max_new_tokens, extra, salt=f"{rnd}.{c}",
                             system=system)
                    r["system"], r["round"] = name, rnd
                    runs.setdefault((name, c), []).append(r)
                    print(f"  round {rnd + 1} {name} c={c}: {r['tok_s']:.1f} tok/s aggregate, per user "
                          f"{(r['user_tok_s'] or 0):.1f} tok/s, TTFT {r['ttft_mean_s']:.2f} s"
                          + (f", ERRORS {r['errors']}" if r["errors"] else ""), flush=True)
                    (out / "results.json").write_text(json.dumps(
                        {"machine": m, "args": vars(a), "runs": [x for v in runs.values() for x in v]}, indent=1))
        # the same requests alone and at the most concurrency (one salt): does each text stay what it is alone?
        check = min(a.requests, 2 * max(levels))
        for name, cs, srv, model, extra in servers:
            if max(cs) == max(levels) and len(cs) == 1 or name == "specedge":
                one = load(srv.port, model, prompts, 1, check, a.max_new_tokens, extra, salt="check", system=system)
                many = load(srv.port, model, prompts, max(levels), check, a.max_new_tokens, extra, salt="check",
                            system=system)
                same = sum(one["texts"][k] == t for k, t in many["texts"].items())
                checks[name] = f"{same}/{len(many['texts'])}"
                print(f"  {name}: {checks[name]} texts at {max(levels)} users as alone", flush=True)
    finally:
        for *_, srv, _, _ in servers:
            srv.stop()
    results = [median_run(v) for v in runs.values()]
    for r in results:
        r["texts_as_alone"] = checks.get(r["system"]) if r["concurrency"] == max(levels) else None
    (out / "results.json").write_text(json.dumps({"machine": m, "args": vars(a), "results": results, "checks": checks,
                                                  "runs": [x for v in runs.values() for x in v]}, indent=1))
    report(results, m, a, out)
    return 0


def median_run(rs: list[dict]) -> dict:
    """The run of median aggregate speed among a system's rounds at one concurrency, with every round's speed."""
    best = sorted(rs, key=lambda r: r["tok_s"])[(len(rs) - 1) // 2]
    return {**best, "tok_s_rounds": [r["tok_s"] for r in rs],
            "texts_stable": all(r["texts"] == rs[0]["texts"] for r in rs)}


def report(results: list[dict], m: dict, a: argparse.Namespace, out: Path) -> None:
    def base(system: str) -> dict | None:
        return next((r for r in results if r["system"] == system and r["concurrency"] == 1), None)

    single = base("specedge-1") or base("specedge")
    lines = [f"machine: {m['cpu']}, {m['cpus']} CPUs, flags {m['cpu_flags']}; bundle {a.bundle}; "
             f"{a.requests} requests at every concurrency, max_tokens {a.max_new_tokens}, {a.threads} threads"
             + (f"; every request's system message: {Path(a.system).name}" if a.system else ""), "",
             "| system | users | aggregate tok/s | x specedge-1 alone | per-user tok/s | TPOT ms | TTFT s | "
             "texts as alone |", "|---|---|---|---|---|---|---|---|"]
    for r in results:
        same = r.get("texts_as_alone") or "-"
        ratio = r["tok_s"] / single["tok_s"] if single else float("nan")
        lines.append(f"| {r['system']} | {r['concurrency']} | {r['tok_s']:.1f} | {ratio:.2f} | "
                     f"{(r['user_tok_s'] or 0):.1f} | {1e3 * (r['tpot_mean_s'] or 0):.0f} | {r['ttft_mean_s']:.2f} | "
                     f"{same} |")
    text = "\n".join(lines) + "\n"
    (out / "report.md").write_text(text)
    print(text)
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 4))
    names = sorted({r["system"].split(" -np")[0] + (" -md" if r["system"].endswith("-md") else "") for r in results})
    for name in names:
        rs = sorted((r for r in results if (r["system"].split(" -np")[0] + (" -md" if r["system"].endswith("-md")
                                                                              else "")) == name),
                    key=lambda r: r["concurrency"])
        if len(rs) < 2 and name == "specedge-1":
            continue
        cs = [r["concurrency"] for r in rs]
        ax1.plot(cs, [r["tok_s"] for r in rs], marker="o", label=name)
        ax2.plot(cs, [r["user_tok_s"] or 0 for r in rs], marker="o", label=name)
    for ax, t in ((ax1, "aggregate tok/s"), (ax2, "per-user tok/s")):
        ax.set_xlabel("concurrent users")
        ax.set_ylabel(t)
        ax.set_xscale("log", base=2)
        ax.grid(alpha=0.3)
    ax1.legend()
    fig.suptitle(f"{Path(a.bundle).name}, {a.threads} threads, {m['cpu']}")
    fig.tight_layout()
    fig.savefig(out / "concurrency.png", dpi=110)


if __name__ == "__main__":
    sys.exit(main())
