"""Mutation check: plant each known bug in the real code, one at a time, and check that the test suite fails.

    python tools/dev/mutation_check.py [--only NAME] [--fast] [--check]

Each plant is an exact text replacement in one source file; the file is restored afterwards (also on Ctrl-C).
Prints caught/MISSED per plant; exit 1 if any plant survives. Run from the repository root with the test venv.
Every plant's text must occur exactly once in its file, or the check stops before planting anything (``--check``
does only that; the test suite runs it, so a plant cannot go stale unseen). ``--fast`` runs the plants whose tests
take seconds (CI runs them); the whole list takes about 40 minutes on 2 cores.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

TESTS = ["tests/runtime/test_sampling.py", "tests/runtime/test_controlled_drafts.py", "tests/runtime/test_decoder.py"]

# name -> (file, original text, planted text[, tests to run instead of TESTS])
PLANTS = {
    "sample from p instead of the residual at a rejection": (
        "runtime/sampling.py", "return i, sample(residual(p_target[i], q_row), rng)",
        "return i, sample(p_target[i], rng)"),
    "model drafter returns no q": (
        "runtime/drafters.py", "return Proposal(draft[:kept], None if q is None else q[:kept])",
        "return Proposal(draft[:kept], None)"),
    "every draft position tested against row 0": (
        "runtime/sampling.py", "if rng.random() * q_d < p_target[i, d]:", "if rng.random() * q_d < p_target[0, d]:"),
    "bonus token drawn from the wrong row": (
        "runtime/sampling.py", "return n, sample(p_target[n], rng)", "return n, sample(p_target[max(n - 1, 0)], rng)"),
    "process_logits ignores top-p": (
        "runtime/sampling.py", "    if top_p < 1.0:\n        order", "    if False:\n        order",
        ["tests/runtime/test_sampling.py"]),
    "process_logits ignores top-k": (
        "runtime/sampling.py", "    if 0 < top_k < V:", "    if False:", ["tests/runtime/test_sampling.py"]),
    "process_logits ignores the temperature": (
        "runtime/sampling.py", "z = (raw - raw.max(axis=-1, keepdims=True)) / temperature",
        "z = raw - raw.max(axis=-1, keepdims=True)", ["tests/runtime/test_sampling.py"]),
    "the keyed sampler ignores the seed": (
        "runtime/sampling.py", "return keyed_sample(probs, params.seed, position)",
        "return keyed_sample(probs, 0, position)", ["tests/runtime/test_sampling.py"]),
    "draft-cache rollback removed": (
        "runtime/drafters.py", "self.rows = self._base + min(n_accepted, self._k - 1)", "pass"),
    "prompt lookup proposes one token late": (
        "runtime/drafters.py", "start = int(hits[-1]) + n", "start = int(hits[-1]) + n + 1"),
    "prompt lookup extends its matches against the wrong context token": (
        "runtime/drafters.py", "t[np.maximum(before, 0)] == t[n_tok - n - 1 - d]",
        "t[np.maximum(before, 0)] == t[n_tok - n - d]"),
    "a stop string ends the output at once, empty": (
        "runtime/request.py", 'stop_at, req.finish, out, req.text = min(hits), "stop", out[: j + 1], seen',
        'stop_at, req.finish, out, req.text = 0, "stop", out[: j + 1], seen'),
    # plants outside the runtime: (file, original, planted, the tests that must catch it)
    "integer GEMM: the row and channel scales multiplied first (ONNX Runtime fuses that into one scale for all rows)": (
        "export/graph.py",
        'y = self.g.op("Mul", self.g.op("Cast", acc, to=TensorProto.FLOAT), self.w.add(f"{name}.scales", scales))\n'
        '        return self.g.op("Mul", y, xs)',
        'y = self.g.op("Mul", xs, self.w.add(f"{name}.scales", scales))\n'
        '        return self.g.op("Mul", self.g.op("Cast", acc, to=TensorProto.FLOAT), y)',
        ["tests/export/test_quant.py"]),
    "integer GEMM int8 with an int4 lm_head drops the even-width rule": (
        "export/quant.py", 'self.lm_head in ("auto", "int8", "fp32")', 'True',
        ["tests/export/test_quantized_bundle.py::test_an_odd_prefill_chunk_is_refused_for_a_quantized_target"]),
    "integer GEMM: full-range weights next to 8-bit activations (int16 pair sums saturate without VNNI)": (
        "export/quant.py", "return 7 if self.intgemm_activation_bits == 8 and not self.intgemm_full_range else 8",
        "return 8",
        ["tests/export/test_quant.py", "tests/export/test_quantized_bundle.py::"
         "test_integer_gemm_ranges_are_recorded_and_older_full_range_bundles_are_refused_where_they_could_saturate"]),
    "smoothing: the v bias keeps its scale while the v rows are divided": (
        "export/smooth.py", 'if part == "v_bias":\n            return w / f("v")',
        'if part == "v_bias":\n            return w', ["tests/export/test_smooth.py"]),
    "a partial draft head's column taken for the token id": (
        "runtime/drafters.py", "last = j if self.head_ids is None else int(self.head_ids[j])", "last = j",
        ["tests/runtime/test_controlled_drafts.py"]),
    "a partial draft head's q put in the first columns": (
        "runtime/drafters.py", "q[i, self.head_ids] = probs", "q[i, : len(probs)] = probs",
        ["tests/runtime/test_controlled_drafts.py"]),
    "specedge kernel: the zero-point term dropped on the AVX512 path": (
        "runtime/csrc/sek_gemm.c",
        "_mm512_store_ps(yv[r][t], _mm512_fnmadd_ps(zs, _mm512_set1_ps(sasum[r * nb + b]), v));",
        "_mm512_store_ps(yv[r][t], v);", ["tests/runtime/test_sek_kernel.py"]),
    "specedge kernel: a block's scale and sum taken from the first row of the pass": (
        "runtime/csrc/sek_gemm.c", "const float sa = x->sa[r * nb + b], sasum = x->sasum[r * nb + b];",
        "const float sa = x->sa[b], sasum = x->sasum[b];", ["tests/runtime/test_sek_kernel.py"]),
    "specedge kernel: AVX2 maddubs pairs summed in int16 for 8-bit weights (saturates)": (
        "runtime/csrc/sek_gemm.c",
        "acc[r][h] = _mm256_add_epi32(acc[r][h], _mm256_add_epi32(dlo, _mm256_slli_epi32(dhi, 4)));",
        "acc[r][h] = _mm256_add_epi32(acc[r][h], _mm256_madd_epi16(_mm256_add_epi16(_mm256_maddubs_epi16(lo[h], va), "
        "_mm256_slli_epi16(_mm256_maddubs_epi16(hi[h], va), 4)), ones)); (void)dlo; (void)dhi;",
        ["tests/runtime/test_sek_kernel.py"]),
    "specedge kernel: AVX2 activation levels truncated instead of rounded": (
        "runtime/csrc/sek_gemm.c",
        "_mm256_cvttps_epi32(_mm256_round_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC))",
        "_mm256_cvttps_epi32(x)", ["tests/runtime/test_sek_kernel.py"]),
    "specedge kernel: a 6-bit level's middle bits taken from the wrong place (AVX512)": (
        "runtime/csrc/sek_gemm.c", "_mm512_and_si512(_mm512_srli_epi16(y, 4), m0c)",
        "_mm512_and_si512(_mm512_srli_epi16(y, 2), m0c)", ["tests/runtime/test_sek_kernel.py"]),
    "specedge kernel: a 6-bit level's low bits taken from the wrong place (AVX2)": (
        "runtime/csrc/sek_gemm.c", "_mm256_and_si256(_mm256_srli_epi16(z, 6), m03)",
        "_mm256_and_si256(_mm256_srli_epi16(z, 4), m03)", ["tests/runtime/test_sek_kernel.py"]),
    "specedge kernel: a 6-bit level's low bits taken from the wrong place (AVX2 streamed rows)": (
        "runtime/csrc/sek_gemm.c", "_mm256_and_si256(_mm256_srli_epi16(zz, 6), m03)",
        "_mm256_and_si256(_mm256_srli_epi16(zz, 4), m03)", ["tests/runtime/test_sek_kernel.py"]),
    "specedge kernel: two-level block mins scaled by d instead of dmin (AVX512)": (
        "runtime/csrc/sek_gemm.c",
        "const __m512 dmv = w->mn ? _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(w->dmin + so))) : dv;",
        "const __m512 dmv = dv;", ["tests/runtime/test_sek_kernel.py"]),
    "specedge kernel: two-level block pairs' mins swapped (AVX2)": (
        "runtime/csrc/sek_gemm.c", "_mm256_set_m128i(_mm_unpackhi_epi16(m0, m1), _mm_unpacklo_epi16(m0, m1))",
        "_mm256_set_m128i(_mm_unpackhi_epi16(m1, m0), _mm_unpacklo_epi16(m1, m0))",
        ["tests/runtime/test_sek_kernel.py"]),
    "specedge kernel: a 4-bit chunk's high nibbles dotted with the low nibbles' activations (Arm NEON)": (
        "runtime/csrc/sek_gemm_neon.c", "acc[r][i] = SEK_SDOT(acc[r][i], hi, a[r], 2 * jj + 1);",
        "acc[r][i] = SEK_SDOT(acc[r][i], hi, a[r], 2 * jj);", ["tests/runtime/test_sek_kernel.py"]),
    "specedge kernel: a Q6_K zero point added instead of subtracted (Arm NEON)": (
        "runtime/csrc/sek_gemm_neon.c", "vmlsq_n_s32(ii, m, w->zconst)", "vmlaq_n_s32(ii, m, w->zconst)",
        ["tests/runtime/test_sek_kernel.py"]),
    "specedge kernel: the one-tile pass for short matrices steps two tiles (every other tile never computed)": (
        "runtime/csrc/sek_gemm.c", "for (int64_t t = t0; t < t1; t += wide_sb || single ? 1 : 2) {",
        "for (int64_t t = t0; t < t1; t += wide_sb ? 1 : 2) {", ["tests/runtime/test_sek_kernel.py"]),
    "specedge kernel: the AVX2 streamed-row passes drop the rows that do not divide evenly": (
        "runtime/csrc/sek_gemm.c", "(int)(x->m / passes + (p < x->m % passes))", "(int)(x->m / passes)",
        ["tests/runtime/test_sek_kernel.py"]),
    "specedge kernel: an AVX2 streamed row's second half keeps only its last chunk's products": (
        "runtime/csrc/sek_gemm.c", "s1 = g ? _mm256_add_epi16(s1, p1) : p1;", "s1 = p1;",
        ["tests/runtime/test_sek_kernel.py"]),
    "specedge kernel: an AVX2 streamed row drops the int16 sums its block's first two chunks carried": (
        "runtime/csrc/sek_gemm.c", "s0 = _mm256_add_epi16(s0, c16[r][0]);", "(void)c16;",
        ["tests/runtime/test_sek_kernel.py"]),
    "specedge kernel: the AVX2 epilogue pairs a row's block sums one block off": (
        "runtime/csrc/sek_gemm.c", "memcpy(&pair, bs + 2 * q, 4);", "memcpy(&pair, bs + q, 4);",
        ["tests/runtime/test_sek_kernel.py"]),
    "specedge kernel: an AVX2 streamed row's second half dots the first half's high nibbles": (
        "runtime/csrc/sek_gemm.c", "_mm256_maddubs_epi16(hi[g][1], va1)", "_mm256_maddubs_epi16(hi[g][0], va1)",
        ["tests/runtime/test_sek_kernel.py"]),
    "specedge kernel: the AVX2 4-bit loop dots a chunk's high nibbles with the low nibbles' activations": (
        "runtime/csrc/sek_gemm.c", "_mm256_maddubs_epi16(hi[h], va1)));",
        "_mm256_maddubs_epi16(hi[h], va0)));", ["tests/runtime/test_sek_kernel.py"]),
    "specedge kernel: the AVX2 4-bit loop sums five chunks in int16 before widening (wraps)": (
        "runtime/csrc/sek_gemm.c", "G = nch < 4 ? nch : 4;", "G = nch < 5 ? nch : 5;",
        ["tests/runtime/test_sek_kernel.py"]),
    "specedge kernel: an AVX-VNNI chunk's high nibbles dotted with the low nibbles' activations": (
        "runtime/csrc/sek_gemm.c",
        "return _mm256_add_epi32(acc, dp256(dp256(_mm256_setzero_si256(), u0, s0), u1, s1));",
        "return _mm256_add_epi32(acc, dp256(dp256(_mm256_setzero_si256(), u0, s0), u1, s0));",
        ["tests/runtime/test_sek_kernel.py"]),
    "specedge kernel: a block's integer scale skipped (scalar)": (
        "runtime/csrc/sek_gemm.c", "i1[c] += acc[c] * w->sc[o + c];", "i1[c] += acc[c];",
        ["tests/runtime/test_sek_kernel.py"]),
    "specedge attention: a four-key score pass hands keys 3 and 4 each other's scores": (
        "runtime/csrc/sek_attn.c", "_mm512_setr_epi32(0, 4, 8, 12,", "_mm512_setr_epi32(0, 4, 12, 8,",
        ["tests/runtime/test_sek_kernel.py"]),
    "specedge attention: a four-key score pass (AVX2) adds lanes i and i + 1 where the tree adds i and i + 2": (
        "runtime/csrc/sek_attn.c", "e23 = _mm256_add_ps(v23, _mm256_permute_ps(v23, 0x4E));",
        "e23 = _mm256_add_ps(v23, _mm256_permute_ps(v23, 0xB1));", ["tests/runtime/test_sek_kernel.py"]),
    "specedge attention: a tile's queries sum the values with its first query's weights": (
        "runtime/csrc/sek_attn.c", "const sek_vec p = VSET1(w[h][j]);", "const sek_vec p = VSET1(w[0][j]);",
        ["tests/runtime/test_sek_kernel.py"]),
    "specedge attention: a row's keys stored less the first head's shift, whatever their head": (
        "runtime/csrc/sek_attn.c", "a->d,\n                     a->rot, a->k_shift ? a->k_shift + h * a->d : NULL);",
        "a->d,\n                     a->rot, a->k_shift ? a->k_shift : NULL);",
        ["tests/runtime/test_sek_row_attention.py"]),
    "key shift: the bias's rotated mean taken with the sine's sign turned": (
        "export/attention.py", "out[:, :h] = b[:, :h] * mean_cos - b[:, h:rot] * mean_sin",
        "out[:, :h] = b[:, :h] * mean_cos + b[:, h:rot] * mean_sin", ["tests/runtime/test_sek_row_attention.py"]),
    "specedge kernel: a many-row step's passes take eleven rows, which no pass computes": (
        "runtime/csrc/sek_gemm.c", "x->m <= SEK_ONE_PASS ? SEK_RMAX : SEK_RPASS;",
        "x->m <= SEK_ONE_PASS ? SEK_RMAX : SEK_RMAX + 1;", ["tests/runtime/test_sek_kernel.py"]),
    "specedge attention: a row attends one position short": (
        "runtime/csrc/sek_attn.c",
        "n[p] = pos + 1;\n        start[p] = window_start(a->window, pos);\n        nmax",
        "n[p] = pos;\n        start[p] = window_start(a->window, pos);\n        nmax",
        ["tests/runtime/test_sek_kernel.py"]),
    "row-addressed attention: a row attends one position short": (
        "runtime/csrc/sek_attn.c",
        "n[p] = pos + 1;\n        start[p] = window_start(a->window, pos);\n        direct[p]",
        "n[p] = pos;\n        start[p] = window_start(a->window, pos);\n        direct[p]",
        ["tests/runtime/test_sek_row_attention.py"]),
    "sliding window: one position wider than asked": (
        "runtime/csrc/sek_attn.c", "return window > 0 && pos >= window ? pos - window + 1 : 0;",
        "return window > 0 && pos >= window ? pos - window : 0;",
        ["tests/runtime/test_sek_kernel.py", "tests/runtime/test_sek_row_attention.py"]),
    "sliding window: a chunk's rows before it still attended": (
        "runtime/csrc/sek_attn.c", "tile(q + p * d, kb, vb, rb, type, lo[p], cn[p],",
        "tile(q + p * d, kb, vb, rb, type, 0, cn[p],",
        ["tests/runtime/test_sek_kernel.py"]),
    "gemma2: the logits not soft-capped": (
        "export/graph.py", "    if cfg.final_softcap:  # gemma2", "    if cfg.final_softcap and 0:  # gemma2",
        ["tests/export/test_families.py"]),
    "gemma2: the portable graph's scores not soft-capped": (
        "export/attention.py", "self.softcap)), self.softcap)) if self.softcap else (",
        "self.softcap)), self.softcap)) if None else (", ["tests/export/test_families.py"]),
    "specedge attention: the scores not soft-capped": (
        "runtime/csrc/sek_attn.c", "if (softcap > 0.f)\n            for", "if (softcap > 1e30f)\n            for",
        ["tests/runtime/test_sek_kernel.py"]),
    "GGUF Q3_K: the high bit read the wrong way round": (
        "export/quant.py", "q = low.reshape(n, kb, 8, 32).astype(np.int16) - 4 * (1 - high.astype(np.int16))",
        "q = low.reshape(n, kb, 8, 32).astype(np.int16) - 4 * high.astype(np.int16)",
        ["tests/export/test_quant.py"]),
    "8-bit offsets: Q5_1 levels left at zero point 128 (zs rounded)": (
        "export/quant.py", "q.min(initial=255) >= 128:", "q.min(initial=255) >= 256:",
        ["tests/runtime/test_sek_kernel.py"]),
    "tree walk: goes down the first child, not the one that is the target's token (a wrong branch)": (
        "runtime/trees.py", "        path.append(nxt)\n", "        path.append(kids[row][0])\n",
        ["tests/runtime/test_trees.py"]),
    "tree walk: every keyed token drawn at the root's position": (
        "runtime/trees.py", "x = keyed_sample(probs, params.seed, position + len(path))",
        "x = keyed_sample(probs, params.seed, position)", ["tests/runtime/test_trees.py"]),
    "tree commit: the accepted path's rows moved one row too far": (
        "runtime/trees.py", "dst = [base + j for j, node", "dst = [base + j + 1 for j, node",
        ["tests/runtime/test_trees.py"]),
    "tree commit: the accepted path's rows left where the step wrote them": (
        "runtime/decoder.py", "        slot.runner.move_rows(src, dst)", "        pass",
        ["tests/runtime/test_trees.py"]),
    "tree rows: a row attends its parent's ancestors but not itself (the ancestor mask one row off)": (
        "runtime/csrc/sek_attn.c", "up[depth++] = a->row_pos[r];", "up[depth++] = a->row_pos[a->row_parent[r]];",
        ["tests/runtime/test_sek_row_attention.py"]),
    "row-addressed attention groups rows of different slots into one item": (
        "runtime/csrc/sek_attn.c", "slot[i] >= 0 && slot[j] == slot[i]) j++;", "slot[i] >= 0 && slot[j] >= 0) j++;",
        ["tests/runtime/test_sek_row_attention.py"]),
    "row-addressed attention reads slot 0 whatever the row names": (
        "runtime/csrc/sek_attn.c", "(size_t)((slot * a->hkv + g) * a->s_max)", "(size_t)(g * a->s_max)",
        ["tests/runtime/test_sek_row_attention.py", "tests/export/test_rows_graph.py"]),
    "specedge attention: the new k rows stored without RoPE": (
        "runtime/csrc/sek_attn.c", "    rope(r, cs, sn, rot);\n", "", ["tests/runtime/test_sek_kernel.py"]),
    "partial rotary: a new key's last rotated pair left unturned": (
        "runtime/csrc/sek_attn.c", "    rope(r, cs, sn, rot);\n", "    rope(r, cs, sn, rot < d ? rot - 2 : rot);\n",
        ["tests/runtime/test_sek_kernel.py"]),
    "fp16 KV: a tie rounded up, not to even": (
        "runtime/csrc/sek_attn.c", "x += 0xc8000fffu + ((x >> 13) & 1u);", "x += 0xc8000fffu + 1u;",
        ["tests/runtime/test_sek_row_attention.py::test_an_fp16_cache_holds_each_new_row_rounded_to_nearest_even"]),
    "specedge attention: a four-key pass scores its last key against its first key's row": (
        "runtime/csrc/sek_attn.c", "row[c] = kb + (size_t)(j + (c < nk ? c : 0)) * rb;",
        "row[c] = kb + (size_t)(j + (c < nk - 1 ? c : 0)) * rb;", ["tests/runtime/test_sek_kernel.py"]),
    "fp16 KV: a row's elements read one vector early": (
        "runtime/csrc/sek_attn.c", "const uint16_t *h = (const uint16_t *)row + i;",
        "const uint16_t *h = (const uint16_t *)row + (i ? i - SEK_VW : 0);",
        ["tests/runtime/test_sek_row_attention.py::test_an_fp16_cache_attends_as_fp32_does_over_the_same_values"]),
    "specedge attention: a tile's queries keep one sum of exps": (
        "runtime/csrc/sek_attn.c", "softmax_chunk(s[h], w[h], lo, cn, m + h, l + h, alpha + h);",
        "softmax_chunk(s[h], w[h], lo, cn, m + h, l, alpha + h);", ["tests/runtime/test_sek_kernel.py"]),
    "int8 KV: a tie rounded away from zero, not to even": (
        "runtime/csrc/sek_attn.c",
        "q += (f > 0.5f || (f == 0.5f && (q & 1))) - (f < -0.5f || (f == -0.5f && (q & 1)));",
        "q += (f >= 0.5f) - (f <= -0.5f);",
        ["tests/runtime/test_sek_row_attention.py::"
         "test_an_int8_cache_holds_each_new_row_quantized_as_its_contract_says"]),
    "int8 KV: a row read without its scale's last byte": (
        "runtime/csrc/sek_attn.c", "    memcpy(&s, row + d, sizeof s);", "    s = 0.f;\n    memcpy(&s, row + d, 3);",
        ["tests/runtime/test_sek_row_attention.py::"
         "test_an_int8_cache_attends_as_fp32_does_over_the_values_it_holds"]),
    "SekMatMul's fused residual addition dropped": (
        "runtime/csrc/sek_ort.c", "    if (j->residual) add_columns(", "    if (0 && j->residual) add_columns(",
        ["tests/runtime/test_sek_kernel.py", "tests/export/test_quantized_bundle.py::"
         "test_the_specedge_form_fuses_each_layers_bias_swiglu_and_residuals_into_its_matmuls"]),
    "SwiGLU with the gate and up halves swapped": (
        "runtime/csrc/sek_act.c", "*gate = y + r * 2 * f, *up = gate + f;", "*up = y + r * 2 * f, *gate = up + f;",
        ["tests/runtime/test_sek_kernel.py"]),
    "auto's sunk stopper counted as a miss of the gated draft": (
        "runtime/adaptive.py", "self.alpha[kind].update(n - 1, min(n_accepted, n - 1))",
        "self.alpha[kind].update(n, n_accepted)",
        ["tests/runtime/test_adaptive.py"]),
    "auto's catch-up spread over the request again, not over the model rounds' runs": (
        "runtime/adaptive.py", "return catchup * max(1.0, horizon / run)", "return catchup",
        ["tests/runtime/test_adaptive.py"]),
    "auto prices a request's catch-up over short runs before it has shown whether it copies": (
        "runtime/adaptive.py", "            run = max(run, self._unsure_share() * horizon)\n", "",
        ["tests/runtime/test_adaptive.py"]),
    "auto's probe overrides the estimate's choice of prompt lookup": (
        "runtime/adaptive.py", "        if d.kind == \"prompt-lookup\":\n            self._probe_left = 0\n", "",
        ["tests/runtime/test_adaptive.py"]),
    "auto keeps the carried acceptance whatever the request's target confidence predicts": (
        "runtime/adaptive.py", "not self.rounds.get(\"model\") and self._sure[1] >= self.CONF_TOKENS",
        "False", ["tests/runtime/test_adaptive.py"]),
    "auto's probes catch the draft up on the prompt at the usual margin": (
        "runtime/adaptive.py", "horizon=horizon, margin=PROMPT_MARGIN if behind_prompt else MODEL_MARGIN)",
        "horizon=horizon)", ["tests/runtime/test_adaptive.py"]),
    "auto prices a sure request's catch-up over it although its lookup has matched": (
        "runtime/adaptive.py", "if self._copied or self._sure[1] < self.CONF_TOKENS:",
        "if self._sure[1] < self.CONF_TOKENS:", ["tests/runtime/test_adaptive.py"]),
    "auto ignores the target's confidence while a request has not shown whether it copies": (
        "runtime/adaptive.py", "return max(self.UNSURE_SHARE, self._sure[0] / self._sure[1])",
        "return self.UNSURE_SHARE", ["tests/runtime/test_adaptive.py"]),
    "auto's split learns from the bonus row of a round whose drafts all passed": (
        "runtime/adaptive.py", "target_split.record(confs[:n]", "target_split.record(confs",
        ["tests/runtime/test_adaptive.py"]),
    "the decoder computes the target's confidence in every round of a request": (
        "runtime/decoder.py", "if not ids_only and drafter.wants_confidence():  # auto's prior",
        "if not ids_only:  # auto's prior", ["tests/runtime/test_decoder.py"]),
    "auto's lookup learns only from the rounds it ran": (
        "runtime/adaptive.py", "            self._learn_lookup(tokens, *self._shadow)\n", "",
        ["tests/runtime/test_adaptive.py"]),
    "auto prices every request's catch-up over the copying requests' runs": (
        "runtime/adaptive.py", "or self._copied >= self.COPYING * committed", "or True",
        ["tests/runtime/test_adaptive.py"]),
    "the draft's first draw taken from the catch-up step's first row": (
        "runtime/backends/ort.py", "b.logits_at[0, 0] = n - 1", "b.logits_at[0, 0] = 0"),
    "the draft's catch-up misses the last committed token": (
        "runtime/drafters.py", "first = feed(self.runner, tokens[self.rows: n], self.rows",
        "first = feed(self.runner, tokens[self.rows: n - 1], self.rows"),
    "auto prices a catch-up with the first draw's step in it twice": (
        "runtime/policy.py", "self._catchup_prediction(plan) - self.draft_time())",
        "self._catchup_prediction(plan))", ["tests/runtime/test_adaptive.py"]),
    "auto's step costs averaged per width alone (widths not run keep an old phase's speed)": (
        "runtime/policy.py", "self.speed *= (seconds / (self.speed * self._width_time(w, depth))) ** (1 - self.decay)",
        "self.target[w] *= (seconds / (self.speed * self._width_time(w, depth))) ** (1 - self.decay)",
        ["tests/runtime/test_adaptive.py"]),
    "auto prices every step at the context its costs were timed at": (
        "runtime/policy.py", "self.target[w] + self._slope(w) * (d - self.base_depth)", "self.target[w]",
        ["tests/runtime/test_adaptive.py"]),
    "auto scores a copying request's gap by tokens per second again": (
        "runtime/policy.py", 'if gap == float("inf") or rate <= 0:', "if True:", ["tests/runtime/test_adaptive.py"]),
    "auto measures a gap to the end of the round that closed it": (
        "runtime/adaptive.py", "if len(self.lookup.propose(tokens[:p], 1, params, rng).tokens)), n_tokens)",
        "if False), n_tokens)", ["tests/runtime/test_adaptive.py"]),
    "auto's first catch-up on a prompt needs only the usual margin": (
        "runtime/adaptive.py",
        "pace=pace,\n                   margin=PROMPT_MARGIN if behind_prompt else MODEL_MARGIN)",
        "pace=pace,\n                   margin=MODEL_MARGIN)",
        ["tests/runtime/test_adaptive.py"]),
    "reuse_prefix=False leaves the draft's rows to be adopted": (
        "runtime/decoder.py", "if not reuse_prefix and self.draft_cache is not None:", "if False:"),
    "the replayed draft's catch-up costs nothing": (
        "tools/dev/lookup_replay.py", "        self.spent += catchup\n", "", ["tests/test_lookup_replay.py"]),
    "a kept step-cost entry of another timing is read": (
        "runtime/step_costs.py", 'if raw.get("timing") != STEP_TIMING or not', "if not",
        ["tests/runtime/test_decoder.py"]),
    "step timing keeps the fastest whatever is asked": (
        "runtime/step_costs.py", "return {T: float(reduce(ts))", "return {T: float(np.min(ts))",
        ["tests/runtime/test_decoder.py"]),
    "re-timed traces keep their old step times": (
        "tools/dev/lookup_replay.py", '"steps": {str(T): s for T, s in timed["target"].items()',
        '"steps": run["steps"] or {str(T): s for T, s in timed["target"].items()', ["tests/test_lookup_replay.py"]),
    "the target's rows counted before an interrupted prefill wrote them": (
        "runtime/decoder.py", "            slot.rows.writing(tokens, start)\n",
        "            slot.rows.wrote(tokens, req.n)\n", ["tests/runtime/test_faults.py"]),
    "a resync leaves the rows it rewrites counted": (
        "runtime/decoder.py", "        slot.rows.writing(req.tokens, start)\n", "", ["tests/runtime/test_faults.py"]),
    "the draft cache keeps counting the rows a catch-up rewrites": (
        "runtime/drafters.py", "        self.cache.rows_for = tokens[: self.rows]\n", "",
        ["tests/runtime/test_faults.py"]),
    "close does not wait for the step in progress": (
        "runtime/decoder.py", "        with self._lock:  # a step in progress on another thread finishes first",
        "        if True:", ["tests/runtime/test_faults.py"]),
    "the sampled hash is not checked": (
        "runtime/bundle_files.py", 'if verify == "size" and sample is not None and', "if False and",
        ["tests/runtime/test_damaged_weights.py"]),
    "ONNX Runtime maps the weights file": (
        "runtime/backends/ort.py", 'if not data.is_file() or not data.stat().st_size or "TensorrtExecutionProvider"',
        "if True or None",
        ["tests/runtime/test_damaged_weights.py"]),
    "a decoder serves requests after its files changed": (
        "runtime/decoder.py", "        self.files.check()\n", "", ["tests/runtime/test_damaged_weights.py"]),
    "all-equal logits are taken for an answer": (
        "runtime/decoder.py", 'else "all equal" if logits.min() == logits.max() else None)', "else None)",
        ["tests/runtime/test_damaged_weights.py"]),
    "lookup bound assumes every drafted token passes": (
        "tools/dev/lookup_replay.py", "best[min(N, n + 1 + min(j, a))]", "best[min(N, n + 1 + j)]",
        ["tests/test_lookup_replay.py"]),
    "a batched round reads the rows of the request before it": (
        "runtime/batch.py", "rows_out = out[at: at + n + 1]", "rows_out = out[max(0, at - 1): max(0, at - 1) + n + 1]",
        ["tests/runtime/test_batch.py"]),
    "a batched round's rows sit one position late": (
        "runtime/batch.py", "positions += range(req.n - 1, req.n + n)", "positions += range(req.n, req.n + n + 1)",
        ["tests/runtime/test_batch.py"]),
    "a batched round's rows all in the first request's slot": (
        "runtime/batch.py", "slots += [req.slot] * (n + 1)", "slots += [ms[0].req.slot] * (n + 1)",
        ["tests/runtime/test_batch.py"]),
    "a new request takes a busy slot": (
        "runtime/batch.py", "free = [s for s in self.dec.slots if s.member is None]", "free = list(self.dec.slots)",
        ["tests/runtime/test_batch.py"]),
    "a prefill resumes past rows written over": (
        "runtime/batch.py", "            if not slot.rows.holds(req.tokens, m.fed):", "            if False:",
        ["tests/runtime/test_batch.py"]),
    "a prompt's rows in a shared step sit one position late": (
        "runtime/batch.py", "positions += range(feeder.fed, feeder.fed + fed)",
        "positions += range(feeder.fed + 1, feeder.fed + fed + 1)", ["tests/runtime/test_batch.py"]),
    "a prompt's first token from the last decoding row": (
        "runtime/batch.py", "out[decode_rows] if last else None", "out[decode_rows - 1] if last else None",
        ["tests/runtime/test_batch.py"]),
    "batched drafts fed one position late": (
        "runtime/batch.py", "[todo[i][0].req.n - 1 + j for i in live]", "[todo[i][0].req.n + j for i in live]",
        ["tests/runtime/test_batch.py"]),
    "batched keyed drafts drawn with the next position's noise": (
        "runtime/batch.py", "m.req.params, m.req.n + j)", "m.req.params, m.req.n + j + 1)",
        ["tests/runtime/test_batch.py"]),
    "a lone logits row is the step's first": (
        "runtime/backends/ort.py", "            b.logits_at[0, 0] = n - 1", "            b.logits_at[0, 0] = 0",
        ["tests/runtime/test_batch.py"]),
    "a step's logits rows in the wrong order": (
        "runtime/backends/ort.py", "        b.logits_at[0, :] = rows", "        b.logits_at[0, :] = list(rows)[::-1]",
        ["tests/runtime/test_batch.py"]),
    "a prompt's rows copied from another slot one short": (
        "runtime/batch.py", "target.copy_slot_rows(src.index, m.slot.index, m.fed, best)",
        "target.copy_slot_rows(src.index, m.slot.index, m.fed, best - 1)", ["tests/runtime/test_batch.py"]),
    "a request joins the batch behind the rounds' lock": (
        "runtime/batch.py", "with self._joins:  # not the round lock", "with dec._lock:  # not the round lock",
        ["tests/runtime/test_batch.py"]),
    "auto bars a drafter whose rounds run faster than plain, not slower": (
        "runtime/adaptive.py", "tokens / seconds < self.costs.measured_plain_rate()",
        "tokens / seconds > self.costs.measured_plain_rate()", ["tests/runtime/test_adaptive.py"]),
    "auto's guard counts a draft's catch-up in its rounds' pace": (
        "runtime/adaptive.py", "max(0.0, seconds - self._round_catchup)", "seconds",
        ["tests/runtime/test_adaptive.py"]),
    "a draft's rows copied from another slot without the first": (
        "runtime/batch.py", "runner.copy_slot_rows(src, m.slot.index, own, best)",
        "runner.copy_slot_rows(src, m.slot.index, own + 1, best)", ["tests/runtime/test_batch.py"]),
}


# plants whose tests take seconds, not minutes: what CI runs (--fast)
FAST = ("sample from p instead of the residual at a rejection", "every draft position tested against row 0",
        "bonus token drawn from the wrong row", "process_logits ignores top-p", "process_logits ignores top-k",
        "process_logits ignores the temperature", "the keyed sampler ignores the seed",
        "the target's rows counted before an interrupted prefill wrote them", "the sampled hash is not checked",
        "a batched round reads the rows of the request before it", "a new request takes a busy slot",
        "a prompt's rows in a shared step sit one position late", "batched drafts fed one position late",
        "a prompt's rows copied from another slot one short",
        "auto bars a drafter whose rounds run faster than plain, not slower")


def stale(root: Path) -> list[str]:
    """The plants whose text to replace does not occur exactly once in its file (the code moved on)."""
    out = []
    for name, (file, old, *_) in PLANTS.items():
        path = root / file
        n = path.read_text().count(old) if path.is_file() else 0
        if n != 1:
            out.append(f"{name!r}: its text occurs {n} times in {file}")
    return out


def run_plant(name: str, root: Path) -> bool:
    file, old, new, *tests = PLANTS[name]
    path = root / file
    original = path.read_text()
    try:
        path.write_text(original.replace(old, new))
        r = subprocess.run([sys.executable, "-m", "pytest", "-x", "-q", "-p", "no:cacheprovider",
                            *(tests[0] if tests else TESTS)],
                           cwd=root, capture_output=True, text=True)
    finally:
        path.write_text(original)
    return r.returncode != 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--only", default=None)
    ap.add_argument("--fast", action="store_true", help="only the plants whose tests take seconds (CI)")
    ap.add_argument("--check", action="store_true", help="only check that every plant's text is in its file")
    a = ap.parse_args()
    root = Path(__file__).resolve().parents[2]
    bad = stale(root)
    if bad:
        print("stale plants (update tools/dev/mutation_check.py):\n  " + "\n  ".join(bad), file=sys.stderr)
        return 2
    if a.check:
        print(f"all {len(PLANTS)} plants' texts are in their files")
        return 0
    names = [a.only] if a.only else list(FAST if a.fast else PLANTS)
    missed = []
    for name in names:
        caught = run_plant(name, root)
        print(f"{'caught' if caught else 'MISSED'}  {name}", flush=True)
        if not caught:
            missed.append(name)
    print(f"{len(names) - len(missed)}/{len(names)} planted bugs caught")
    return 1 if missed else 0


if __name__ == "__main__":
    sys.exit(main())
