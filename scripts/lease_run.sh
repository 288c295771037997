#!/usr/bin/env bash
# A long run in pieces, one device lease a piece: the paper's full VAE protocol on a GPU. A lease's
# machine starts bare, a command there runs at most 10 minutes, only 8 files of at most 16 MiB each come
# back from its $OUT, and what `carry` takes to the next is 64 MiB with the working tree (~42 MiB); so
# between leases the run folder travels packed, in parts, and must stay under ~20 MiB (the VAE's: 16;
# MNIST's at L = 400 is ~57, more than carry takes: run it in calls that follow each other on one warm
# machine, where STATE/run stays between them):
#   bash scripts/lease_run.sh STATE OUT_DIR -- COMMAND ARGS...
# - STATE: a folder carried to the machine (the device tool's `carry`), holding the parts the last
#   piece brought back (run.tar.part-NN), or nothing before the first piece. The parts are unpacked
#   to STATE/run; RUN in ARGS stands for that folder.
# - Where torch sees a GPU, the extension is built first (pip install -e ., incremental on a warm
#   machine; a minute on a bare one).
# - `python3 -m kivi_fast.cli COMMAND ARGS` runs under `timeout` for what is left of BUDGET_S (default
#   540 s) less PACK_S (default 30 s) to pack. Give the trainer a --minutes that ends it before that:
#   cut off, the run keeps only its last checkpoint (every --checkpoint-every seconds).
# - STATE/run is packed into OUT_DIR/run.tar.part-NN (15 MiB each), beside lease.log (the command's
#   output) and copies of the run's history.json and results.json, where they exist, to read.
# The command's exit status is the script's (124 when cut off); the run is packed either way.
# The VAE's full protocol (3,000 epochs: ~27 minutes on an H200), 6 minutes of training a piece (a bare
# machine builds for a minute first; call with the device tool's timeout_s at BUDGET_S + 30):
#   bash scripts/lease_run.sh runs/vae-full "$OUT" -- vae --epochs 3000 --device cuda --cuda-graph \
#     --minutes 6 --run-dir RUN
# Back here, put the files that came back into runs/vae-full/ (replacing the old parts) and run the same
# command again with carry ["runs/vae-full"]; it resumes exactly from the checkpoint. After the last
# epoch, the same way: ... -- vae-ais RUN --device cuda.
set -uo pipefail
cd "$(dirname "$0")/.."
usage="usage: bash scripts/lease_run.sh STATE OUT_DIR -- COMMAND ARGS... (RUN in ARGS: the run folder)"
[ $# -ge 4 ] && [ "$3" = -- ] || { echo "lease_run: $usage"; exit 2; }
state=$1 out=$2
shift 3
budget="${BUDGET_S:-540}" pack_s="${PACK_S:-30}" py="${PYTHON:-python3}"
for v in budget pack_s; do
  [[ "${!v}" =~ ^[0-9]+$ ]] || { echo "lease_run: BUDGET_S and PACK_S must be whole numbers of seconds"; exit 2; }
done
start=$(date +%s)
mkdir -p "$state" "$out"
exec > >(tee -a "$out/lease.log") 2>&1
run="$state/run"
args=()
for a in "$@"; do
  if [ "$a" = RUN ]; then args+=("$run"); else args+=("$a"); fi
done

shopt -s nullglob
parts=("$state"/run.tar.part-*)
if [ ${#parts[@]} -gt 0 ]; then
  # the parts are what the last piece left: they replace any older unpacked copy
  rm -rf "$run"
  cat "${parts[@]}" | tar -x -C "$state" || { echo "lease_run: the parts in $state do not unpack"; exit 2; }
  rm -f "${parts[@]}"
  echo "lease_run: unpacked ${#parts[@]} parts into $run"
fi

if "$py" -c "import torch, sys; sys.exit(not torch.cuda.is_available())" 2> /dev/null; then
  echo "lease_run: building the extension"
  if ! "$py" -m pip install --no-build-isolation --no-deps -e . > "$out/build.log" 2>&1; then
    tail -40 "$out/build.log"; echo "lease_run: the build failed"; exit 1
  fi
fi

left=$(( budget - pack_s - ($(date +%s) - start) ))
(( left >= 1 )) || { echo "lease_run: no time left of BUDGET_S=$budget for the command"; exit 124; }
echo "lease_run: $py -m kivi_fast.cli ${args[*]} (at most $left s)"
PYTHONUNBUFFERED=1 timeout -k 10 "$left" "$py" -m kivi_fast.cli "${args[@]}"
rc=$?
(( rc == 124 || rc == 137 )) && echo "lease_run: cut off after $left s; the run keeps its last checkpoint"

if [ -d "$run" ]; then
  tar -c -C "$state" --exclude='*.tmp' run | split -b 15M -d -a 2 - "$out/run.tar.part-"
  for f in history.json results.json; do
    [ -f "$run/$f" ] && cp "$run/$f" "$out/$f"
  done
  n_parts=$(ls "$out"/run.tar.part-* | wc -l)
  mib=$(( $(cat "$out"/run.tar.part-* | wc -c) >> 20 ))
  echo "lease_run: packed $run into $n_parts parts ($mib MiB) in $out"
  if (( mib > ${CARRY_MIB:-20} )); then
    echo "lease_run: WARNING: $mib MiB is more than carry takes beside the working tree (CARRY_MIB=${CARRY_MIB:-20});" \
         "continue on this machine while it is warm (STATE/run stays), not on the next lease"
  fi
else
  echo "lease_run: the command made no run folder $run to pack"
fi
exit "$rc"
