#!/usr/bin/env bash
# The GPU checks, on a machine whose python3 has a CUDA build of torch (CI has no GPU: there
# python_tests/test_gpu_check.py runs this script's control flow with stand-ins for the GPU's tools):
# builds kivi_fast with its CUDA kernels into that environment, then runs its phases in this order,
# the ones that decide the most first, so that a lease cut short keeps them:
#   build     the extension with csrc/cuda/
#   tests     the CUDA tests (python_tests/test_cuda.py and the sides' and backend's GPU tests; not the
#             build checks for machines without a GPU, which the build phase has just made moot)
#   bench     bench/gpu.py, float32: ours against the pure sides eager (cuda_results.json)
#   profile   where the GPU time goes: kernels by GPU time, the host's share of a call, the forward
#             kernel's stage clocks and the kernels' A/B switches (bench/gpu.py --profile), then the
#             graphed training steps' kernels (bench/train_steps.py --profile)
#   stalls    why the forward kernel's warps wait at 128 x (100, 8), by stall reason: Nsight Compute's
#             warp-state and scheduler metrics of one launch (where ncu is installed; OUT_DIR/stalls.txt)
#   steps     bench/train_steps.py: the VAE and MNIST steps, eager and graphed (train_steps.json)
#   compiled  the pure sides and ours under torch.compile with CUDA graphs, and each side's call captured
#             in a CUDA graph, on the shapes where that can pay (bench/gpu.py --compiled --graphed: a
#             minute or two of compiling; cuda_compiled.json)
#   sanitizer compute-sanitizer memcheck over every kernel path, racecheck and synccheck on the kernels
#             that use shared memory (where compute-sanitizer is installed)
#   bench64   bench/gpu.py, float64 (cuda_results64.json)
# Everything it prints also goes to OUT_DIR/gpu_check.log, the benches' JSON to OUT_DIR (written after
# each row: a phase cut off keeps what it timed), and one line a phase (name, result, seconds) to
# OUT_DIR/phases.tsv.
#   bash scripts/gpu_check.sh [OUT_DIR]              (default: runs/gpu_check)
#   PHASES=tests,bench bash scripts/gpu_check.sh     (a subset, run in the order above)
#   BUDGET_S=545 bash scripts/gpu_check.sh OUT_DIR   (stop within 545 s: below)
#   CUDA_ARCH=90 bash scripts/gpu_check.sh           (default: the GPUs of this machine)
# BUDGET_S: each command runs under `timeout` for what is left of the budget, and a phase is not
# started with less left than it needs at the least (MIN_S below); those skipped or cut off are named
# at the end with the command that runs them. On an H200 (torch 2.11, commit c9bdbef) the build took 62 s,
# the tests 122 s (four worker processes), the bench 33 s, the profile 61 s, the stalls 8 s, the steps 13 s,
# the compiled phase 95 s, the sanitizer 28 s and bench64 14 s: 436 s in all. A lease of 15 minutes of
# device time, one command at most 10 (a machine's start takes 1-2 of them):
# BUDGET_S=545 with timeout_s 575, then what time is left for the phases it names or a second check.
set -uo pipefail
cd "$(dirname "$0")/.."
out="${1:-runs/gpu_check}"
mkdir -p "$out"
exec > >(tee -a "$out/gpu_check.log") 2>&1
ORDER=(build tests bench profile stalls steps compiled sanitizer bench64)
declare -A MIN_S=([build]=60 [tests]=60 [bench]=60 [profile]=60 [stalls]=30 [steps]=45 [compiled]=120
                  [sanitizer]=60 [bench64]=30)
if [ -n "${MIN_S_ALL:-}" ]; then for p in "${ORDER[@]}"; do MIN_S[$p]=$MIN_S_ALL; done; fi  # (its test's)
PHASES="${PHASES:-$(IFS=,; echo "${ORDER[*]}")}"
for p in ${PHASES//,/ }; do
  [[ -v MIN_S[$p] ]] || { echo "gpu_check: unknown phase '$p' in PHASES (known: ${ORDER[*]})"; exit 2; }
done
budget="${BUDGET_S:-0}"  # 0: no limit
[[ "$budget" =~ ^[0-9]+$ ]] || { echo "gpu_check: BUDGET_S must be a whole number of seconds, got '$budget'"; exit 2; }
start=$(date +%s)
left() { if [ "$budget" -gt 0 ]; then echo $(( budget - ($(date +%s) - start) )); else echo 86400; fi; }
# a command under what is left of the budget (and at most $1 s): exit status 124 when cut off
capped() {
  local cap=$1 l
  shift
  l=$(left)
  (( l < cap )) && cap=$l
  (( cap < 1 )) && return 124
  timeout -k 10 "$cap" "$@"
}
export PYTHONUNBUFFERED=1 CMAKE_BUILD_PARALLEL_LEVEL="${CMAKE_BUILD_PARALLEL_LEVEL:-$(nproc)}"
date
nvidia-smi -L || { echo "gpu_check: no NVIDIA GPU visible"; exit 2; }
python3 -c "import torch, sys; print('torch', torch.__version__, 'cuda', torch.version.cuda); sys.exit(not torch.cuda.is_available())" \
  || { echo "gpu_check: python3's torch sees no CUDA device"; exit 2; }

failed=()  # phase:step of each failure
step() {  # step NAME CAP_S COMMAND...: a phase's command; a failure or a cut-off is named at the end
  local name=$1 rc
  shift
  capped "$@"
  rc=$?
  if [ "$rc" -eq 124 ] || [ "$rc" -eq 137 ]; then failed+=("$name (cut off by BUDGET_S)"); cut_off=1
  elif [ "$rc" -ne 0 ]; then failed+=("$name")
  fi
  return "$rc"
}

phase_build() {
  local arch=()
  [ -n "${CUDA_ARCH:-}" ] && arch=(-Ccmake.define.CMAKE_CUDA_ARCHITECTURES="$CUDA_ARCH")
  if ! step build 900 python3 -m pip install --no-build-isolation --no-deps -e . "${arch[@]}" > "$out/build.log" 2>&1; then
    tail -40 "$out/build.log"; echo "gpu_check: the build failed ($out/build.log)"; return 1
  fi
}
phase_tests() {
  # The build phase has just compiled csrc/ with this nvcc against this torch, so the tests that check
  # the build where there is no GPU (nvcc's and g++'s front ends, CMake's configure checks: a minute
  # of a lease) are left to CI; four worker processes share the GPU where pytest-xdist is installed.
  local workers=()
  python3 -c "import xdist" 2> /dev/null && workers=(-n 4)
  step tests 600 python3 -m pytest -q -ra --durations=10 "${workers[@]}" python_tests/test_cuda.py \
    python_tests/test_backend.py python_tests/test_bench_sides.py \
    -k "not compile_with_nvcc and not compile_as_in_a_cuda_build and not stops_the_build"
}
phase_bench() {
  step bench 600 python3 bench/gpu.py --dtypes float32 \
    --shapes 128x100x8,1024x100x8,100x8,10x314000,100x50000,100x700,1000x32,2000x32,5000x64 \
    --json "$out/cuda_results.json"
}
phase_profile() {
  step profile 600 python3 bench/gpu.py --profile --dtypes float32 \
    --shapes 128x100x8,1024x100x8,10x314000,100x50000,100x700,1000x32,5000x64
  step steps-profile 300 python3 bench/train_steps.py --profile
}
phase_stalls() {
  if ! command -v ncu > /dev/null; then echo "gpu_check: no ncu (Nsight Compute) here"; return 0; fi
  # the third launch (after warm-up) of the forward kernel at the VAE's shapes: the stall reasons' share
  # of its warps' cycles (a barrier, the shared-memory and atomic pipe's throttle, a load's latency, ...)
  # say which of the stages' designs to change; the raw page keeps every metric the sections collect
  step stalls 180 ncu --kernel-name regex:kl_forward_kernel --launch-skip 2 --launch-count 1 \
    --section WarpStateStats --section SchedulerStats --page raw --log-file "$out/stalls.txt" python3 -c '
import torch, kivi_fast
p = torch.randn(128, 100, 8, device="cuda")
q = torch.randn(128, 100, 8, device="cuda", requires_grad=True)
for _ in range(3):
    kivi_fast.kernel_kl(p, q).sum().backward()
torch.cuda.synchronize()
'
  grep -iE "stall|issue|warps_active" "$out/stalls.txt" | head -80
}
phase_steps() {
  step steps 600 python3 bench/train_steps.py --json "$out/train_steps.json"
}
phase_compiled() {
  # the shapes where the eager pure sides' launches may bound them: the 10x target's, the host-bound
  # generic one, and the tall ones (a few launches a 16 MB chunk of dimensions): launches are what
  # compiling and CUDA graphs save, so the strongest pure sides there are compiled with
  # reduce-overhead; ours the same way beside them, like for like; and each side's eager call captured
  # in a CUDA graph (--graphed: as a training step captured whole runs it, no host work a call), like
  # for like again; forward + backward only, the targets' pass: each shape costs three compiles, tens
  # of seconds each with Triton
  step compiled 900 python3 bench/gpu.py --compiled --compile-mode reduce-overhead --graphed --dtypes float32 \
    --passes fwd+bwd --shapes 128x100x8,1024x100x8,1000x32,10x314000,100x50000 --json "$out/cuda_compiled.json"
}
phase_sanitizer() {
  if ! command -v compute-sanitizer > /dev/null; then echo "gpu_check: no compute-sanitizer here"; return 0; fi
  # every kernel path of csrc/cuda/ at small sizes: out-of-bounds and misaligned accesses (torch's
  # caching allocator off, so that a read past a tensor is past its allocation too, not inside a
  # cached segment where memcheck would not see it)
  step memcheck 180 env PYTORCH_NO_CUDA_MEMORY_CACHING=1 compute-sanitizer --tool memcheck --print-limit 5 \
    --error-exitcode 3 python3 - <<'PY'
import torch, kivi_fast
for b, n_p, n_q, d in [(3, 20, 30, 8), (2, 256, 256, 4), (2, 5, 7, 20), (1, 10, 10, 3000), (2, 40, 24, 100),
                       (1, 300, 300, 3), (2, 150, 141, 600), (2, 100, 100, 700), (1, 70, 60, 300), (300, 100, 100, 8),
                       (2, 300, 260, 3), (2, 128, 128, 8)]:  # (the last: a 128-row system, the most the back
                                                              # substitution holds in registers)
    for reverse in (True, False):
        p = torch.randn(b, n_p, d, device="cuda")
        q = torch.randn(b, n_q, d, device="cuda", requires_grad=True)
        kivi_fast.kernel_kl(p, q, reverse=reverse).sum().backward()
        kivi_fast.kernel_kl(p, q, reverse=reverse, bandwidth=1.5).sum().backward()  # no median
torch.ops.kivi_fast_testing.set_gemm_kernel_values(True)  # (off by default) the kernel values' GEMM variant
p, q = torch.randn(2, 300, 3, device="cuda"), torch.randn(2, 260, 3, device="cuda", requires_grad=True)
kivi_fast.kernel_kl(p, q).sum().backward()
torch.ops.kivi_fast_testing.set_gemm_kernel_values(False)
torch.ops.kivi_fast_testing.set_product_tile_distances(True)  # (off by default) the tiles' norms and products
for b, n_p, n_q, d in [(1, 70, 60, 300), (2, 300, 260, 3)]:
    p, q = torch.randn(b, n_p, d, device="cuda"), torch.randn(b, n_q, d, device="cuda", requires_grad=True)
    kivi_fast.kernel_kl(p, q).sum().backward()
torch.ops.kivi_fast_testing.set_product_tile_distances(False)
torch.ops.kivi_fast_testing.set_gemm_pair_distances(True)  # (off by default) the pairs by cuBLAS where d >= N
for b, n_p, n_q, d in [(1, 70, 60, 300), (2, 5, 7, 3000)]:
    p, q = torch.randn(b, n_p, d, device="cuda"), torch.randn(b, n_q, d, device="cuda", requires_grad=True)
    kivi_fast.kernel_kl(p, q).sum().backward()
torch.ops.kivi_fast_testing.set_gemm_pair_distances(False)
for shape in [(3, 100, 8), (2, 7, 33), (1, 10, 3000)]:  # the diagonal contrast's kernels (cuda/contrast.cu)
    q = torch.randn(shape, device="cuda", requires_grad=True)
    kivi_fast.adaptive_contrast_kl(q, None, contrast="diagonal").sum().backward()
torch.cuda.synchronize()
print("compute-sanitizer: kernels ran")
PY
  # the kernels that stage tiles in shared memory (the tiled distances, the forward, the backward, the
  # median of many pairs) or sum there (the contrast's): racecheck for races, synccheck for barriers
  # that not every thread of a block reaches
  local shared_memory_kernels='
import torch, kivi_fast
for b, n_p, n_q, d in [(1, 70, 60, 300), (2, 20, 30, 8), (1, 9, 13, 3000), (1, 300, 250, 3), (1, 100, 100, 700)]:
    p = torch.randn(b, n_p, d, device="cuda")  # (the last: the median from a copy of the distances)
    q = torch.randn(b, n_q, d, device="cuda", requires_grad=True)
    kivi_fast.kernel_kl(p, q).sum().backward()
q = torch.randn(2, 7, 33, device="cuda", requires_grad=True)
kivi_fast.adaptive_contrast_kl(q, None, contrast="diagonal").sum().backward()
torch.ops.kivi_fast_testing.set_product_tile_distances(True)  # the tiles with their norms in shared memory
for n_p, n_q, d in [(70, 60, 300), (300, 250, 3)]:  # pair_tile_kernel; both tile kernels (the generic path)
    p, q = torch.randn(1, n_p, d, device="cuda"), torch.randn(1, n_q, d, device="cuda", requires_grad=True)
    kivi_fast.kernel_kl(p, q).sum().backward()
torch.ops.kivi_fast_testing.set_product_tile_distances(False)
torch.cuda.synchronize()
print("compute-sanitizer: kernels ran")
'
  for tool in racecheck synccheck; do
    step "$tool" 180 compute-sanitizer --tool "$tool" --print-limit 5 --error-exitcode 3 python3 -c "$shared_memory_kernels"
  done
}
phase_bench64() {
  step bench64 300 python3 bench/gpu.py --dtypes float64 --shapes 128x100x8,1024x100x8,100x8 \
    --json "$out/cuda_results64.json"
}

rest=()  # the phases skipped or cut off for time, in order
: > "$out/phases.tsv"
for p in "${ORDER[@]}"; do
  [[ ",$PHASES," == *",$p,"* ]] || continue
  if (( $(left) < MIN_S[$p] )); then
    rest+=("$p")
    echo "gpu_check: $p skipped: $(left) s left of BUDGET_S=$budget, it needs ~${MIN_S[$p]}"
    printf '%s\tskipped\t0\n' "$p" >> "$out/phases.tsv"
    continue
  fi
  echo "gpu_check: $p ($(left) s left)"
  t0=$(date +%s)
  n_failed=${#failed[@]}
  cut_off=0
  "phase_$p"
  rc=$?
  result=ok
  (( ${#failed[@]} > n_failed )) && result=failed
  (( cut_off )) && { result="cut off"; rest+=("$p"); }
  printf '%s\t%s\t%s\n' "$p" "$result" "$(( $(date +%s) - t0 ))" >> "$out/phases.tsv"
  if [ "$p" = build ] && [ "$rc" -ne 0 ]; then exit 1; fi
done
date
echo "gpu_check: seconds by phase:"; sed 's/^/  /' "$out/phases.tsv"
if [ ${#rest[@]} -gt 0 ]; then
  echo "gpu_check: not run or cut off for time: ${rest[*]}; the rest: PHASES=$(IFS=,; echo "${rest[*]}") bash scripts/gpu_check.sh OUT_DIR"
fi
if [ ${#failed[@]} -eq 0 ]; then echo "gpu_check: the phases run passed ($PHASES)"; exit 0; fi
echo "gpu_check: failed: ${failed[*]}"
exit 1
