#!/usr/bin/env bash
# Why an argument error raised inside kvboost_core._C crashes the process instead of reaching Python as a
# ValueError (seen on the first lent GPU image: SIGSEGV at the first TORCH_CHECK that fails). Run from the
# repository root after `setup.py build_ext --inplace`; benchmarks/gpu_session.sh calls it when the raising tests
# fail. Prints the toolchain of the extension and of libtorch, one raise in a fresh process (under gdb when it
# is there), and the same raise from a CPU-only build made with each other C++ compiler found.
set -u
PY=${KVBOOST_PY:-python3}
SO=$(ls kvboost_core/_C*.so 2>/dev/null | head -1)
TORCH_LIB=$($PY -c "import os, torch; print(os.path.join(os.path.dirname(torch.__file__), 'lib'))")
RAISE='import torch, kvboost_core._C
try:
    torch.ops.kvboost.quantize_kv(torch.zeros(1, 1, 2, 4), torch.zeros(1, 1, 2, 4), 3, 4)
except ValueError as e:
    print("raised ValueError:", str(e).splitlines()[0])'

echo "== toolchain"
for c in "${CXX:-}" c++ g++ /usr/bin/g++ /opt/gcc/bin/g++ clang++; do
  [ -n "$c" ] && command -v "$c" >/dev/null && echo "$c -> $(readlink -f "$(command -v "$c")"): $("$c" --version | head -1)"
done
$PY -c "import torch; print('torch', torch.__version__, 'cxx11 abi', torch.compiled_with_cxx11_abi())"
echo "extension .comment:"; readelf -p .comment "$SO" 2>&1 | grep -v "^$" | head -6
echo "libtorch_cpu .comment:"; readelf -p .comment "$TORCH_LIB/libtorch_cpu.so" 2>&1 | grep -v "^$" | head -6
echo "extension links:"; ldd "$SO" | grep -E "stdc\+\+|gcc_s|gomp|libc10\.so|torch_cpu"
echo "libtorch_cpu links:"; ldd "$TORCH_LIB/libtorch_cpu.so" | grep -E "stdc\+\+|gcc_s|gomp"
echo "== one raise, this build"
$PY -X faulthandler -c "$RAISE"; echo "rc $?"
if command -v gdb >/dev/null; then
  echo "== gdb backtrace"
  gdb -q -batch -ex run -ex bt --args $PY -c "$RAISE" 2>&1 | grep -E "^#|signal|raised" | head -30
fi
echo "== CPU-only rebuilds with the other compilers"
for c in /usr/bin/g++ clang++; do
  command -v "$c" >/dev/null || continue
  [ "$(readlink -f "$(command -v "$c")")" = "$(readlink -f "$(command -v "${CXX:-c++}")")" ] && continue
  alt=/tmp/kvb_alt_$(basename "$c")
  rm -rf "$alt" && mkdir -p "$alt" && cp -r setup.py pyproject.toml csrc kvboost_core "$alt"/ && rm -f "$alt"/kvboost_core/_C*.so
  cc=${c%++}; [ "$cc" = /usr/bin/g ] && cc=/usr/bin/gcc; [ "$cc" = clang ] && cc=clang
  (cd "$alt" && CXX=$c CC=$cc MAX_JOBS=8 timeout 90 $PY setup.py build_ext --inplace >build.log 2>&1) \
    || { echo "$c: build failed"; tail -3 "$alt/build.log"; continue; }
  echo "$c build:"; (cd "$alt" && $PY -X faulthandler -c "$RAISE"; echo "rc $?")
done
