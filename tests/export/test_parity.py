"""Exported graphs match transformers (torch, the reference) on the same weights."""

from __future__ import annotations

import numpy as np
import onnxruntime as ort
import pytest

from specedge.export.graph import build_model_graph
from specedge.export.loaders import load_source

torch = pytest.importorskip("torch")  # the reference side: not in the fast tier's venv

S_MAX = 64


def _run(sess, dims, ids, past_len, kv, logits_at):
    feeds = {"input_ids": ids, "past_len": np.array([past_len]), "logits_at": logits_at[None], **kv}
    out = sess.run(None, feeds)
    return out[0][0], out[1:]


@pytest.mark.parametrize("family", ["tiny_llama", "tiny_qwen"])
def test_prefill_verify_decode_match_transformers(family, request, tmp_path):
    from transformers import AutoModelForCausalLM

    model_dir = request.getfixturevalue(family)
    src = load_source(model_dir)
    d = src.config.dims
    path, _, _ = build_model_graph(src, tmp_path, "m")
    sess = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    ref = AutoModelForCausalLM.from_pretrained(model_dir, torch_dtype=torch.float32).eval()
    ids = torch.randint(0, d.vocab, (1, 14), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        r = ref(ids, use_cache=True)
    ref_logits = r.logits[0].numpy()
    ref_k = [layer.keys[0].numpy() for layer in r.past_key_values.layers]
    ref_v = [layer.values[0].numpy() for layer in r.past_key_values.layers]
    kv = {f"past_key_values.{i}.{k}": np.zeros((1, d.n_kv_heads, S_MAX, d.head_dim), np.float32)
          for i in range(d.n_layers) for k in ("key", "value")}

    def commit(present, at, n):
        for i in range(d.n_layers):
            kv[f"past_key_values.{i}.key"][:, :, at:at + n] = present[2 * i][:, :, :n]
            kv[f"past_key_values.{i}.value"][:, :, at:at + n] = present[2 * i + 1][:, :, :n]

    # prefill chunk of 8 (all logits requested, to compare every row)
    logits, present = _run(sess, d, ids[:, :8].numpy(), 0, kv, np.arange(8))
    np.testing.assert_allclose(logits, ref_logits[:8], atol=1e-4)
    for i in range(d.n_layers):  # present rows are transformers' KV for those positions
        np.testing.assert_allclose(present[2 * i][0], ref_k[i][:, :8], atol=1e-5)
        np.testing.assert_allclose(present[2 * i + 1][0], ref_v[i][:, :8], atol=1e-5)
    commit(present, 0, 8)
    # verify step of 5 on top of the cache
    logits, present = _run(sess, d, ids[:, 8:13].numpy(), 8, kv, np.arange(5))
    np.testing.assert_allclose(logits, ref_logits[8:13], atol=1e-4)
    np.testing.assert_allclose(present[0][0], ref_k[0][:, 8:13], atol=1e-5)
    commit(present, 8, 5)
    # single decode step, logits only at the last position
    logits, _ = _run(sess, d, ids[:, 13:14].numpy(), 13, kv, np.array([0]))
    np.testing.assert_allclose(logits[0], ref_logits[13], atol=1e-4)


def test_logits_at_selects_rows(tiny_llama, tmp_path):
    src = load_source(tiny_llama)
    d = src.config.dims
    path, _, _ = build_model_graph(src, tmp_path, "m")
    sess = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    kv = {f"past_key_values.{i}.{k}": np.zeros((1, d.n_kv_heads, S_MAX, d.head_dim), np.float32)
          for i in range(d.n_layers) for k in ("key", "value")}
    ids = np.arange(6, dtype=np.int64)[None] + 5
    full, _ = _run(sess, d, ids, 0, kv, np.arange(6))
    last, _ = _run(sess, d, ids, 0, kv, np.array([3]))
    np.testing.assert_allclose(last[0], full[3], atol=1e-6)
