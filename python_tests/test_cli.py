"""The command line: every subcommand documents its options with their defaults, has --quick and
--no-progress, and turns bad values into usage errors (exit status 2, the usage, no traceback)."""

import os
import subprocess
import sys

import pytest

from kivi_fast import cli
from kivi_fast.experiments import runs
from kivi_fast.experiments.options import HelpFormatter, plural

# per command, bad arguments (split at spaces): each must stop at the argument check
BAD_ARGUMENTS = {
    "uci": "--splits=25 | --splits=abc | --splits=5-3 | --epochs=0 | --epochs=-5 | --epochs=1.5 | --samples=1 | "
           "--lam=0 | --lam=1e-12 | --lr=-1 | --lr=nan | --batch-size=0 | --eval-every=0 | --threads=0 | --checkpoint-seconds=-1 | "
           "--dataset=year | --dataset=mnist | --seed=-1 | --n-hidden=0 | --eval-samples=0 | "
           "--method=kivi-contrast --samples=3",
    "toy": "--steps=0 | --n-samples=1 | --lr=0 | --noise-dim=0 | --s0=-1 | --lam=0 | --clip=0 | --clip=1 | --bandwidth=-1 | --bandwidth=1e-200 | "
           "--bandwidth=abc | --grad-clip=-1 | --eval-samples=1 | --bin-width=0 | --threads=0 | "
           "--seed=99999999999999999999999 | --threads=100000 | --bin-width=1e6 | --bin-width=1e-9 | "
           "--quick --bin-width=1e-3",
    "uci-batch": "yacht:kivi --workers=0 | yacht:kivi --minutes=0 | yacht:kivi --checkpoint-seconds=-1 | "
                 "boston:kivi:25 | mnist:kivi | boston:svgd | boston | year:kivi",
    "uci-kl-probe": "--epochs=0 | --every=0 | --reps=0 | --split=20 | --split=-1 | --threads=0",
    "blr": "--epochs=0 | --n-data=0 | --batch-size=0 | --lr=0 | --kivi-samples=1 | --vi-samples=0 | --lam=0 | --lam=1e-30 | --clip=2 | "
           "--hmc-chains=0 | --hmc-samples=3 | --hmc-warmup=-1 | --hmc-step-size=0 | --hmc-leapfrog=0 | "
           "--eval-samples=1 | --kivi-seeds=0 | --contrast=spherical | --seed=4294967296 | --data-seed=-1 | "
           "--seed=4294967295",
    "client-loop": "--seeds=0 | --steps=0 | --lr=0 | --samples=1 | --dim=0 | --n-data=0 | --noise=nan | "
                   "--settings=svgd | --eval-samples=1 | --samples=3",
    "reverse-ablation": "--steps=0 | --samples=1 | --lam=0 | --clip=1e10 | --lr=0 | --log-every=0 | --eval-samples=1 | "
                        "--seed=4294967296",
    "kl-accuracy": "--dims=0 | --ns=1 | --lams=0 | --lams 1e-3 1e-11 | --reps=0 | --clip=0 | --clip=1.5 | "
                   "--flow-truth-samples=1 | --ns=3 | --quick --ns 3 --dims 8 | --seed=4294967296",
    "boston-posterior": "--epochs=0 | --samples=1 | --lam=0 | --plot-samples=1 | --split=20",
}
BAD = [(command, case.split()) for command, cases in BAD_ARGUMENTS.items() for case in cases.split(" | ")]


@pytest.mark.parametrize("command,bad", BAD, ids=[f"{c} {' '.join(b)}" for c, b in BAD])
def test_bad_values_are_usage_errors(command, bad, tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_:
        cli.main([command, *bad, "--no-progress", *([] if command == "uci-batch" else ["--out", str(tmp_path)])])
    err = capsys.readouterr().err
    assert exit_.value.code == 2
    assert err.startswith(f"usage: kivi-fast {command}") and f"kivi-fast {command}: error: " in err
    assert "Traceback" not in err
    assert not any(tmp_path.iterdir())  # no run folder


def test_bad_values_in_a_real_process_print_no_traceback(tmp_path):
    for argv in (["uci", "--splits", "25"], ["uci", "--epochs", "0"]):
        done = subprocess.run([sys.executable, "-m", "kivi_fast.cli", *argv, "--out", str(tmp_path)],
                              capture_output=True, text=True, timeout=120)
        assert done.returncode == 2, done.stderr
        assert "usage: kivi-fast uci" in done.stderr and "Traceback" not in done.stderr, done.stderr
        assert done.stdout == "" and not any(tmp_path.iterdir())


def test_kl_default_trains_a_layer_whose_samples_lie_on_a_subspace(tmp_path):
    """Boston's second-layer generator (30 hidden units for 51 weights) puts its samples on a subspace.
    kivi-contrast (kl's defaults) takes that layer's diagonal contrast there ("auto"; "full" refused it,
    and the run ended): the run finishes."""
    done = subprocess.run([sys.executable, "-m", "kivi_fast.cli", "uci", "--dataset", "boston", "--method",
                           "kivi-contrast", "--splits", "0", "--quick", "--no-progress", "--out", str(tmp_path)],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert list(tmp_path.glob("*/summary.json")), list(tmp_path.rglob("*"))


def test_an_estimator_refusing_its_samples_ends_a_run_with_one_line(tmp_path, monkeypatch, capsys):
    """A ValueError of the estimator inside training (bad samples from the posterior) ends the run with
    its message, not a traceback."""
    from kivi_fast.nn import bnn

    def refuse(*args, **kwargs):
        raise ValueError("q_z contains NaN or Inf")

    monkeypatch.setattr(bnn.RegressionBNN, "elbo", refuse)
    code = cli.main(["uci", "--dataset", "boston", "--method", "kivi", "--splits", "0", "--quick", "--no-progress",
                     "--out", str(tmp_path)])
    assert code == 1
    err = capsys.readouterr().err
    assert "kivi-fast uci: error: the weight KL failed: q_z contains NaN or Inf" in err and "Traceback" not in err


def test_a_diverged_toy_run_ends_with_one_line(tmp_path, capsys):
    """lr 1e6 sends the implicit posterior's samples to NaN/Inf: the estimator's refusal (or the loss's
    non-finite value) ends the run with one line naming --lr, not a traceback."""
    assert cli.main(["toy", "--quick", "--lr", "1e6", "--no-progress", "--out", str(tmp_path)]) == 1
    err = capsys.readouterr().err
    assert "kivi-fast toy: error:" in err and "try a smaller --lr" in err and "Traceback" not in err


@pytest.mark.parametrize("threads", [2, 3])
def test_a_command_gives_the_caller_its_thread_count_back(threads, tmp_path, capsys):
    """The commands run on one torch thread (runs.begin); cli.main called from a Python process gives
    that process its own count back, also when the run fails."""
    import torch

    torch.set_num_threads(threads)
    assert cli.main(["reverse-ablation", "--quick", "--no-progress", "--run-dir", str(tmp_path / "done")]) == 0
    assert torch.get_num_threads() == threads
    assert cli.main(["reverse-ablation", "--quick", "--lr", "1000", "--no-progress", "--run-dir",
                     str(tmp_path / "failed")]) == 1
    assert torch.get_num_threads() == threads


def test_a_file_in_the_way_or_an_unforeseen_error_is_one_line(tmp_path, capsys, monkeypatch):
    """An OSError (a folder where the run writes a file; also a read-only folder, a full disk) names
    its file; an error no check foresaw names its type, in one line, and KIVI_FAST_TRACEBACK=1 shows
    its traceback; a bad KIVI_FAST_BACKEND is named before the command runs."""
    from kivi_fast.experiments import toy

    (tmp_path / "run" / "results.json.tmp").mkdir(parents=True)
    (tmp_path / "run" / runs.RUN_MARKER).write_text("toy\n")  # (a toy run's folder)
    assert cli.main(["toy", "--quick", "--no-progress", "--run-dir", str(tmp_path / "run")]) == 1
    err = capsys.readouterr().err
    assert f"kivi-fast toy: error: Is a directory: {tmp_path / 'run' / 'results.json.tmp'}" in err

    def damaged(args):
        raise KeyError("final")

    monkeypatch.setattr(toy, "run", damaged)
    assert cli.main(["toy", "--quick", "--no-progress", "--run-dir", str(tmp_path / "r2")]) == 1
    assert capsys.readouterr().err.strip() == ("kivi-fast toy: error: KeyError: 'final' (unforeseen; "
                                               "KIVI_FAST_TRACEBACK=1 shows where)")
    monkeypatch.setenv(cli.TRACEBACK_ENV, "1")
    with pytest.raises(KeyError, match="final"):
        cli.main(["toy", "--quick", "--no-progress", "--run-dir", str(tmp_path / "r3")])
    out = subprocess.run([sys.executable, "-m", "kivi_fast.cli", "toy", "--quick", "--no-progress", "--run-dir",
                          str(tmp_path / "r4")], capture_output=True, text=True, timeout=120,
                         env={**os.environ, "KIVI_FAST_BACKEND": "fortran"})
    assert out.returncode == 1 and "Traceback" not in out.stderr
    assert out.stderr.strip().startswith('kivi-fast toy: error: KIVI_FAST_BACKEND must be "cpp" or "reference"')


def test_a_folder_of_another_kind_of_run_is_refused(tmp_path, capsys):
    """toy into a folder that holds another command's run wrote over its results.json (a vae run's
    rerun then failed on it): the folder says what it holds, another kind of run is a usage error, the
    same kind goes on in it."""
    run = tmp_path / "run"
    assert cli.main(["reverse-ablation", "--quick", "--no-progress", "--run-dir", str(run)]) == 0
    before = (run / "metrics.json").read_bytes()
    with pytest.raises(SystemExit) as exit_:
        cli.main(["toy", "--quick", "--no-progress", "--run-dir", str(run)])
    assert exit_.value.code == 2
    assert f"--run-dir: {run} holds a reverse-ablation run, not a toy one" in capsys.readouterr().err
    assert not (run / "results.json").exists() and (run / "metrics.json").read_bytes() == before
    assert cli.main(["reverse-ablation", "--quick", "--no-progress", "--run-dir", str(run)]) == 0
    failed = tmp_path / "failed"  # a run that failed before writing anything does not hold its folder
    assert cli.main(["mnist", "--quick", "--no-progress", "--data-dir", str(tmp_path / "none"), "--run-dir",
                     str(failed)]) == 1
    assert "mnist.npz not found" in capsys.readouterr().err
    assert cli.main(["toy", "--quick", "--no-progress", "--run-dir", str(failed)]) == 0
    assert (failed / runs.RUN_MARKER).read_text() == "toy\n"


def test_files_without_a_run_and_a_running_run_are_refused(tmp_path, capsys):
    """A folder with files but no run marker (a vae run's files from before the markers were written
    over by an mnist run), a folder whose run another process is running (both wrote one checkpoint),
    and an empty --run-dir (it ran into a new folder under --out): usage errors that write nothing."""
    unmarked = tmp_path / "old"
    unmarked.mkdir()
    (unmarked / "results.json").write_text("{}")
    running = tmp_path / "running"
    holder = subprocess.Popen([sys.executable, "-c", "import sys, time; from kivi_fast.experiments import runs; "
                               "runs.run_folder('unused', 'toy', sys.argv[1]); print('held', flush=True); "
                               "time.sleep(60)", str(running)], stdout=subprocess.PIPE, text=True, cwd=tmp_path)
    try:
        assert holder.stdout.readline().strip() == "held"
        cases = [(unmarked, f"--run-dir: {unmarked} holds files but no kivi_fast run"),
                 (running, f"--run-dir: {running} is in use: another process is running its toy run"),
                 ("", "--run-dir: expected a folder, got an empty name")]
        for folder, message in cases:
            with pytest.raises(SystemExit) as exit_:
                cli.main(["toy", "--quick", "--no-progress", "--out", str(tmp_path / "out"), "--run-dir", str(folder)])
            assert exit_.value.code == 2 and message in capsys.readouterr().err
    finally:
        holder.kill()
        holder.wait()
    assert sorted(f.name for f in unmarked.iterdir()) == ["results.json"] and not (tmp_path / "out").exists()
    assert sorted(f.name for f in running.iterdir()) == [runs.RUN_MARKER]
    assert cli.main(["toy", "--quick", "--no-progress", "--run-dir", str(running)]) == 0  # its process has ended
    assert not runs._HELD  # and the command has let it go again, for a caller's next one or another process


def test_a_file_system_without_locks_runs_with_a_warning(tmp_path, monkeypatch):
    """flock failing for a reason other than another holder (NFS without its lock daemon: ENOLCK) read as
    "in use", and no run could start on such a file system."""
    import errno
    import fcntl

    def no_locks(*_):
        raise OSError(errno.ENOLCK, "No locks available")

    monkeypatch.setattr(fcntl, "flock", no_locks)
    with pytest.warns(RuntimeWarning, match="cannot lock it here \\(No locks available\\)"):
        assert cli.main(["toy", "--quick", "--no-progress", "--run-dir", str(tmp_path / "run")]) == 0
    assert (tmp_path / "run" / "results.json").exists()


def test_toy_failing_before_any_update_does_not_blame_the_learning_rate(tmp_path, capsys):
    """--s0 1e-300 gives NaN at step 0, before Adam's first update: the message names --s0, not --lr."""
    assert cli.main(["toy", "--quick", "--s0", "1e-300", "--no-progress", "--out", str(tmp_path)]) == 1
    err = capsys.readouterr().err
    assert "kivi-fast toy: error:" in err and "not the learning rate" in err and "--s0" in err
    assert "smaller --lr" not in err and "Traceback" not in err


# per command, options given with --quick and what the run uses: a list the user gives wins over --quick's,
# a number is at most --quick's value (a smaller one given stays)
QUICK_AND_GIVEN = [
    ("kl-accuracy", "--dims 3 --lams 0.5", {"dims": [3], "lams": [0.5], "ns": [50, 100], "reps": 3}),
    ("grad-accuracy", "--dims 4 --ns 60 --cases blr --base-n 200",
     {"dims": [4], "ns": [60], "cases": ["blr"], "rules": ["median", "svgd"], "base_n": 40}),
    ("amortized", "--lams 0.1 --methods kl --steps 50 --samples 10",
     {"lams": [0.1], "methods": ["kl"], "steps": 30, "samples": 10, "seeds": 1}),
    ("toy", "--steps 100", {"steps": 100, "n_samples": 50}),
    # a list typed as it is by default is given too (told apart by the command line, not the value)
    ("kl-accuracy", "--dims 1 2 8 32", {"dims": [1, 2, 8, 32], "lams": [1e-3, 0.1]}),
    ("grad-accuracy", "--rules median median-q svgd silverman", {"rules": ["median", "median-q", "svgd", "silverman"]}),
]


@pytest.mark.parametrize("command,given,expected", QUICK_AND_GIVEN, ids=[c for c, _, _ in QUICK_AND_GIVEN])
def test_quick_keeps_the_lists_the_user_gives(command, given, expected):
    """--quick replaced every list it sets (kl-accuracy --quick --dims 3 --lams 0.5 ran dims [1, 8] and lams
    [0.001, 0.1]): a list the user gives now wins; the others take --quick's values."""
    import importlib

    from kivi_fast.experiments.options import apply_quick

    parser, _ = cli.build_parser()
    argv = [command, "--quick", *given.split()]
    args = parser.parse_args(argv)
    args._given = cli.given_options(command, argv)  # as cli.main sets it
    quick = importlib.import_module(cli.module_name(command)).QUICK
    for _ in range(2):  # applied twice (a command's run and runs.begin both apply it): the same values
        apply_quick(args, quick)
        assert {k: getattr(args, k) for k in expected} == expected


def test_every_option_says_what_it_is_and_its_default():
    _, subparsers = cli.build_parser()
    assert set(subparsers) == set(cli.COMMANDS)
    for name, parser in subparsers.items():
        options = {s for a in parser._actions for s in a.option_strings}
        assert {"--quick", "--no-progress"} <= options, name
        formatter = HelpFormatter(parser.prog)
        for action in parser._actions:
            if "-h" in action.option_strings:
                continue
            assert action.help and len(action.help) > 5, (name, action.dest)
            if action.option_strings and action.nargs != 0:  # an option with a value: its default is shown
                assert "default" in formatter._get_help_string(action), (name, action.dest)
        assert "(default: " in parser.format_help(), name


def test_year_is_not_offered_as_a_choice():
    _, subparsers = cli.build_parser()
    dataset = next(a for a in subparsers["uci"]._actions if a.dest == "dataset")
    assert "year" not in dataset.choices and "not available offline" in dataset.help


def test_plural():
    assert plural(1, "split") == "1 split" and plural(0, "split") == "0 splits" and plural(3, "epoch") == "3 epochs"
