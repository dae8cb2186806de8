#!/usr/bin/env bash
# Create .venv and install the project with everything the test suite needs.
# torch is installed first and pinned: a bare torch requirement pulls a
# multi-GB CUDA build (on a GPU machine, install the torch build you want
# before running this). vLLM is never installed here (extra "vllm").
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")"
PYTHON="${PYTHON:-python3}"
[ -x .venv/bin/python ] || "$PYTHON" -m venv .venv
.venv/bin/python -m pip install --quiet --disable-pip-version-check "torch==${TORCH_VERSION:-2.13.0}"
.venv/bin/python -m pip install --quiet --disable-pip-version-check -e '.[trainer,test]'
echo "setup.sh: ready: $(.venv/bin/python -c 'import torch, ray; print("torch", torch.__version__, "ray", ray.__version__)')"
