"""Tests of the MNIST BNN (Sec. 5.2.2): the MMNN shapes of App. F, the prior-contrastive discriminator
against the exact log-ratio of two Gaussians, exact resume, the 2-process run, the command line, the
report."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from kivi_fast import cli
from kivi_fast.experiments import mnist as mnist_cmd
from kivi_fast.experiments import mnist_report
from kivi_fast.experiments import runs
from kivi_fast.nn.classification import (ClassificationBNN, LogisticDiscriminator, MatrixPosterior, mmnn_shapes,
                                         n_weights)
from kivi_fast.nn.mmnn import MatrixMultiplicationLayer

from conftest import assert_last_good_checkpoint

REPO = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("width, hidden, dims", [
    (400, 500, [314000, 160400, 4010]),    # the KL shapes the paper's L = 400 gives: (10, d) per layer
    (800, 800, [628000, 640800, 8010]),
    (1200, 800, [942000, 1441200, 12010]),
])
def test_the_mmnns_of_appendix_f(width, hidden, dims):
    shapes = [mmnn_shapes(b, a, hidden, i == 2) for i, (a, b) in enumerate([(785, width), (width + 1, width),
                                                                              (width + 1, 10)])]
    assert shapes[0] == [(30, 30), (hidden, hidden), (hidden, hidden), (width, 785)]
    assert shapes[2] == [(30, 30), (30, hidden), (30, hidden), (10, width + 1)]
    assert [s[-1][0] * s[-1][1] for s in shapes] == dims
    assert sum(dims) == n_weights((784, width, width, 10))
    # parameters: Sec. 4's count per matrix layer, far below the weights they generate for L >= 800
    params = sum(MatrixMultiplicationLayer.n_parameters(a, b) for s in shapes for a, b in zip(s[:-1], s[1:]))
    assert params == sum(m * m0 + m * n0 + n0 * n + m * n for s in shapes for (m0, n0), (m, n) in zip(s[:-1], s[1:]))


def test_matrix_posterior_gives_the_networks_matrices_at_the_priors_scale():
    torch.manual_seed(0)
    q = MatrixPosterior(mmnn_shapes(7, 13, 20, False))
    w = q.sample(5)
    assert w.shape == (5, 91)
    m = q.mmnn.sample_matrices(5)  # the same layout, transposed: [5, 7, 13] -> [5, 13, 7]
    assert m.shape == (5, 7, 13)
    assert 0.5 < float(w.detach().std()) < 2.0


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_an_adam_step_moves_unit_scale_mmnn_matrices_several_times_less(seed):
    """Why MatrixMultiplicationLayer stores A_l, A_r at unit scale (1/sqrt(fan-in) in the forward): on App.
    F's N = 800 MMNN one Adam step (lr 1e-3) of a coherent push changes the samples several times less than
    the same function stored at 1/sqrt(fan-in) scale (with that, L = 1200 training diverged in 7 steps)."""
    changes = []
    for stored_scaled in (False, True):
        torch.manual_seed(seed)
        q = MatrixPosterior(mmnn_shapes(40, 51, 800, False))
        if stored_scaled:
            with torch.no_grad():
                for layer in q.mmnn.layers:
                    layer.left.mul_(layer.left_scale)
                    layer.right.mul_(layer.right_scale)
                    layer.left_scale = layer.right_scale = 1.0
        noise = torch.randn(4, 30, 30)
        before = q.mmnn(noise).detach()
        opt = torch.optim.Adam(q.parameters(), lr=1e-3)
        q.mmnn(noise).square().mean().backward()
        opt.step()
        changes.append(float((q.mmnn(noise).detach() - before).norm() / before.norm()))
    assert changes[1] > 4 * changes[0]


def test_a_trained_logistic_discriminator_recovers_the_log_ratio_of_two_gaussians():
    # q = N(mu, I), p = N(0, I): log q/p (w) = mu . w - |mu|^2 / 2 is linear, so logistic regression can
    # represent it exactly; trained on many samples it should be close
    g = torch.Generator().manual_seed(0)
    mu = torch.tensor([0.8, -0.5, 0.3])
    t = LogisticDiscriminator(3)
    opt = torch.optim.Adam(t.parameters(), lr=0.05)
    for _ in range(400):
        q = mu + torch.randn(2000, 3, generator=g)
        loss = t.loss(q, torch.randn(2000, 3, generator=g))
        opt.zero_grad()
        loss.backward()
        opt.step()
    torch.testing.assert_close(t.weight.detach(), mu, atol=0.08, rtol=0)
    assert abs(float(t.bias.detach()) + 0.5 * float(mu.pow(2).sum())) < 0.08


def test_the_elbo_moves_only_the_posteriors_and_the_discriminator_loss_only_the_discriminators():
    torch.manual_seed(0)
    model = ClassificationBNN((20, 8, 8, 3), "pc", mmnn_hidden=6)
    x, y = torch.rand(5, 20), torch.randint(0, 3, (5,))
    out = model.elbo(x, y, 100, 4)
    out["elbo"].backward(retain_graph=True)
    assert all(p.grad is None for p in model.discriminators.parameters())
    model.zero_grad(set_to_none=True)
    model.discriminator_loss(out["samples"]).backward()
    assert all(p.grad is None for p in model.posteriors.parameters())
    assert all(p.grad is not None for p in model.discriminators.parameters())


def mnist_args(run_dir, **kw):
    parser = cli.build_parser()[1]["mnist"]
    argv = ["--hidden", "16", "--mmnn-hidden", "12", "--train-images", "60", "--batch", "20", "--epochs", "2",
            "--samples", "4", "--n-p", "4", "--eval-images", "50", "--no-progress", "--run-dir", str(run_dir)]
    for k, v in kw.items():
        argv += [f"--{k.replace('_', '-')}", str(v)]
    return parser.parse_args(argv)


@pytest.mark.parametrize("method", ["kivi", "bbb", "pc"])
def test_an_interrupted_run_resumes_exactly(method, tmp_path, one_thread):
    mnist_cmd.train(mnist_args(tmp_path / "a", method=method), tmp_path / "a")
    assert mnist_cmd.train(mnist_args(tmp_path / "b", method=method), tmp_path / "b", max_steps=4) is None
    result = mnist_cmd.train(mnist_args(tmp_path / "b", method=method), tmp_path / "b")
    a = runs.load_checkpoint(tmp_path / "a" / "checkpoint.pt")["model"]
    b = runs.load_checkpoint(tmp_path / "b" / "checkpoint.pt")["model"]
    assert all(torch.equal(a[k], b[k]) for k in a)
    ha = json.loads((tmp_path / "a" / "history.json").read_text())
    hb = json.loads((tmp_path / "b" / "history.json").read_text())
    assert [h["lower_bound"] for h in ha] == [h["lower_bound"] for h in hb]
    assert result["epochs"] == 2 and 0 <= result["test_error"] <= 1


def test_how_often_it_evaluates_does_not_move_the_training(tmp_path, one_thread):
    """The evaluation's weight draws come from their own stream: --eval-every 1 and 2 train the same
    parameters (they drew from the training's generator: the lower bounds differed in the 6th digit)."""
    for every in (1, 2):
        mnist_cmd.train(mnist_args(tmp_path / str(every), method="bbb", eval_every=every), tmp_path / str(every))
    a = runs.load_checkpoint(tmp_path / "1" / "checkpoint.pt")["model"]
    b = runs.load_checkpoint(tmp_path / "2" / "checkpoint.pt")["model"]
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_a_diverged_run_keeps_the_last_good_checkpoint(tmp_path, one_thread):
    args = mnist_args(tmp_path, method="bbb", lr=1e6, checkpoint_every=0)
    assert mnist_cmd.train(args, tmp_path, max_steps=0) is None  # a good checkpoint first: the start
    with pytest.raises(runs.RunError, match="lower bound became|KL estimate failed|parameters became NaN or Inf") as err:
        mnist_cmd.train(args, tmp_path)
    assert_last_good_checkpoint(tmp_path, str(err.value))


def test_two_processes_keep_equal_parameters(tmp_path):
    common = ["--hidden", "16", "--mmnn-hidden", "12", "--train-images", "80", "--batch", "20", "--epochs", "1",
              "--samples", "4", "--n-p", "4", "--eval-images", "50", "--no-progress"]
    # (faulthandler: a rank that aborts prints where its Python threads were; once, in a fresh clone's
    # .ci/run, a rank ended in "terminate called without an active exception", not seen again in 24
    # runs under load)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONFAULTHANDLER": "1"}
    two = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                          "-m", "kivi_fast.cli", "mnist", *common, "--run-dir", str(tmp_path)],
                         cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert two.returncode == 0, two.stdout[-2000:] + two.stderr[-6000:]
    result = json.loads((tmp_path / "results.json").read_text())
    assert result["processes"] == 2 and result["parameter_sum_spread_across_processes"] < 1e-6
    config = argparse.Namespace(**json.loads((tmp_path / "config.json").read_text()))
    with torch.random.fork_rng():  # the trainer's start: its model built after torch.manual_seed(--seed)
        torch.manual_seed(config.seed)
        start = mnist_cmd.build(config).state_dict()
    final = runs.load_checkpoint(tmp_path / "checkpoint.pt")["model"]
    # that start (4 steps of Adam at lr 1e-3 move a weight by at most ~4e-3; another draw's by ~100)
    assert all(float((final[k] - start[k]).abs().max()) < 0.02 for k in final)
    assert sum(not torch.equal(final[k], start[k]) for k in final) > len(final) // 2  # trained


def test_minutes_stops_with_a_checkpoint(tmp_path, one_thread, capsys):
    assert mnist_cmd.run(mnist_args(tmp_path, minutes=1e-9)) == 0
    assert "stopped after --minutes" in capsys.readouterr().out
    state = runs.load_checkpoint(tmp_path / "checkpoint.pt")
    assert (state["epoch"], state["step"]) == (0, 1) and not (tmp_path / "results.json").exists()
    assert mnist_cmd.run(mnist_args(tmp_path)) == 0 and (tmp_path / "results.json").exists()


def test_the_committed_runs_load_in_the_report():
    """results/mnist/'s runs were made by earlier versions: settings added since (--cuda-graph) must not
    make the report refuse them."""
    folders = [f for f in (Path(__file__).resolve().parents[1] / "results" / "mnist").iterdir()
               if (f / "results.json").exists()]
    assert folders
    for folder in folders:
        assert mnist_report.load_run(folder)["results.json"]["config"]["method"] in ("kivi", "bbb", "pc")


def test_the_command_line_writes_its_files_and_refuses_bad_values(tmp_path, capsys):
    assert cli.main(["mnist", "--quick", "--method", "bbb", "--no-progress", "--run-dir", str(tmp_path)]) == 0
    for name in ("config.json", "history.json", "results.json", "curves.png"):
        assert (tmp_path / name).exists(), name
    assert "test error" in capsys.readouterr().out
    for argv, message in ((["--train-images", "60000"], "50000"), (["--eval-images", "20000"], "10000"),
                          (["--method", "sgd"], "invalid choice"), (["--hidden", "0"], "positive integer"),
                          (["--cuda-graph"], "--cuda-graph needs a GPU"), (["--tf32"], "--tf32 needs a GPU"),
                          (["--bbb-init-std", "0.1"], "only --method bbb"), (["--bbb-init-std", "0"], "positive")):
        with pytest.raises(SystemExit) as exit_info:
            cli.main(["mnist", *argv, "--run-dir", str(tmp_path / "x")])
        assert exit_info.value.code == 2 and message in capsys.readouterr().err


def test_bbb_init_std_sets_the_start_names_the_run_and_must_match_to_resume(tmp_path, capsys, one_thread):
    argv = ["mnist", "--quick", "--method", "bbb", "--no-progress", "--bbb-init-std", "0.05"]
    args = argparse.Namespace(**{**vars(mnist_cmd_args(argv[1:])), "hidden": 50, "mmnn_hidden": 40})
    stds = torch.cat([q.std.detach() for q in mnist_cmd.build(args).posteriors])
    assert torch.allclose(stds, torch.full_like(stds, 0.05))
    assert cli.main([*argv, "--run-dir", str(tmp_path / "run")]) == 0
    config = json.loads((tmp_path / "run" / "results.json").read_text())["config"]
    assert config["bbb_init_std"] == 0.05
    assert mnist_report.run_label(config) == "bbb-50_bbbinitstd0.05"
    # the default is not named, and an older run without the setting had the default
    assert mnist_report.run_label({**config, "bbb_init_std": 1e-3}) == "bbb-50"
    assert mnist_report.run_label({k: v for k, v in config.items() if k != "bbb_init_std"}) == "bbb-50"
    # a KIVI run does not use it: not named
    assert mnist_report.run_label({**config, "method": "kivi"}) == "kivi-50_N40"
    capsys.readouterr()
    assert cli.main([*argv[:-1], "0.1", "--epochs", "2", "--run-dir", str(tmp_path / "run")]) != 0
    assert "bbb_init_std" in capsys.readouterr().err


def mnist_cmd_args(argv):
    p = argparse.ArgumentParser()
    mnist_cmd.add_arguments(p)
    return p.parse_args(argv)


def test_the_report_collects_runs_beside_the_paper_and_compares_with_bbb_at_equal_budget(tmp_path, capsys,
                                                                                      one_thread):
    for name, extra in (("kivi", []), ("bbb", ["--method", "bbb"]),
                        ("bbb-fast", ["--method", "bbb", "--lr", "0.03"])):
        assert cli.main(["mnist", "--quick", *extra, "--no-progress", "--run-dir", str(tmp_path / name)]) == 0
    out = tmp_path / "results"
    assert cli.main(["mnist-report", *(str(tmp_path / m) for m in ("kivi", "bbb", "bbb-fast")),
                     "--results", str(out)]) == 0
    summary = json.loads((out / "summary.json").read_text())
    kivi, bbb, fast = (json.loads((tmp_path / m / "results.json").read_text()) for m in ("kivi", "bbb", "bbb-fast"))
    # quick runs use N = 40, not App. F's: the label says so, and the paper's number is not put beside it
    assert set(summary["runs"]) == {"kivi-50_N40", "bbb-50", "bbb-50_lr0.03"}
    # the baseline of the comparison: the BBB run of the lowest validation error
    _, base_label, base = min((bbb["valid_error"], "bbb-50", bbb), (fast["valid_error"], "bbb-50_lr0.03", fast))
    s = summary["runs"]["kivi-50_N40"]
    assert s["test_error"] == kivi["test_error"] and s["steps"] == 5 and s["epochs"] == 1
    assert s["test_error_se"] == pytest.approx((kivi["test_error"] * (1 - kivi["test_error"]) / 200) ** 0.5)
    assert s["kl_share_of_step"] == kivi["step_profile"]["kl_share"] and 0 < s["kl_share_of_step"] < 1
    diff = summary["test_error_minus_bbb"]["kivi-50_N40"]
    assert diff["bbb_run"] == base_label and diff["minus_bbb"] == pytest.approx(kivi["test_error"] - base["test_error"])
    assert summary["paper_test_error_percent"]["kivi"]["800"] == 1.22
    table = (out / "table.md").read_text()
    assert table.count("\n") == 5 and "| 50 | kivi-50_N40 | 5 (1 x 500) |" in table
    for name in ("curves.png", "kivi-50_N40/history.json", "bbb-50/results.json"):
        assert (out / name).exists(), name
    assert not (out / "kivi-50_N40" / "checkpoint.pt").exists()
    # rerun over its own copies (as one adds runs to a committed report): the same summary
    assert cli.main(["mnist-report", *(str(out / label) for label in summary["runs"]), "--results", str(out)]) == 0
    assert json.loads((out / "summary.json").read_text()) == summary
    capsys.readouterr()
    with pytest.raises(SystemExit) as exit_info:  # one run per label
        cli.main(["mnist-report", str(tmp_path / "bbb"), str(tmp_path / "bbb"), "--results", str(out)])
    assert exit_info.value.code == 2 and "two runs of 'bbb-50'" in capsys.readouterr().err
    assert cli.main(["mnist-report", str(tmp_path), "--results", str(out)]) == 1
    assert "not a finished kivi-fast mnist run" in capsys.readouterr().err
