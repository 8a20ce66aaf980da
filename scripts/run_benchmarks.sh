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
all=(-p autoregressive,ngram,dflash --baselines hf-greedy,hf-pld)
run gsm8k-bf16 -d gsm8k -l "$limit" -n 256 --dtype bfloat16 "${all[@]}"
run mt_bench-bf16 -d mt_bench -l "$half" -n 256 --dtype bfloat16 "${all[@]}"
run gsm8k-fp32 -d gsm8k -l "$half" -n 128 --dtype float32 "${all[@]}"
# temperature 1: DFlash drafting from its own distribution (proper rejection sampling) vs point-mass drafts
run gsm8k-t1-sample -d gsm8k -l "$half" -n 128 --dtype bfloat16 -t 1.0 -p autoregressive,dflash --baselines none
run gsm8k-t1-greedy -d gsm8k -l "$half" -n 128 --dtype bfloat16 -t 1.0 -p autoregressive,dflash --baselines none \
    --opt dflash.drafting=greedy
