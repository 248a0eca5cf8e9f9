#!/usr/bin/env python3
"""Replicas on Ray: aggregate throughput of `spec-run serve --ray` with one replica against two, in one run.

    python tools/bench_ray.py BUNDLE [--prompts configs/mixed_prompts.jsonl] [--replicas 1,2] [--concurrency 4]
        [--requests 12] [--max-new-tokens 96] [--replica-cpus 1] [--rounds 2] [--out bench-ray]

Starts a local Ray cluster on loopback, one node per replica of the most replicas asked for, each node
``--replica-cpus`` CPUs (``ray start --head`` and ``ray start --address``, as on real machines), then for every round
and replica count (the order reversed every other round) deploys the bundle with that many replicas (one decoder
thread per CPU), warms each replica, and sends the same ``--requests`` streaming chat requests from ``--concurrency``
clients (``tools/bench_concurrency.py``'s load: greedy, each load's prompts salted so no replica's prefix cache
helps). The control, in the same rounds: as many independent `spec-run serve` processes, the clients split between
them by hand, which is what the machine allows without Ray. Reports per replica count the median round's aggregate
tok/s (all completion tokens / the load's wall time), TTFT and TPOT, and the ratio to one Ray replica; writes
``results.json`` and ``report.md`` to ``--out``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_concurrency import ServerProcess, free_port, load  # noqa: E402 - the same load generator and servers


def split_load(ports: list[int], model: str, prompts: list, c: int, n: int, max_tokens: int, salt: str) -> dict:
    """The control: the same load spread by hand over independent single-process servers (client u sends to
    server u mod len(ports), the requests split alike), so what Ray adds shows against what the machine allows."""
    import threading

    parts: list[dict] = [{} for _ in ports]

    def run(i: int) -> None:
        share_c = len(range(i, c, len(ports)))
        share_n = len(range(i, n, len(ports)))
        parts[i] = load(ports[i], model, prompts[i:] + prompts[:i], share_c, share_n, max_tokens, {},
                        salt=f"{salt}-{i}")

    t0 = time.perf_counter()
    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(ports))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    tokens = sum(p["tokens"] for p in parts)
    tpots = [p["tpot_mean_s"] for p in parts if p.get("tpot_mean_s")]
    return {"tokens": tokens, "wall_s": wall, "tok_s": tokens / wall, "errors": sum((p["errors"] for p in parts), []),
            "ttft_mean_s": statistics.mean(p["ttft_mean_s"] for p in parts),
            "tpot_mean_s": statistics.mean(tpots) if tpots else None}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("bundle")
    ap.add_argument("--prompts", default="configs/mixed_prompts.jsonl")
    ap.add_argument("--replicas", default="1,2")
    ap.add_argument("--concurrency", type=int, default=4, help="clients sending requests at once")
    ap.add_argument("--requests", type=int, default=12)
    ap.add_argument("--max-new-tokens", type=int, default=96)
    ap.add_argument("--replica-cpus", type=int, default=1)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--no-control", action="store_true",
                    help="skip the control: as many independent `spec-run serve --threads CPUS` processes, the "
                         "clients split between them by hand")
    ap.add_argument("--out", default="bench-ray")
    a = ap.parse_args()

    from ray import serve

    from specedge.runtime.bench.runner import machine_info
    from specedge.runtime.bench.suites import load_prompts
    from specedge.runtime.serve_ray import RayOptions, serve_on_ray, start_local_cluster, stop_local_cluster

    counts = sorted({int(x) for x in a.replicas.split(",")})
    items = load_prompts(a.prompts)
    prompts = [p.prompt if isinstance(p.prompt, str) else p.prompt[-1]["content"] for p in items]
    m = machine_info()
    model = Path(a.bundle).resolve().name
    print(f"machine: {m['cpu']} ({m['cpu_flags']}), {m['cpus']} CPUs; bundle {a.bundle}; {len(prompts)} prompts, "
          f"{a.requests} requests from {a.concurrency} clients, max_tokens {a.max_new_tokens}; replicas "
          f"{counts}, {a.replica_cpus} CPUs each", flush=True)
    out_dir = Path(a.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    address, nodes = start_local_cluster(max(counts), a.replica_cpus, ray=str(Path(sys.executable).with_name("ray")))
    runs: dict[int, list[dict]] = {n: [] for n in counts}
    control: dict[int, list[dict]] = {n: [] for n in counts}
    port = free_port()
    try:
        for r in range(a.rounds):
            for n in (counts if r % 2 == 0 else counts[::-1]):
                t0 = time.perf_counter()
                serve_on_ray(a.bundle, RayOptions(address=address, replicas=n, replica_cpus=a.replica_cpus),
                             port=port, serve_kw={"max_batch": 1, "max_queue": 64}, blocking=False)
                for i in range(2 * n):  # every replica's first request (its step costs, its warm-up)
                    load(port, model, prompts, 1, 1, 8, {}, salt=f"warm{r}-{n}-{i}")
                res = load(port, model, prompts, a.concurrency, a.requests, a.max_new_tokens, {},
                           salt=f"round{r}-{n}")
                res.pop("texts")
                runs[n].append(res)
                setup = time.perf_counter() - t0 - res["wall_s"]
                print(f"round {r} replicas {n}: {res['tok_s']:.1f} tok/s aggregate, TTFT {res['ttft_mean_s']:.2f} s, "
                      f"{len(res['errors'])} errors (deployed and warmed in {setup:.0f} s)", flush=True)
                serve.delete("specedge")
                if a.no_control:
                    continue
                spec_run = str(Path(sys.executable).with_name("spec-run"))
                servers = []
                try:
                    for i in range(n):
                        p = free_port()
                        servers.append(ServerProcess([spec_run, "serve", a.bundle, "--port", str(p), "--threads",
                                                      str(a.replica_cpus), "--max-batch", "1", "--max-queue", "64",
                                                      "--log-level", "warning"], p, f"control-{i}",
                                                     out_dir / f"control-{i}.log"))
                    ports = [x.port for x in servers]
                    for i, p in enumerate(ports):
                        load(p, model, prompts, 1, 1, 8, {}, salt=f"warmc{r}-{n}-{i}")
                    res = split_load(ports, model, prompts, a.concurrency, a.requests, a.max_new_tokens,
                                     salt=f"roundc{r}-{n}")
                finally:
                    for x in servers:
                        x.stop()
                control[n].append(res)
                print(f"round {r} processes {n} (control): {res['tok_s']:.1f} tok/s aggregate", flush=True)
    finally:
        serve.shutdown()
        import ray

        ray.shutdown()
        stop_local_cluster(nodes)
    out = out_dir
    med = {n: sorted(rs, key=lambda x: x["tok_s"])[len(rs) // 2] for n, rs in runs.items()}
    base = med[counts[0]]["tok_s"]
    lines = [f"Machine: {m['cpu']} ({m['cpu_flags']}), {m['cpus']} CPUs. Bundle `{a.bundle}`; {a.requests} greedy "
             f"streaming chat requests of up to {a.max_new_tokens} tokens from {a.concurrency} clients "
             f"({a.prompts}); {a.replica_cpus} CPUs per replica; median of {a.rounds} rounds.", "",
             "| system | replicas | aggregate tok/s | x one Ray replica | TTFT s | TPOT ms | errors |",
             "|---|---|---|---|---|---|---|"]
    for name, table in (("ray", runs), ("processes (control)", control)):
        for n in counts:
            if not table[n]:
                continue
            x = sorted(table[n], key=lambda y: y["tok_s"])[len(table[n]) // 2]
            tpot = f"{x['tpot_mean_s'] * 1e3:.0f}" if x["tpot_mean_s"] else "-"
            lines.append(f"| {name} | {n} | {x['tok_s']:.1f} | {x['tok_s'] / base:.2f} | {x['ttft_mean_s']:.2f} | "
                         f"{tpot} | {len(x['errors'])} |")
    (out / "report.md").write_text("\n".join(lines) + "\n")
    (out / "results.json").write_text(json.dumps({"machine": m, "runs": {str(k): v for k, v in runs.items()},
                                                  "control": {str(k): v for k, v in control.items()},
                                                  "args": vars(a)}, indent=1))
    print("\n".join(lines))
    print("all rounds:", {n: [round(x["tok_s"], 1) for x in rs] for n, rs in runs.items()},
          "median ratio", round(statistics.median(x["tok_s"] for x in runs[counts[-1]]) / base, 2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
