#!/usr/bin/env bash
# One entry point for a fresh machine: creates (or reuses) .venv, installs torch 2.13.0 (CPU) and the
# dependencies, builds the C++ ops into the package, then runs what was asked:
#   bash scripts/run.sh main      the main job: BNN regression on UCI Boston, 3 splits x 500 epochs
#                                 (~1.5 minutes), printed beside the paper's Table 1; results in runs/
#   bash scripts/run.sh toy       the 1-D Gaussian-mixture toy (Section 5.1)
#   bash scripts/run.sh test      the test suite
#   bash scripts/run.sh bench     the benchmarks of bench/ (prints the table of bench/README.md)
#   bash scripts/run.sh setup     set-up only
set -euo pipefail
cd "$(dirname "$0")/.."
what="${1:-main}"; shift || true

VENV="${KIVI_FAST_VENV:-.venv}"
PY="$VENV/bin/python"
if [ ! -x "$PY" ]; then
  python3 -m venv "$VENV"
fi
stamp="$VENV/.kivi_fast_deps"
deps="torch==2.13.0 scikit-build-core>=0.10 cmake>=3.18 ninja numpy scipy tqdm matplotlib pytest pytest-xdist hypothesis pyro-ppl==1.9.2"
if [ ! -f "$stamp" ] || [ "$(cat "$stamp")" != "$deps" ]; then
  # torch is pinned exactly: an unpinned one would resolve the newest release (on this project's
  # machines a CUDA build of several GB). Where the index serves 2.13.0 itself as a CUDA build,
  # install the CPU wheel into $VENV first (pip's --index-url of PyTorch's CPU wheels): it satisfies
  # the pin, and nothing more is fetched.
  "$PY" -m pip install --quiet --upgrade pip
  "$PY" -m pip install --quiet $deps
  echo "$deps" > "$stamp"
fi
# Build the ops against the torch just installed (no build isolation), editable so edits to the
# Python files take effect at once. Rebuilds only when csrc/ or the build files changed.
src_hash=$( (cat CMakeLists.txt pyproject.toml; find csrc -type f | LC_ALL=C sort | xargs sha256sum) | sha256sum | cut -d' ' -f1)
if [ ! -f "$VENV/.kivi_fast_build" ] || [ "$(cat "$VENV/.kivi_fast_build")" != "$src_hash" ]; then
  "$PY" -m pip install --quiet --no-build-isolation --no-deps -e .
  echo "$src_hash" > "$VENV/.kivi_fast_build"
fi
"$PY" -c "import kivi_fast, sys; b = kivi_fast.backend(); print('kivi_fast backend:', b); sys.exit(b != 'cpp')"

case "$what" in
  main)  exec "$PY" -m kivi_fast.cli uci --dataset boston --method kivi --splits 0-2 --epochs 500 "$@" ;;
  toy)   exec "$PY" -m kivi_fast.cli toy "$@" ;;
  test)  exec "$PY" -m pytest python_tests -q -n 2 "$@" ;;  # two worker processes (pytest-xdist); -n N overrides
  bench) exec "$PY" bench/run.py "$@" ;;
  setup) ;;
  *) echo "usage: bash scripts/run.sh [main|toy|test|bench|setup] [args...]" >&2; exit 2 ;;
esac
