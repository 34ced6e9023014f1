#!/usr/bin/env bash
# Builds llama.cpp's own tools (llama-server, and on request llama-quantize, llama-imatrix,
# llama-perplexity) from the llama.cpp that the INSTALLED llama-cpp-python vendors, so the server
# runs the reference's own commit. Used by `make llama-server`.
#
#   scripts/build_llama_server.sh [PYTHON]      # PYTHON: the interpreter whose llama-cpp-python
#                                               # is the reference (default .venv/bin/python)
#
# Environment:
#   LLAMA_TARGETS   CMake targets to build (default "llama-server"); they share libllama/ggml, so
#                   "llama-server llama-quantize llama-imatrix llama-perplexity" costs little more.
#   LLAMA_JOBS      parallel compile jobs (default 2)
#   LLAMA_SDIST     a local llama-cpp-python sdist (.tar.gz) to use instead of `pip download`
#   HARNESS_CACHE_DIR  cache root (default ~/.cache/qwen35-harness, the fixtures' root too)
#
# Layout (outside the checkout, keyed by the vendored llama.cpp commit read from the sdist's
# .git/modules/vendor/llama.cpp/HEAD):
#   $CACHE/sdist/llama_cpp_python-<version>.tar.gz
#   $CACHE/llama.cpp-<commit>/src      the vendored tree
#   $CACHE/llama.cpp-<commit>/build    the CMake build; binaries in build/bin/
#   $CACHE/llama.cpp-<commit>/COMMIT, VERSION
# The last line printed is the build's bin/ folder. The CMake flags keep the build offline: no
# libcurl, no OpenSSL, no prebuilt web UI download. CPU backend with llama.cpp's defaults
# (GGML_NATIVE), as llama-cpp-python builds the reference. About 14 minutes on 2 loaded cores for
# llama-server alone; a second run with the same commit and targets is a no-op.
# Exit status: 0 built; 2 no compiler/CMake or no llama-cpp-python; otherwise the failing step's.
set -euo pipefail
PY="${1:-.venv/bin/python}"
TARGETS="${LLAMA_TARGETS:-llama-server}"
JOBS="${LLAMA_JOBS:-2}"
CACHE="${HARNESS_CACHE_DIR:-${XDG_CACHE_HOME:-$HOME/.cache}/qwen35-harness}"

for tool in cmake c++ tar; do
  command -v "$tool" >/dev/null 2>&1 || { echo "build_llama_server: '$tool' not found: install a C++ compiler and CMake" >&2; exit 2; }
done
VERSION="$("$PY" -c 'from importlib.metadata import version; print(version("llama_cpp_python"))' 2>/dev/null)" \
  || { echo "build_llama_server: llama-cpp-python is not installed in $PY (run make setup)" >&2; exit 2; }

mkdir -p "$CACHE/sdist"
SDIST="${LLAMA_SDIST:-$CACHE/sdist/llama_cpp_python-$VERSION.tar.gz}"
if [ ! -f "$SDIST" ]; then
  tmp="$(mktemp -d "$CACHE/sdist/dl.XXXXXX")"
  "$PY" -m pip download -q --no-binary :all: --no-deps "llama-cpp-python==$VERSION" -d "$tmp"
  mv "$tmp"/llama_cpp_python-"$VERSION".tar.gz "$SDIST"
  rm -rf "$tmp"
fi
TOP="llama_cpp_python-$VERSION"
COMMIT="$(tar xzf "$SDIST" -O "$TOP/.git/modules/vendor/llama.cpp/HEAD" | tr -d '[:space:]')"
case "$COMMIT" in
  *[!0-9a-f]*|"") echo "build_llama_server: no llama.cpp commit in $SDIST" >&2; exit 1 ;;
esac
ROOT="$CACHE/llama.cpp-$COMMIT"
if [ ! -f "$ROOT/src/CMakeLists.txt" ]; then
  rm -rf "$ROOT/src.tmp" && mkdir -p "$ROOT/src.tmp"
  tar xzf "$SDIST" -C "$ROOT/src.tmp" --strip-components=3 "$TOP/vendor/llama.cpp"
  rm -rf "$ROOT/src" && mv "$ROOT/src.tmp" "$ROOT/src"
fi
echo "$COMMIT" > "$ROOT/COMMIT"
echo "$VERSION" > "$ROOT/VERSION"
if [ ! -f "$ROOT/build/CMakeCache.txt" ]; then
  gen=()
  command -v ninja >/dev/null 2>&1 && gen=(-G Ninja)
  cmake -S "$ROOT/src" -B "$ROOT/build" "${gen[@]}" -DCMAKE_BUILD_TYPE=Release \
    -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF -DLLAMA_BUILD_UI=OFF -DLLAMA_USE_PREBUILT_UI=OFF \
    -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_TOOLS=ON -DLLAMA_BUILD_SERVER=ON \
    -DBUILD_SHARED_LIBS=OFF >"$ROOT/cmake-configure.log" 2>&1 \
    || { tail -20 "$ROOT/cmake-configure.log" >&2; exit 1; }
fi
# shellcheck disable=SC2086
cmake --build "$ROOT/build" --config Release -j "$JOBS" --target $TARGETS
for t in $TARGETS; do
  [ -x "$ROOT/build/bin/$t" ] || { echo "build_llama_server: $t was not built" >&2; exit 1; }
done
echo "$ROOT/build/bin"
