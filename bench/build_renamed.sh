#!/usr/bin/env bash
# Builds the C++ ops from a csrc/ directory with every "kivi_fast" renamed NS, so that two builds (say
# the last commit's and the working tree's) load into one process side by side as torch.ops.NS_A.* and
# torch.ops.NS_B.* for bench/ab.py. Same flags as CMakeLists.txt; needs .venv with torch.
#
#   bash bench/build_renamed.sh SRC_DIR NS OUT.so
#   e.g.  mkdir -p /tmp/old && git archive HEAD~1 csrc | tar -x -C /tmp/old
#         bash bench/build_renamed.sh /tmp/old/csrc kfA /tmp/kfA.so
#         bash bench/build_renamed.sh csrc kfB /tmp/kfB.so
set -euo pipefail
[ $# -eq 3 ] || { echo "usage: $0 SRC_DIR NS OUT.so" >&2; exit 2; }
SRC=$1 NS=$2 OUT=$3
ROOT=$(cd "$(dirname "$0")/.." && pwd)
TORCH=$("$ROOT/.venv/bin/python" -c "import os, torch; print(os.path.dirname(torch.__file__))")
WORK=$(mktemp -d)
trap 'rm -rf "$WORK"' EXIT
cp -r "$SRC"/. "$WORK"/  # csrc/ with its subfolders (cpu/, ...), or an older flat one
find "$WORK" -type f \( -name '*.cpp' -o -name '*.h' \) -exec sed -i "s/kivi_fast/$NS/g" {} +
FLAGS="-I$WORK -isystem $TORCH/include -isystem $TORCH/include/torch/csrc/api/include -O3 -DNDEBUG -fPIC -fopenmp -std=gnu++20 -Wno-psabi"
pids=()
# the CUDA kernels' CPU emulation (cuda_emulation/) is a library of its own, not part of the ops
mapfile -t sources < <(find "$WORK" -name '*.cpp' -not -path '*/cuda_emulation/*' | sort)
for f in "${sources[@]}"; do
  extra=""
  case "$(basename "$f")" in  # as CMakeLists.txt
    simd_rows.cpp|median.cpp) extra="-fno-trapping-math" ;;
    few_points.cpp) extra="-falign-loops=32" ;;
  esac
  g++ $FLAGS $extra -c "$f" -o "${f%.cpp}.o" &
  pids+=($!)
done
for p in "${pids[@]}"; do wait "$p"; done  # a failed compile stops the script
g++ -shared -o "$OUT" "${sources[@]/%.cpp/.o}" -Wl,-rpath,"$TORCH/lib" -L"$TORCH/lib" -lc10 -ltorch_cpu
echo "built $OUT (ops as torch.ops.$NS.*)"
