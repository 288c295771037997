#!/usr/bin/env bash
# The GPU checks, on a machine whose python3 has a CUDA build of torch (CI has no GPU and never runs
# this): builds kivi_fast with its CUDA kernels into that environment, then runs the CUDA tests, the
# kernels under compute-sanitizer (where installed: memcheck, and racecheck on kernels that stage
# tiles in shared memory), bench/gpu.py, then the pure sides and ours under torch.compile with CUDA
# graphs on the shapes where they can pay (bench/gpu.py --compiled: minutes of compiling; the
# baselines the ratios need, before what only explains them), bench/train_steps.py, and last the
# profiles of where the GPU time goes with the kernels' A/B switches: ours on six shapes (bench/gpu.py
# --profile), the training steps replayed from CUDA graphs (bench/train_steps.py --profile).
# Everything it prints also goes to OUT_DIR/gpu_check.log; the benches' JSON go to OUT_DIR.
#   bash scripts/gpu_check.sh [OUT_DIR]            (default: runs/gpu_check)
#   PHASES=tests,bench bash scripts/gpu_check.sh   (a subset of build,tests,sanitizer,bench,compiled,steps,profile)
#   CUDA_ARCH=90 bash scripts/gpu_check.sh         (default: the GPUs of this machine)
# All of it should take ~11 minutes on an H200 (estimated; the compiled phase ~5): where one command
# may run 10 minutes at most, run PHASES=build,tests,sanitizer,bench, then PHASES=compiled,steps,profile
# on the same machine. The benches write their JSON after each row: a run cut off keeps what it timed.
set -uo pipefail
cd "$(dirname "$0")/.."
out="${1:-runs/gpu_check}"
mkdir -p "$out"
exec > >(tee -a "$out/gpu_check.log") 2>&1
PHASES="${PHASES:-build,tests,sanitizer,bench,compiled,steps,profile}"
has() { [[ ",$PHASES," == *",$1,"* ]]; }
export PYTHONUNBUFFERED=1 CMAKE_BUILD_PARALLEL_LEVEL="${CMAKE_BUILD_PARALLEL_LEVEL:-$(nproc)}"
date
nvidia-smi -L || { echo "gpu_check: no NVIDIA GPU visible"; exit 2; }
python3 -c "import torch, sys; print('torch', torch.__version__, 'cuda', torch.version.cuda); sys.exit(not torch.cuda.is_available())" \
  || { echo "gpu_check: python3's torch sees no CUDA device"; exit 2; }
status=0
failed=()
fail() { status=1; failed+=("$1"); }  # a phase's step failed: say which at the end
if has build; then
  arch=()
  [ -n "${CUDA_ARCH:-}" ] && arch=(-Ccmake.define.CMAKE_CUDA_ARCHITECTURES="$CUDA_ARCH")
  t0=$(date +%s)
  if ! python3 -m pip install --no-build-isolation --no-deps -e . "${arch[@]}" > "$out/build.log" 2>&1; then
    tail -40 "$out/build.log"; echo "gpu_check: the build failed ($out/build.log)"; exit 1
  fi
  echo "built in $(( $(date +%s) - t0 )) s"
fi
if has tests; then
  python3 -m pytest -q -ra python_tests/test_cuda.py python_tests/test_backend.py python_tests/test_bench_sides.py || fail tests
fi
if has sanitizer && command -v compute-sanitizer > /dev/null; then
  # every kernel path of csrc/cuda/ at small sizes: out-of-bounds and misaligned accesses
  timeout 180 compute-sanitizer --tool memcheck --print-limit 5 --error-exitcode 3 python3 - <<'PY' || fail memcheck
import torch, kivi_fast
for b, n_p, n_q, d in [(3, 20, 30, 8), (2, 256, 256, 4), (2, 5, 7, 20), (1, 10, 10, 3000), (2, 40, 24, 100),
                       (1, 300, 300, 3), (2, 150, 141, 600), (2, 100, 100, 700), (1, 70, 60, 300), (300, 100, 100, 8),
                       (2, 300, 260, 3)]:
    for reverse in (True, False):
        p = torch.randn(b, n_p, d, device="cuda")
        q = torch.randn(b, n_q, d, device="cuda", requires_grad=True)
        kivi_fast.kernel_kl(p, q, reverse=reverse).sum().backward()
        kivi_fast.kernel_kl(p, q, reverse=reverse, bandwidth=1.5).sum().backward()  # no median
torch.cuda.synchronize()
print("compute-sanitizer: kernels ran")
PY
  # shared-memory races in the kernels that stage tiles (the tiled distances, the forward, the backward,
  # the median of many pairs)
  timeout 180 compute-sanitizer --tool racecheck --print-limit 5 --error-exitcode 3 python3 - <<'PY' || fail racecheck
import torch, kivi_fast
for b, n_p, n_q, d in [(1, 70, 60, 300), (2, 20, 30, 8), (1, 9, 13, 3000), (1, 300, 250, 3)]:
    p = torch.randn(b, n_p, d, device="cuda")
    q = torch.randn(b, n_q, d, device="cuda", requires_grad=True)
    kivi_fast.kernel_kl(p, q).sum().backward()
torch.cuda.synchronize()
print("compute-sanitizer racecheck: kernels ran")
PY
fi
if has bench; then
  python3 bench/gpu.py --dtypes float32 --shapes 128x100x8,1024x100x8,100x8,10x314000,100x50000,100x700,1000x32,2000x32,5000x64 \
    --json "$out/cuda_results.json" || fail bench
  python3 bench/gpu.py --dtypes float64 --shapes 128x100x8,1024x100x8,100x8 --json "$out/cuda_results64.json" || fail bench64
fi
if has compiled; then
  # (the shapes of the 10x target and the host-bound one: launches are what compiling and CUDA graphs
  # save, so the strongest pure sides there are compiled with reduce-overhead; ours the same way beside
  # them, like for like; forward + backward only, the targets' pass: each shape costs three compiles,
  # tens of seconds each with Triton)
  python3 bench/gpu.py --compiled --compile-mode reduce-overhead --dtypes float32 --passes fwd+bwd \
    --shapes 128x100x8,1024x100x8,1000x32 --json "$out/cuda_compiled.json" || fail compiled
fi
if has steps; then
  python3 bench/train_steps.py --json "$out/train_steps.json" || fail steps
fi
if has profile; then
  python3 bench/gpu.py --profile --dtypes float32 --shapes 128x100x8,1024x100x8,100x50000,100x700,1000x32,5000x64 || fail profile
  python3 bench/train_steps.py --profile || fail steps-profile
fi
date
if [ "$status" -eq 0 ]; then echo "gpu_check: all phases passed ($PHASES)"; else echo "gpu_check: failed: ${failed[*]}"; fi
exit $status
