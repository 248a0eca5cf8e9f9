#!/usr/bin/env bash
# GPU smoke kit: one command on a GPU machine, under 8 minutes, nothing downloaded.
#
#   CPU machine (test venv: torch + transformers make the tiny models), once:
#       python tools/gpu/gpu_kit.py prepare .gpu-kit        # ~15 s, ~7 MB, git-ignored: tiny bundles (model draft,
#                                                       # prompt lookup, int4), fp16 graphs, CPU goldens, pylib
#   GPU machine (the repo + the carried .gpu-kit; TensorRT, onnxruntime-gpu, CuPy each optional):
#       bash tools/gpu/gpu_check.sh .gpu-kit [REPORT.json] [check options, e.g. --only trt --budget-s 300]
#   with the device `run` tool: command "bash tools/gpu/gpu_check.sh .gpu-kit", carry [".gpu-kit"]; the report is
#   written to $OUT/gpu-kit-report.json (else KIT/gpu-kit-report.json), after every check.
#
# Without a GPU the same command runs in no-GPU mode (also: --dry-run): the CPU checks run (kit integrity, the
# goldens replayed on ONNX Runtime CPU, greedy speculative == plain, spec-export validate --goldens), every GPU
# check prints exactly what it would run (commands, API calls, widths, tolerances) and is reported
# "skipped: no GPU"; exit 0 when the CPU checks pass. On a GPU: CUDA binding vs CuPy (tools/gpu/gpu_check_cuda.py),
# the trt runner with real CUDA graphs around a CuPy stand-in engine (tools/gpu/gpu_check_graphs.py), ort-cuda on a
# NaN-poisoned allocator, step-by-step parity with the goldens at every width (past_len 0 and > 0, after
# rollbacks, target and draft interleaved) on ort-cuda fp32/TF32/fp16/int4, TensorRT fp16 with and without CUDA graphs and ort-trt, TensorRT builds (seconds and bytes per profile), spec-export validate
# --goldens, greedy speculative == plain for every drafter at k = 1..4, step times per width. A check whose
# library is missing is skipped with the reason. tools/gpu/gpu_kit.py says more.
#
# The older end-to-end check on SmolLM2-135M (needs the SmolLM2 wheel from PyPI, or its GGUF in the cache):
#       bash tools/gpu/gpu_check.sh --smollm2 [WORKDIR]     (default WORKDIR: /tmp/specedge-gpu-check)
set -euo pipefail
cd "$(dirname "$0")/../.."
PY=${PYTHON:-python}

if [ "${1:-}" != "--smollm2" ]; then
  KIT=${1:-.gpu-kit}
  [ $# -gt 0 ] && shift
  REPORT=${OUT:-$KIT}/gpu-kit-report.json
  if [ $# -gt 0 ] && [ "${1#-}" = "$1" ]; then REPORT=$1; shift; fi
  if [ ! -f "$KIT/kit.json" ]; then
    if $PY -c "import torch, transformers" 2>/dev/null; then
      $PY tools/gpu/gpu_kit.py prepare "$KIT"
    else
      echo "no GPU kit at $KIT: make it on the CPU machine (python tools/gpu/gpu_kit.py prepare $KIT), carry it here" >&2
      exit 2
    fi
  fi
  exec timeout 470 $PY tools/gpu/gpu_kit.py check "$KIT" --report "$REPORT" "$@"
fi

# ---------------------------------------------------------------------------------------------- --smollm2
# Steps: doctor; export SmolLM2-135M (fp32, portable KV, K=4, S_max 1024); then
#   with TensorRT: build fp16 engines, validate them against ONNX Runtime fp32 (polygraphy + greedy
#     agreement), check speculative greedy == plain greedy on the trt backend, and print tok/s plain vs
#     speculative (spec-run bench, same prompts, same run);
#   without TensorRT (CUDA + CuPy): tools/gpu/gpu_check_cuda.py (libcudart binding + KV commit vs CuPy), and the
#     ort-cuda backend if onnxruntime-gpu is installed.
shift
WORK=${1:-/tmp/specedge-gpu-check}
B=$WORK/smollm2
mkdir -p "$WORK"
t0=$(date +%s)
step() { echo; echo "=== [$(( $(date +%s) - t0 ))s] $*"; }

step "doctor"
spec-export doctor
step "export SmolLM2-135M (fp32, portable KV, K=4, S_max 1024)"
[ -f "$B/manifest.json" ] || spec-export export --target smollm2-135m --draft prompt-lookup --for datacenter-gpu --k 4 \
    --verify-widths 3 --max-context 1024 --prefill-chunk 64 --no-device-argmax --out "$B" --overwrite

if $PY -c "import tensorrt" 2>/dev/null; then
  step "build fp16 TensorRT engines"
  spec-export build "$B" --backend trt --precision fp16 --workspace-gb 2
  step "validate: TensorRT fp16 vs ONNX Runtime fp32 (polygraphy, greedy agreement)"
  spec-export validate "$B" --candidate trt --tokens 32 --report "$WORK/validate-trt.json" || echo "VALIDATE FAILED"
  step "speculative greedy == plain greedy on the trt backend"
  $PY - "$B" <<'PYEOF'
import sys
import numpy as np
from specedge.runtime import SamplingParams, SpecDecoder
from specedge.runtime.drafters import feed
dec = SpecDecoder.load(sys.argv[1], backend="trt")
prompts = ["Write a Python function that reverses a linked list.", "List three uses of copper.",
           "Repeat after me: the quick brown fox jumps over the lazy dog. The quick brown fox"]
p = SamplingParams(max_new_tokens=64, ignore_eos=True)
same = ties = bad = 0
for prompt in prompts:
    plain = dec.generate(prompt, p, drafter="none", chat=True).token_ids
    for drafter in ("prompt-lookup", "auto"):
        spec = dec.generate(prompt, p, drafter=drafter, k=4, chat=True).token_ids
        if spec == plain:
            same += 1
            continue
        i = next(j for j in range(min(len(spec), len(plain))) if spec[j] != plain[j])
        ids = dec.encode_prompt(prompt, chat=True) + plain[:i]
        top2 = np.sort(feed(dec.target, np.array(ids), 0, dec.manifest.prefill_chunk))[-2:]
        gap = float(top2[1] - top2[0])
        print(f"  differs at token {i} ({drafter}), top-2 gap {gap:.3g}")
        ties += gap < 1e-2
        bad += gap >= 1e-2
print(f"identical {same}/{2 * len(prompts)}, near-tie differences {ties}, real differences {bad}")
dec.close()
sys.exit(1 if bad else 0)
PYEOF
  step "tok/s: plain vs speculative on TensorRT (same run)"
  spec-run bench "$B" --backend trt --suite code,edit,chat --per-suite 1 --k 2,4 --drafter prompt-lookup,auto \
      --max-new-tokens 96 --out "$WORK/bench-trt" --no-plots
else
  echo "TensorRT is not installed: checking the CUDA binding and the KV commit against CuPy instead"
  step "libcudart binding + TensorRT backend KV commit vs CuPy"
  $PY tools/gpu/gpu_check_cuda.py
  if $PY -c "import onnxruntime as o, sys; sys.exit('CUDAExecutionProvider' not in o.get_available_providers())"; then
    step "ort-cuda backend: fp32 and fp16 graphs, plain vs speculative"
    spec-export build "$B" --backend onnx --precision fp16
    spec-export validate "$B" --candidate ort-cuda-fp16 --tokens 32 --report "$WORK/validate-ort-cuda.json" || true
    spec-run bench "$B" --backend ort-cuda --suite code,chat --per-suite 1 --k 4 --drafter prompt-lookup \
        --max-new-tokens 64 --out "$WORK/bench-ort-cuda" --no-plots
  else
    echo "onnxruntime-gpu is not installed: ort-cuda not checked"
  fi
fi
step "done in $(( $(date +%s) - t0 ))s"
