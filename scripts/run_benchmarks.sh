#!/usr/bin/env bash
# The runs behind docs/benchmarks.md, in order. Each writes results.json, results.md and plots to OUT/NAME.
# Usage: bash scripts/run_benchmarks.sh OUT [LIMIT]   (on a quiet machine: nothing else using the CPU)
set -euo pipefail
out=${1:?usage: run_benchmarks.sh OUT [LIMIT]}
limit=${2:-10}
half=$(( limit / 2 > 0 ? limit / 2 : 1 ))
data=${SPECDEC_DATA_DIR:-../shared/datasets}
mkdir -p "$out"
run() { name=$1; shift; specdec bench --data-dir "$data" --out "$out/$name" --no-progress "$@"; }

python scripts/measure_dflash_step.py --dtype bfloat16 | tee "$out/dflash_step.md"
python scripts/measure_dflash_step.py --dtype float32 | tee -a "$out/dflash_step.md"
# dflash = the defaults (a 16-token tree and prompt lookup); dflash:chain = the paper's argmax chain
chain=(--opt dflash:chain.tree_size=0 --opt dflash:chain.lookup=0)
all=(-p autoregressive,ngram,dflash:chain,dflash "${chain[@]}" --baselines hf-greedy,hf-pld)
# DFlash against EAGLE-3, both shipped drafts: trees of 16 without prompt lookup, and the chains
versus=(-p dflash,dflash:tree,dflash:chain,eagle3,eagle3:chain --opt dflash:tree.lookup=0 "${chain[@]}"
        --opt eagle3:chain.tree_size=0 --baselines hf-greedy)
run gsm8k-bf16 -d gsm8k -l "$limit" -n 256 --dtype bfloat16 "${all[@]}"
run mt_bench-bf16 -d mt_bench -l "$half" -n 256 --dtype bfloat16 "${all[@]}"
run gsm8k-fp32 -d gsm8k -l "$half" -n 128 --dtype float32 -p autoregressive,dflash:chain,dflash "${chain[@]}" \
    --baselines none
# temperature 1: the tree (point masses) against the chain drafting from the draft's own distribution
run gsm8k-t1 -d gsm8k -l "$half" -n 128 --dtype bfloat16 -t 1.0 -p autoregressive,dflash:chain,dflash "${chain[@]}" \
    --baselines none
run gsm8k-versus -d gsm8k -l "$limit" -n 256 --dtype bfloat16 "${versus[@]}"
run mt_bench-versus -d mt_bench -l "$half" -n 256 --dtype bfloat16 "${versus[@]}"
