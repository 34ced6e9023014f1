#!/usr/bin/env bash
# Builds a second llama.cpp candidate: llama-cpp-python 0.3.17 (vendoring llama.cpp 49bfddec, the
# first release with the qwen35 architecture) in its own virtual environment, outside the repo's
# .venv, so the reference (0.3.36 in .venv) stays untouched.
#
#   scripts/llamacpp_0317_venv.sh [VENV]        # VENV defaults to .venv-llamacpp-0317 (git-ignored)
#
# 0.3.17 is published as an sdist only: pip compiles llama.cpp (CPU backend), about 4-8 minutes on
# two cores; pip caches the built wheel, so a second run takes seconds. CMAKE_BUILD_PARALLEL_LEVEL
# (default 1 here) bounds the compile's jobs. The environment gets numpy too, which the example
# engine (examples/llamacpp_engine.py) needs; nothing of the harness is installed there: the engine
# speaks the harness's `command:` protocol on stdin/stdout and imports only llama_cpp and numpy.
# Exit status: pip's, or 2 when python3 cannot make a venv.
set -euo pipefail
VENV="${1:-.venv-llamacpp-0317}"
export CMAKE_BUILD_PARALLEL_LEVEL="${CMAKE_BUILD_PARALLEL_LEVEL:-1}"
# CMAKE_ARGS is left as the caller has it: unset, the build takes llama-cpp-python's defaults (CPU
# backend, GGML_NATIVE), the same as the 0.3.36 reference built by `make setup`, so that a difference
# between the two comes from llama.cpp's code, not from the build's flags.
python3 -m venv "$VENV" || exit 2
"$VENV/bin/python" -m pip install -q --upgrade pip
"$VENV/bin/python" -m pip install -q "llama-cpp-python==0.3.17" numpy
"$VENV/bin/python" -c 'import llama_cpp; print("llama-cpp-python", llama_cpp.__version__)'
