"""scripts/gpu_check.sh's control flow, on this machine with stand-ins for the GPU's tools: a fake
nvidia-smi and a fake python3 that records each call. A lease's device time is short and its script
cannot be tried beforehand, so what it runs, in which order, and what it does when its time budget
runs out or a step fails is checked here."""

import os
import subprocess

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ORDER = ["build", "tests", "bench", "profile", "stalls", "steps", "compiled", "sanitizer", "bench64"]

FAKE_PYTHON = """#!/bin/bash
echo "$*" >> "$FAKE_LOG"
case "$1" in
  -c) echo "torch (fake) cuda 13.0"; exit 0 ;;
  -m) case "$2" in
        pip) sleep "${FAKE_BUILD_S:-0}"; exit 0 ;;
        pytest) sleep "${FAKE_TESTS_S:-0}"; exit "${FAKE_TESTS_RC:-0}" ;;
      esac ;;
esac
exit 0
"""


# Nsight Compute's CLI: records its arguments, writes a raw metric to --log-file, runs the program
FAKE_NCU = """#!/bin/bash
echo "ncu $*" >> "$FAKE_LOG"
while [ "$1" != python3 ]; do
  if [ "$1" = --log-file ]; then echo "smsp__average_warps_issue_stalled_barrier_per_issue_active.ratio 4.2" > "$2"; fi
  shift
done
exec "$@"
"""


GPU_TOOLS = {"ncu", "compute-sanitizer", "nvidia-smi", "nvcc", "nsys"}


def gpu_check(tmp_path, tools=(), **env):
    """Runs gpu_check.sh into tmp_path/out with the stand-ins (and those of `tools`: "ncu"); (exit
    status, output, phases.tsv rows, the fake tools' calls)."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    stand_ins = {"python3": FAKE_PYTHON, "nvidia-smi": "#!/bin/bash\necho 'GPU 0: fake'\n"}
    stand_ins.update({name: {"ncu": FAKE_NCU}[name] for name in tools})
    for name, text in stand_ins.items():
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(0o755)
    # the system's tools without the GPU's (a CUDA toolkit packaged into /usr/bin puts ncu and
    # compute-sanitizer there): what the script finds is only what the test gives it
    system = tmp_path / "system_bin"
    system.mkdir(exist_ok=True)
    for directory in ("/usr/bin", "/bin"):
        for entry in os.scandir(directory) if os.path.isdir(directory) else ():
            if entry.name not in GPU_TOOLS and not os.path.lexists(system / entry.name):
                os.symlink(entry.path, system / entry.name)
    log = tmp_path / "calls.log"
    out = tmp_path / "out"
    run = subprocess.run(["bash", os.path.join(ROOT, "scripts", "gpu_check.sh"), str(out)],
                         env={"PATH": f"{bin_dir}:{system}", "FAKE_LOG": str(log), "HOME": str(tmp_path),
                              **env},
                         capture_output=True, text=True, timeout=120)
    phases = [line.split("\t") for line in (out / "phases.tsv").read_text().splitlines()] \
        if (out / "phases.tsv").exists() else []
    calls = log.read_text().splitlines() if log.exists() else []
    return run.returncode, run.stdout + run.stderr, phases, calls


def test_every_phase_runs_in_order_and_is_logged(tmp_path):
    rc, output, phases, calls = gpu_check(tmp_path)
    assert rc == 0, output
    assert [p[0] for p in phases] == ORDER
    assert all(p[1] == "ok" for p in phases), phases
    scripts = [c for c in calls if not c.startswith("-c")]
    assert scripts[0].startswith("-m pip install")
    assert scripts[1].startswith("-m pytest")
    # the build checks for machines without a GPU are left out: the build phase has just built the kernels
    assert "not compile_with_nvcc and not compile_as_in_a_cuda_build and not stops_the_build" in scripts[1]
    # bench, profile (kernels, then the graphed steps), steps, compiled, bench64
    assert [c.split()[0] for c in scripts[2:]] == ["bench/gpu.py", "bench/gpu.py", "bench/train_steps.py",
                                                  "bench/train_steps.py", "bench/gpu.py", "bench/gpu.py"]
    assert "--profile" in scripts[3] and "--compiled" in scripts[6] and "float64" in scripts[7]
    assert "no compute-sanitizer here" in output and "no ncu (Nsight Compute) here" in output
    assert (tmp_path / "out" / "gpu_check.log").read_text().count("gpu_check: bench (") == 1


def test_a_budget_cuts_off_a_step_skips_the_rest_and_names_them(tmp_path):
    # the build takes 1 s, the tests would take 30: cut off when the 6 s budget runs out
    rc, output, phases, calls = gpu_check(tmp_path, BUDGET_S="6", MIN_S_ALL="2", FAKE_BUILD_S="1",
                                          FAKE_TESTS_S="30")
    assert rc == 1, output
    assert phases[0][:2] == ["build", "ok"]
    assert phases[1][:2] == ["tests", "cut off"] and int(phases[1][2]) <= 7
    assert "failed: tests (cut off by BUDGET_S)" in output
    assert [p[1] for p in phases[2:]] == ["skipped"] * 7
    assert "the rest: PHASES=tests,bench,profile,stalls,steps,compiled,sanitizer,bench64 bash scripts/gpu_check.sh" \
        in output
    assert not any(c.startswith("bench/") for c in calls)


def test_a_failed_step_is_named_and_the_other_phases_still_run(tmp_path):
    rc, output, phases, _ = gpu_check(tmp_path, FAKE_TESTS_RC="1", PHASES="tests,bench")
    assert rc == 1
    assert phases == [["tests", "failed", phases[0][2]], ["bench", "ok", phases[1][2]]]
    assert output.rstrip().endswith("gpu_check: failed: tests")


@pytest.mark.parametrize("env, message", [
    ({"PHASES": "tests,benches"}, "unknown phase 'benches'"),
    ({"BUDGET_S": "9m"}, "BUDGET_S must be a whole number of seconds"),
])
def test_bad_settings_are_refused_before_anything_runs(tmp_path, env, message):
    rc, output, phases, calls = gpu_check(tmp_path, **env)
    assert rc == 2 and message in output
    assert phases == [] and calls == []


def test_the_stalls_phase_profiles_one_forward_launch_where_ncu_is_installed(tmp_path):
    rc, output, phases, calls = gpu_check(tmp_path, tools=("ncu",), PHASES="stalls")
    assert rc == 0 and phases == [["stalls", "ok", phases[0][2]]], output
    (at,) = [i for i, c in enumerate(calls) if c.startswith("ncu ")]
    ncu, after = calls[at], "\n".join(calls[at + 1:])  # (the program's lines follow each tool's call)
    assert "--kernel-name regex:kl_forward_kernel" in ncu and "--launch-count 1" in ncu
    assert f"--log-file {tmp_path / 'out' / 'stalls.txt'}" in ncu and "python3 -c" in ncu
    assert after.count("kernel_kl(p, q)") == 2  # in ncu's arguments, then python3 ran the program
    assert "stalled_barrier_per_issue_active.ratio 4.2" in output  # the stall metrics, in the log too
