#!/usr/bin/env bash
# Reproduce docs/benchmarks.md on this machine: export the bundles, then benchmark them one after another
# (nothing else running). Needs `pip install -e '.[export,bench,peers]'` and, for the llama.cpp rows,
# `pip install llama-cpp-python`. Bundles go to $ENGINES (default engines/), results to $OUT (default bench/).
set -euo pipefail
ENGINES=${ENGINES:-engines}
OUT=${OUT:-bench}
W="--k 8 --verify-widths 3,5,7"

exp() { [ -d "$ENGINES/$1" ] || spec-export export --out "$ENGINES/$1" $W "${@:2}"; }
exp smollm2        --target smollm2-135m --draft prompt-lookup
exp smollm2-int4   --target smollm2-135m --draft prompt-lookup --weights int4 --kv-mode ort-inplace
exp qwen-coder     --target qwen2.5-coder-1.5b --draft qwen2.5-coder-0.5b
exp qwen-int4      --target qwen2.5-coder-1.5b --draft qwen2.5-coder-0.5b --weights int4 --kv-mode ort-inplace

B="spec-run bench"
ALL="--suite code,edit,chat,summarize,json --per-suite 2 --k 2,4,6,8"
$B "$ENGINES/smollm2"      $ALL --drafter prompt-lookup,auto --max-new-tokens 128 --out "$OUT/smollm2"
$B "$ENGINES/smollm2-int4" $ALL --drafter prompt-lookup,auto --max-new-tokens 128 --temperature 0,0.7 --out "$OUT/smollm2-int4"
$B "$ENGINES/qwen-int4"    $ALL --drafter model,prompt-lookup,auto,hybrid --max-new-tokens 96 --out "$OUT/qwen-int4"
$B "$ENGINES/qwen-coder"   --suite code,chat --per-suite 1 --drafter model,prompt-lookup,auto --max-new-tokens 64 \
                           --out "$OUT/qwen-coder"

P="python tools/bench_peers.py"
$P "$ENGINES/smollm2"      --peers hf       --spec prompt-lookup:4 --suite code,edit,chat --out "$OUT/peers-smollm2-hf"
$P "$ENGINES/smollm2-int4" --peers llamacpp --spec prompt-lookup:8 --suite code,edit,chat --max-new-tokens 128 \
                           --out "$OUT/peers-smollm2-llamacpp"
$P "$ENGINES/qwen-int4"    --peers llamacpp --spec model:4,prompt-lookup:8 --suite code,edit,chat --max-new-tokens 128 \
                           --out "$OUT/peers-qwen-llamacpp"
$P "$ENGINES/qwen-coder"   --peers hf       --spec model:4,prompt-lookup:4 --suite code,edit,chat --per-suite 1 \
                           --out "$OUT/peers-qwen-hf"

# issue 6/7 extras: int8, the mixed workload, attention cost vs S_max in ort-inplace mode
exp smollm2-int8   --target smollm2-135m --draft prompt-lookup --weights int8 --kv-mode ort-inplace
$B "$ENGINES/smollm2-int8" $ALL --drafter prompt-lookup,auto --max-new-tokens 128 --out "$OUT/smollm2-int8"
$B "$ENGINES/smollm2-int4" --prompts configs/mixed_prompts.jsonl --drafter prompt-lookup,auto,hybrid \
                           --max-new-tokens 128 --repeats 2 --out "$OUT/smollm2-int4-mixed"
for S in 512 4096; do
  [ -d "$ENGINES/smollm2-int4-s$S" ] || spec-export export --out "$ENGINES/smollm2-int4-s$S" --target smollm2-135m \
      --draft prompt-lookup --weights int4 --kv-mode ort-inplace --max-context $S
  $B "$ENGINES/smollm2-int4-s$S" --suite chat,edit --per-suite 2 --drafter prompt-lookup --k 4 --max-new-tokens 128 \
      --out "$OUT/smollm2-int4-s$S"
done

# auto after the decision-rule fixes, against the best fixed configuration of the first Qwen int4 run
$B "$ENGINES/qwen-int4" --suite code,edit,chat,summarize,json --per-suite 2 --drafter prompt-lookup,auto --k 2 \
                        --max-new-tokens 96 --out "$OUT/qwen-int4-auto2"
# how far the formats move the logits
python tools/quant_accuracy.py "$ENGINES/smollm2" "$ENGINES/smollm2-int8" "$ENGINES/smollm2-int4"
python tools/quant_accuracy.py "$ENGINES/qwen-coder" "$ENGINES/qwen-int4" --per-suite 1 --max-new-tokens 32
for b in smollm2 smollm2-int4; do
  $B "$ENGINES/$b" --suite code,edit,chat,summarize,json --per-suite 2 --drafter prompt-lookup,auto --k 2,4 \
                   --max-new-tokens 128 --out "$OUT/$b-auto2"
done
