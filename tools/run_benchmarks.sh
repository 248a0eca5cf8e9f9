#!/usr/bin/env bash
# Reproduce docs/benchmarks.md on this machine, one measurement after another (run nothing else meanwhile: two timed
# things on a small machine measure each other). Needs the test venv (`make test` makes it: the exactness matrix and
# the peers' tokenizer use it) and cmake + a C++ compiler for llama.cpp. Bundles go to $ENGINES (default engines/),
# reports to $OUT (default bench/). About 40 minutes on 2 cores.
#
#   bash tools/run_benchmarks.sh            # everything below
#   bash tools/run_benchmarks.sh parity     # one part: demo | exactness | parity | steps | peers
set -euo pipefail
cd "$(dirname "$0")/.."
ENGINES=${ENGINES:-engines}
OUT=${OUT:-bench}
PY=${PY:-.venv-test/bin/python}
EXPORT="$PY -m specedge.export.cli export"
mkdir -p "$OUT"
part=${1:-all}
qwen() {  # the Qwen pair in the default form: no form flag
    [ -f "$ENGINES/qwen/manifest.json" ] || $EXPORT --target qwen2.5-coder-1.5b --draft qwen2.5-coder-0.5b \
        --out "$ENGINES/qwen"
}
gguf() { $PY -m specedge.export.cli fetch "$1"; }

if [ "$part" = all ] || [ "$part" = demo ]; then
    make demo | tee "$OUT/demo.txt"
fi

if [ "$part" = all ] || [ "$part" = exactness ]; then
    # every KV mode x weight format a CPU export allows, on SmolLM2 (prompt lookup and auto, k 2/4/8, 15 prompts)
    for form in "fp32:--weights fp32" "int8:--weights int8 --quant-form matmulnbits" \
                "int4:--weights int4 --quant-form matmulnbits" "int4-qdq:--weights int4 --quant-form qdq" \
                "int8-intgemm:--weights int8 --quant-form intgemm" "int4-intgemm:--weights int4 --quant-form intgemm" \
                "int8-specedge:--weights int8 --quant-form specedge" "int4-specedge:--weights int4 --quant-form specedge"; do
        name=smollm2-${form%%:*}
        # shellcheck disable=SC2086
        [ -f "$ENGINES/$name/manifest.json" ] || $EXPORT --target smollm2-135m ${form#*:} --max-context 1024 \
            --out "$ENGINES/$name"
        $PY tools/exactness_check.py "$ENGINES/$name" --k 2,4,8 --drafters prompt-lookup,auto | tail -1 \
            | sed "s/^/$name: /" | tee -a "$OUT/exactness.txt"
    done
    qwen
    $PY tools/exactness_check.py "$ENGINES/qwen" --k 2,4,8 --drafters model,prompt-lookup,auto | tail -1 \
        | sed "s/^/qwen: /" | tee -a "$OUT/exactness.txt"
fi

if [ "$part" = all ] || [ "$part" = parity ]; then
    qwen
    bash tools/build_llama_cpp.sh >/dev/null
    $PY tools/plain_parity.py "$ENGINES/qwen" "$(gguf qwen2.5-coder-1.5b)" --rounds 3 | tee "$OUT/parity.txt"
fi

if [ "$part" = all ] || [ "$part" = steps ]; then
    qwen
    $PY tools/verify_cost.py "$ENGINES/qwen" --repeats 7 | tee "$OUT/steps.txt"
fi

if [ "$part" = all ] || [ "$part" = peers ]; then
    qwen
    bash tools/build_llama_cpp.sh >/dev/null
    $PY tools/bench_peers.py "$ENGINES/qwen" --peers llamacpp-native --spec model:4,prompt-lookup:8,auto:8 \
        --suite code,edit,chat,summarize,json --per-suite 1 --max-new-tokens 96 --rounds 2 --out "$OUT/peers"
fi
