#!/usr/bin/env python3
"""What a row-addressed step costs: rows of one sequence against SekAttention's step, and rows of many sequences.

    python tools/dev/rows_step_cost.py MODEL [--positions 512] [--slots 8] [--repeats 7] [--threads 2]

MODEL is what ``spec-export export --target`` takes (a name ``spec-export fetch`` knows, a GGUF, a Hugging Face
folder). Both graphs are built from it in the specedge form (int4, the lm_head as ``--lm-head auto`` takes it) into a
temporary folder, with every cache bound in place as the runtime binds it; every slot's cache holds ``--positions``
rows. Reported, the fastest of ``--repeats`` steps each: the single-sequence graph (``past_len``) and the
row-addressed graph for T rows of one sequence; and the row-addressed graph for one row from each of R sequences,
against one row of one: what decoding R users' plain rounds in one step would cost.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import onnxruntime as ort

from specedge.export.fetch import resolve_model
from specedge.export.graph import build_model_graph
from specedge.export.loaders import load_source
from specedge.export.quant import WeightFormat
from specedge.runtime.kernels import register
from specedge.runtime.manifest import ROWS_KV_MODE


class Bound:
    """One graph with its caches ([slots, H_kv, S, D] per layer) bound as past and present, inputs rebound per call."""

    def __init__(self, path: Path, dims, slots: int, positions: int, threads: int):
        so = ort.SessionOptions()
        so.intra_op_num_threads = threads
        so.add_session_config_entry("session.intra_op.allow_spinning", "1")
        register(so)
        self.sess = ort.InferenceSession(str(path), so, providers=["CPUExecutionProvider"])
        rng = np.random.default_rng(0)
        shape = (slots, dims.n_kv_heads, positions + 64, dims.head_dim)
        self.kv = [ort.OrtValue.ortvalue_from_numpy((rng.standard_normal(shape) * 0.1).astype(np.float32))
                   for _ in range(dims.n_layers * 2)]
        self.names = [f"{i}.{k}" for i in range(dims.n_layers) for k in ("key", "value")]

    def time(self, ids, repeats: int, **where) -> float:
        io = self.sess.io_binding()
        host = {"input_ids": np.asarray([ids], np.int64), "logits_at": np.arange(len(ids), dtype=np.int64)[None],
                **{k: np.asarray(v, np.int64) for k, v in where.items()}}
        for k, v in host.items():
            io.bind_cpu_input(k, v)
        for n, v in zip(self.names, self.kv):
            io.bind_ortvalue_input(f"past_key_values.{n}", v)
            io.bind_ortvalue_output(f"present.{n}", v)
        io.bind_output("logits")
        best = float("inf")
        for _ in range(repeats):
            t0 = time.perf_counter()
            self.sess.run_with_iobinding(io)
            best = min(best, time.perf_counter() - t0)
        return best


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model")
    ap.add_argument("--positions", type=int, default=512, help="rows every slot's cache holds before the step")
    ap.add_argument("--slots", type=int, default=8, help="sequences in the row-addressed graph's pool")
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--threads", type=int, default=2)
    a = ap.parse_args()
    src = load_source(resolve_model(a.model))
    fmt = WeightFormat("int4", form="specedge")  # the lm_head as the default export takes it (auto)
    P, N = a.positions, a.slots
    with tempfile.TemporaryDirectory() as tmp:
        print(f"building both graphs of {a.model} ...", file=sys.stderr)
        one = build_model_graph(src, Path(tmp), "one", fmt=fmt, kv_mode="ort-inplace", max_positions=P + 64)[0]
        rows = build_model_graph(src, Path(tmp), "rows", fmt=fmt, kv_mode=ROWS_KV_MODE, max_positions=P + 64)[0]
        d = src.config.dims
        g1, gr = Bound(one, d, 1, P, a.threads), Bound(rows, d, N, P, a.threads)
        print(f"{a.model}: {P} positions cached per sequence, {a.threads} threads, best of {a.repeats} (ms)")
        print(f"{'T rows of one sequence':28} {'past_len graph':>15} {'rows graph':>11}")
        for T in (1, 2, 5, 9):
            ids = list(range(10, 10 + T))
            t1 = g1.time(ids, a.repeats, past_len=[P])
            tr = gr.time(ids, a.repeats, row_slot=[0] * T, row_pos=list(range(P, P + T)))
            print(f"{T:28d} {t1 * 1e3:15.2f} {tr * 1e3:11.2f}")
        base = gr.time([10], a.repeats, row_slot=[0], row_pos=[P])
        print(f"{'one row from each of R sequences':34} {'ms':>6} {'x one row':>10} {'rows/s x one':>13}")
        for R in sorted({1, 2, 4, N}):
            t = gr.time(list(range(10, 10 + R)), a.repeats, row_slot=list(range(R)), row_pos=[P] * R)
            print(f"{R:34d} {t * 1e3:6.2f} {t / base:10.2f} {R * base / t:13.2f}")


if __name__ == "__main__":
    main()
