"""scripts/lease_run.sh, the runs in pieces of one device lease each, on this machine with a stand-in for
python3: a trainer that adds a line to its run folder's history at each piece and writes a 20 MB
checkpoint at the first (more than one 15 MiB part). What the script carries between pieces, what it
builds, and what it keeps when its time runs out are checked here; the trainers' own exact resume is
test_vae.py's and test_mnist.py's."""

import hashlib
import os
import shutil
import subprocess

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

FAKE_PYTHON = """#!/bin/bash
echo "$*" >> "$FAKE_LOG"
case "$1" in
  -c) exit "${FAKE_GPU_RC:-1}" ;;  # torch.cuda.is_available(): no GPU unless told
  -m) case "$2" in
        pip) exit "${FAKE_BUILD_RC:-0}" ;;
        kivi_fast.cli)
          while [ "$1" != --run-dir ]; do shift; done
          mkdir -p "$2"
          [ -f "$2/checkpoint.pt" ] || head -c 20000000 /dev/urandom > "$2/checkpoint.pt"
          echo piece >> "$2/history.json"
          sleep "${FAKE_TRAIN_S:-0}"
          exit "${FAKE_TRAIN_RC:-0}" ;;
      esac ;;
esac
exit 0
"""


def lease_run(tmp_path, state, out, *command, **env):
    """Runs lease_run.sh STATE OUT -- COMMAND with the stand-in; (exit status, output, the stand-in's calls)."""
    fake = tmp_path / "python3"
    fake.write_text(FAKE_PYTHON)
    fake.chmod(0o755)
    log = tmp_path / "calls.log"
    log.unlink(missing_ok=True)
    run_env = {**os.environ, "PYTHON": str(fake), "FAKE_LOG": str(log), **{k: str(v) for k, v in env.items()}}
    done = subprocess.run(["bash", os.path.join(ROOT, "scripts", "lease_run.sh"), str(state), str(out), *command],
                          env=run_env, capture_output=True, text=True, timeout=120)
    calls = log.read_text().splitlines() if log.exists() else []
    return done.returncode, done.stdout + done.stderr, calls


def digest(path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_two_pieces_carry_the_run_folder_in_parts(tmp_path):
    command = ["--", "vae", "--minutes", "6", "--run-dir", "RUN"]
    rc, output, calls = lease_run(tmp_path, tmp_path / "state", tmp_path / "out1", *command)
    assert rc == 0, output
    first = tmp_path / "state" / "run"
    assert calls[-1] == f"-m kivi_fast.cli vae --minutes 6 --run-dir {first}"  # RUN: the run folder
    assert not any(c.startswith("-m pip") for c in calls)  # no GPU here: no build
    parts = sorted(p.name for p in (tmp_path / "out1").glob("run.tar.part-*"))
    assert parts == ["run.tar.part-00", "run.tar.part-01"]  # 20 MB in parts of 15 MiB
    assert all(p.stat().st_size <= 16 * 2**20 for p in (tmp_path / "out1").iterdir())  # what $OUT brings back
    assert (tmp_path / "out1" / "history.json").read_text() == "piece\n"
    assert len(list((tmp_path / "out1").iterdir())) <= 8

    # the next lease: the parts that came back, carried in a fresh state folder
    state = tmp_path / "state2"
    state.mkdir()
    for name in parts:
        shutil.copy(tmp_path / "out1" / name, state / name)
    rc, output, calls = lease_run(tmp_path, state, tmp_path / "out2", *command)
    assert rc == 0, output
    assert "unpacked 2 parts" in output
    assert digest(state / "run" / "checkpoint.pt") == digest(first / "checkpoint.pt")
    assert (state / "run" / "history.json").read_text() == "piece\npiece\n"  # it went on from the first
    assert not list(state.glob("run.tar.part-*"))  # unpacked, not left to unpack over a later run


def test_the_parts_replace_an_older_unpacked_run(tmp_path):
    lease_run(tmp_path, tmp_path / "a", tmp_path / "out1", "--", "vae", "--run-dir", "RUN")
    state = tmp_path / "b"
    (state / "run").mkdir(parents=True)
    (state / "run" / "stale.txt").write_text("from an earlier call on a warm machine")
    for part in (tmp_path / "out1").glob("run.tar.part-*"):
        shutil.copy(part, state / part.name)
    rc, output, _ = lease_run(tmp_path, state, tmp_path / "out2", "--", "vae", "--run-dir", "RUN")
    assert rc == 0, output
    assert sorted(f.name for f in (state / "run").iterdir()) == ["checkpoint.pt", "history.json"]


def test_cut_off_by_its_budget_it_still_packs_the_run(tmp_path):
    rc, output, _ = lease_run(tmp_path, tmp_path / "state", tmp_path / "out", "--", "vae", "--run-dir", "RUN",
                              BUDGET_S=4, PACK_S=1, FAKE_TRAIN_S=60)
    assert rc == 124 and "cut off" in output
    assert list((tmp_path / "out").glob("run.tar.part-*"))


def test_the_commands_failure_is_its_exit_status(tmp_path):
    rc, output, _ = lease_run(tmp_path, tmp_path / "state", tmp_path / "out", "--", "vae", "--run-dir", "RUN",
                              FAKE_TRAIN_RC=3)
    assert rc == 3 and list((tmp_path / "out").glob("run.tar.part-*"))


def test_with_a_gpu_it_builds_first_and_stops_if_the_build_fails(tmp_path):
    rc, output, calls = lease_run(tmp_path, tmp_path / "state", tmp_path / "out", "--", "vae", "--run-dir", "RUN",
                                  FAKE_GPU_RC=0)
    assert rc == 0 and [c.split()[:2] for c in calls[1:]] == [["-m", "pip"], ["-m", "kivi_fast.cli"]]
    rc, output, calls = lease_run(tmp_path, tmp_path / "state", tmp_path / "out", "--", "vae", "--run-dir", "RUN",
                                  FAKE_GPU_RC=0, FAKE_BUILD_RC=1)
    assert rc == 1 and "build failed" in output and not any("kivi_fast.cli" in c for c in calls)


def test_bad_arguments_are_refused_with_the_usage(tmp_path):
    for args in ([str(tmp_path / "s"), str(tmp_path / "o"), "vae"], [str(tmp_path / "s"), str(tmp_path / "o")]):
        done = subprocess.run(["bash", os.path.join(ROOT, "scripts", "lease_run.sh"), *args],
                              capture_output=True, text=True)
        assert done.returncode == 2 and "usage: bash scripts/lease_run.sh STATE OUT_DIR -- COMMAND" in done.stdout
    rc, output, _ = lease_run(tmp_path, tmp_path / "s", tmp_path / "o", "--", "vae", BUDGET_S="ten")
    assert rc == 2 and "BUDGET_S" in output
    (tmp_path / "t").mkdir()
    (tmp_path / "t" / "run.tar.part-00").write_text("not a tar file")
    rc, output, _ = lease_run(tmp_path, tmp_path / "t", tmp_path / "o", "--", "vae", "--run-dir", "RUN")
    assert rc == 2 and "do not unpack" in output


def test_a_run_folder_too_large_to_carry_is_named(tmp_path):
    """More than carry takes to the next lease beside the working tree (CARRY_MIB; MNIST's run folder at
    L = 400 is ~57 MiB): packed all the same, with a warning to continue on the warm machine."""
    rc, output, _ = lease_run(tmp_path, tmp_path / "state", tmp_path / "out", "--", "vae", "--run-dir", "RUN",
                              CARRY_MIB=10)
    assert rc == 0 and "WARNING: 19 MiB is more than carry takes" in output
    rc, output, _ = lease_run(tmp_path, tmp_path / "state", tmp_path / "out2", "--", "vae", "--run-dir", "RUN")
    assert rc == 0 and "WARNING" not in output and "(19 MiB)" in output
