#!/bin/sh
# Build the llama.cpp that `kvfold bench --vs llama.cpp` was checked with: the llama.cpp vendored in
# the llama-cpp-python 0.3.36 sdist (PyPI), which runs DeepSeek-V4 (src/models/deepseek4.cpp) and
# ships the converter (convert_hf_to_gguf.py, conversion/, gguf-py/) the bench runs. Only pip, tar,
# cmake and a C++ compiler are needed; nothing is installed.
#
#   bench/get_llama_cpp.sh DIR [JOBS]      # DIR: where the source goes, DIR/build: the build
#   kvfold bench --vs llama.cpp,flyweight --llama-cpp DIR
#
# PYTHON picks the interpreter whose pip downloads the sdist (default python3).
set -eu

dir=${1:?usage: bench/get_llama_cpp.sh DIR [JOBS]}
jobs=${2:-$(nproc 2>/dev/null || echo 2)}
version=0.3.36
python=${PYTHON:-python3}

tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT INT TERM

# the source distribution (--no-binary): the wheel holds a build, not the vendored tree. Only this
# package from source: `--no-binary :all:` would also build pip's metadata helpers (cmake!) from source
"$python" -m pip download --no-deps --no-binary llama-cpp-python "llama-cpp-python==$version" -d "$tmp"
tar -xzf "$tmp/llama_cpp_python-$version.tar.gz" -C "$tmp"
mkdir -p "$dir"
cp -a "$tmp/llama_cpp_python-$version/vendor/llama.cpp/." "$dir/"

# Release, tuned for this CPU (GGML_NATIVE), no network code; llama-bench is all the bench runs
cmake -S "$dir" -B "$dir/build" -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=ON -DLLAMA_CURL=OFF \
    -DLLAMA_BUILD_SERVER=OFF -DLLAMA_BUILD_TESTS=OFF
cmake --build "$dir/build" -j "$jobs" --target llama-bench

echo "built $dir/build/bin/llama-bench; use it with: kvfold bench --vs llama.cpp --llama-cpp $dir"
