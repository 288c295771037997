"""Tests of the VAE (Sec. 5.3): its pieces against torch.distributions, AIS against a model whose
marginal likelihood is exact, exact resume, the 2-process run against one process, the command lines."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import types
from pathlib import Path

import pytest
import torch

import kivi_fast
from kivi_fast import cli
from kivi_fast.experiments import ais, runs
from kivi_fast.experiments import vae as vae_cmd
from kivi_fast.experiments.training import set_lr
from kivi_fast.nn.vae import BernoulliDecoder, ImplicitEncoder, build_vae, slice_draws

from conftest import assert_last_good_checkpoint

REPO = Path(__file__).resolve().parents[1]


def test_decoder_log_likelihood_is_the_bernoulli_log_pmf():
    decoder = BernoulliDecoder(3, (7,), 11).double()
    z = torch.randn(4, 5, 3, dtype=torch.float64)
    x = (torch.rand(4, 1, 11) < 0.5).double()
    expected = torch.distributions.Bernoulli(logits=decoder.logits(z)).log_prob(x.expand(4, 5, 11)).sum(-1)
    torch.testing.assert_close(decoder.log_likelihood(x, z), expected)


def test_gaussian_encoder_density_and_kl_match_torch_distributions():
    torch.manual_seed(0)
    model = build_vae("gaussian", x_dim=12, hidden=(9, 9), z_dim=3).double()
    x = torch.rand(6, 12, dtype=torch.float64)
    mean, log_std = model.encoder.moments(x)
    q = torch.distributions.Normal(mean, log_std.exp())
    z = model.encoder(x, 4)
    torch.testing.assert_close(model.encoder.log_prob(x, z), q.log_prob(z.transpose(0, 1)).sum(-1).T)
    p = torch.distributions.Normal(torch.zeros_like(mean), torch.ones_like(mean))
    draws = {"noise": torch.randn(6, 4, 3, dtype=torch.float64)}
    torch.testing.assert_close(model(x, draws)[1], torch.distributions.kl_divergence(q, p).sum(-1))


def test_implicit_encoder_injects_its_noise_into_the_first_hidden_layer():
    torch.manual_seed(0)
    enc = ImplicitEncoder(10, (6, 5), 2).double()
    x = torch.rand(3, 10, dtype=torch.float64)
    noise = torch.randn(3, 4, 6, dtype=torch.float64)
    h = torch.relu(enc.first(x))[:, None, :] + enc.noise.log_std.exp() * noise
    torch.testing.assert_close(enc(x, 4, noise), enc.rest(h))
    with torch.no_grad():
        enc.noise.log_std.fill_(-60.0)  # no noise: every sample of one x is the same point
    z = enc(x, 4)
    torch.testing.assert_close(z, z[:, :1].expand_as(z))


def test_vae_kl_is_the_library_call_on_the_draws():
    torch.manual_seed(1)
    g = torch.Generator().manual_seed(2)
    for method in ("kivi", "kivi-ac"):
        model = build_vae(method, x_dim=12, hidden=(9, 9), z_dim=3, n_q=20, n_p=30)
        x = torch.rand(4, 12)
        draws = model.draws(4, g, "cpu")
        assert draws["noise"].shape == (4, 20, 9) and draws["prior"].shape == (4, 30, 3)
        z = model.encoder(x, 20, draws["noise"])
        expected = (kivi_fast.kernel_kl(draws["prior"], z, 1e-3) if method == "kivi" else
                    kivi_fast.adaptive_contrast_kl(z, None, 1e-3, contrast="diagonal", reference_z=draws["prior"]))
        torch.testing.assert_close(model(x, draws)[1], expected)
        # a shard's rows of the draws give that shard's rows of the result
        rec, kl = model(x[1:3], slice_draws(draws, 1, 3))
        torch.testing.assert_close(kl, expected[1:3])


def test_reference_z_is_what_the_generator_would_draw():
    q = torch.randn(3, 40, 4, dtype=torch.float64) * 0.7 + 0.2
    with_generator = kivi_fast.adaptive_contrast_kl(q, generator=torch.Generator().manual_seed(5))
    eps = torch.randn(3, 40, 4, dtype=torch.float64, generator=torch.Generator().manual_seed(5))
    torch.testing.assert_close(kivi_fast.adaptive_contrast_kl(q, reference_z=eps), with_generator)
    with pytest.raises(ValueError, match="reference_z"):
        kivi_fast.adaptive_contrast_kl(q, reference_z=eps, generator=torch.Generator())
    with pytest.raises(ValueError, match="reference_z"):
        kivi_fast.adaptive_contrast_kl(q, reference_z=eps[:, :, :3])


def linear_gaussian(seed: int, n: int = 24, d: int = 3, D: int = 10, s: float = 0.8):
    """A decoder with an exact marginal: z ~ N(0, I), x = W z + b + N(0, s^2 I), so p(x) = N(b, W W^T + s^2 I)."""
    g = torch.Generator().manual_seed(seed)
    W, b = torch.randn(D, d, generator=g, dtype=torch.float64), torch.randn(D, generator=g, dtype=torch.float64)
    x = torch.randn(n, d, generator=g, dtype=torch.float64) @ W.T + b + s * torch.randn(n, D, generator=g,
                                                                                    dtype=torch.float64)
    exact = torch.distributions.MultivariateNormal(b, W @ W.T + s * s * torch.eye(D, dtype=torch.float64)).log_prob(x)

    def log_likelihood(z):
        r = (x[:, None, :] - z @ W.T - b) / s
        return -0.5 * r.pow(2).sum(-1) - D * math.log(s) - 0.5 * D * math.log(2 * math.pi)

    return log_likelihood, exact, (W, b, s, x)


def test_ais_recovers_the_exact_marginal_likelihood_of_a_linear_gaussian_model():
    """Five models (each seed draws its own W, b and images), their errors pooled: a seed's mean error over
    its 24 images varies between seeds with a standard deviation of 0.027 (seeds 3-48: 3 of 46 beyond
    0.06 alone), so the mean over five seeds is within 0.05 (4 standard errors); 300 temperatures
    leave -0.04 to -0.13 a seed."""
    errors, acceptances = [], []
    for seed in range(5):
        log_likelihood, exact, _ = linear_gaussian(seed)
        r = ais.ais_log_likelihood(log_likelihood, exact.shape[0], 3, chains=16, steps=1000, leapfrog=5,
                                   generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
        errors.append(r["log_likelihood"] - exact)
        acceptances.append(r["acceptance"])
    means = torch.stack([e.mean() for e in errors])
    assert abs(float(means.mean())) < 0.05, means
    assert float(torch.cat(errors).abs().max()) < 0.8, [float(e.abs().max()) for e in errors]
    assert all(0.5 < a < 0.8 for a in acceptances), acceptances


def test_ais_with_few_temperatures_reads_low_and_iwae_with_the_exact_posterior_is_exact():
    log_likelihood, exact, (W, b, s, x) = linear_gaussian(3)
    short = ais.ais_log_likelihood(log_likelihood, exact.shape[0], 3, chains=4, steps=3, leapfrog=1,
                                   generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    assert float((short["log_likelihood"] - exact).mean()) < -0.5  # the bound is loose with 3 temperatures
    # with q = p(z | x) every importance weight is p(x): the IWAE bound is exact at any k
    cov = torch.linalg.inv(torch.eye(3, dtype=torch.float64) + W.T @ W / s ** 2)
    mean = (x - b) @ W @ cov / s ** 2
    post = torch.distributions.MultivariateNormal(mean, cov)
    g = torch.Generator().manual_seed(1)
    chol = torch.linalg.cholesky(cov)
    def sample(m):
        return mean[:, None, :] + torch.randn(x.shape[0], m, 3, generator=g, dtype=torch.float64) @ chol.T

    iw = ais.iwae_log_likelihood(log_likelihood, sample, lambda z: post.log_prob(z.transpose(0, 1)).T, k=7, chunk=3)
    torch.testing.assert_close(iw, exact)


def vae_args(tmp_path, **kw) -> types.SimpleNamespace:
    parser = cli.build_parser()[1]["vae"]
    argv = ["--train-images", "96", "--batch", "32", "--n-q", "10", "--n-p", "10", "--epochs", "2",
            "--eval-images", "16", "--no-progress", "--run-dir", str(tmp_path)]
    for k, v in kw.items():
        argv += [f"--{k.replace('_', '-')}", str(v)]
    return parser.parse_args(argv)


def final_params(run_dir) -> dict:
    return runs.load_checkpoint(Path(run_dir) / "checkpoint.pt")["model"]


@pytest.mark.parametrize("method", ["kivi-ac", "gaussian"])
def test_an_interrupted_run_resumes_exactly(method, tmp_path, one_thread):
    straight = vae_args(tmp_path / "straight", method=method)
    vae_cmd.train(straight, tmp_path / "straight")
    broken = vae_args(tmp_path / "broken", method=method)
    assert vae_cmd.train(broken, tmp_path / "broken", max_steps=4) is None  # stopped mid-epoch 2
    state = runs.load_checkpoint(tmp_path / "broken" / "checkpoint.pt")
    assert (state["epoch"], state["step"]) == (1, 1)
    result = vae_cmd.train(vae_args(tmp_path / "broken", method=method), tmp_path / "broken")
    a, b = final_params(tmp_path / "straight"), final_params(tmp_path / "broken")
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert result["epochs"] == 2 and (tmp_path / "broken" / "samples.png").exists()
    history = json.loads((tmp_path / "broken" / "history.json").read_text())
    assert [h["epoch"] for h in history] == [1, 2]


def test_minutes_stops_with_a_checkpoint_and_a_rerun_finishes_the_same_run(tmp_path, one_thread, capsys):
    """--minutes (a time-limited job): a tiny limit stops after the first step, saved; rerunning the same
    command (the limit lifted) finishes the run with the uninterrupted run's weights."""
    vae_cmd.train(vae_args(tmp_path / "straight"), tmp_path / "straight")
    stopped = vae_args(tmp_path / "limited", minutes=1e-9)
    assert vae_cmd.run(stopped) == 0
    assert "stopped after --minutes" in capsys.readouterr().out
    state = runs.load_checkpoint(tmp_path / "limited" / "checkpoint.pt")
    assert (state["epoch"], state["step"]) == (0, 1) and not (tmp_path / "limited" / "results.json").exists()
    assert vae_cmd.run(vae_args(tmp_path / "limited")) == 0
    a, b = final_params(tmp_path / "straight"), final_params(tmp_path / "limited")
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_resuming_with_other_settings_is_refused(tmp_path, one_thread):
    vae_cmd.train(vae_args(tmp_path, method="gaussian", epochs=1), tmp_path)
    with pytest.raises(runs.CheckpointError, match="other settings"):
        vae_cmd.train(vae_args(tmp_path, method="gaussian", epochs=1, lr=0.01), tmp_path)
    # a checkpoint from before --cuda-graph and --tf32 existed was made without them: it resumes, it is
    # not refused
    path = tmp_path / "checkpoint.pt"
    state = runs.load_checkpoint(path)
    del state["config"]["cuda_graph"], state["config"]["tf32"]
    torch.save(state, path)
    assert vae_cmd.train(vae_args(tmp_path, method="gaussian", epochs=2), tmp_path)["epochs"] == 2


@pytest.mark.parametrize("method", ["gaussian", "kivi-ac"])
def test_a_diverged_run_ends_in_one_line_and_keeps_the_last_good_checkpoint(method, tmp_path, one_thread):
    """lr 1e3: the ELBO (gaussian) or the implicit posterior's samples (kivi-ac: the estimator refuses
    NaN) blow up. The run ends with a RunError (one line from the CLI), and the checkpoint on disk,
    saved at every step here, holds finite parameters: the broken state never overwrites it."""
    import signal

    handlers = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}
    args = vae_args(tmp_path, method=method, lr=1e3, checkpoint_every=0)
    assert vae_cmd.train(args, tmp_path, max_steps=0) is None  # a good checkpoint first: the start
    with pytest.raises(runs.RunError, match="the ELBO became|the KL estimate failed|parameters became NaN or Inf") as err:
        vae_cmd.train(args, tmp_path)
    assert_last_good_checkpoint(tmp_path, str(err.value))
    # the trainer held Ctrl-C and SIGTERM while it trained; raising, it gave them back
    assert {sig: signal.getsignal(sig) for sig in handlers} == handlers


def test_a_finished_run_is_not_retrained_and_not_continued_past_epochs(tmp_path, one_thread):
    """Rerunning a finished run returns its results (results.json untouched); continuing it to more
    epochs removes them until it finishes; asking for fewer epochs than it trained is refused
    (results.json said 3 epochs and config.json 2)."""
    first = vae_cmd.train(vae_args(tmp_path, method="gaussian", epochs=1), tmp_path)
    written = (tmp_path / "results.json").stat().st_mtime_ns
    assert vae_cmd.train(vae_args(tmp_path, method="gaussian", epochs=1), tmp_path) == first
    assert (tmp_path / "results.json").stat().st_mtime_ns == written
    # continued to more epochs and stopped before them: no longer finished, so no results.json (the
    # reports took the 1-epoch results for the extended run's)
    assert vae_cmd.train(vae_args(tmp_path, method="gaussian", epochs=2), tmp_path, max_steps=1) is None
    assert not (tmp_path / "results.json").exists()
    assert vae_cmd.train(vae_args(tmp_path, method="gaussian", epochs=2), tmp_path)["epochs"] == 2  # continued
    with pytest.raises(runs.RunError, match="has trained 2 epochs, more than --epochs 1"):
        vae_cmd.train(vae_args(tmp_path, method="gaussian", epochs=1), tmp_path)


def test_ctrl_c_saves_at_the_steps_end_and_the_rerun_finishes_the_same_run(tmp_path):
    """SIGINT or SIGTERM mid-run: the trainer saves at the end of the step, says so and exits with 130;
    rerunning finishes the run with the uninterrupted run's weights."""
    import signal
    import time

    common = ["-m", "kivi_fast.cli", "vae", "--train-images", "96", "--batch", "32", "--n-q", "10", "--n-p", "10",
              "--epochs", "20", "--eval-images", "16", "--eval-every", "20", "--no-progress", "--threads", "1",
              "--method", "gaussian", "--checkpoint-every", "0"]  # (a save a step: slow enough to catch mid-run)
    straight = tmp_path / "straight"
    done = subprocess.run([sys.executable, *common, "--run-dir", str(straight)], capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    for sig in (signal.SIGINT, signal.SIGTERM):
        stopped = tmp_path / sig.name
        # (a background job's SIGINT is ignored, and a child inherits that: as for a shell's job, Python
        # then installs no handler and the trainer keeps it ignored; this test wants an interactive one)
        proc = subprocess.Popen([sys.executable, *common, "--run-dir", str(stopped)], stderr=subprocess.PIPE,
                                text=True, preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
        deadline = time.monotonic() + 120
        while not (stopped / "checkpoint.pt").exists() and time.monotonic() < deadline:  # (a step is done)
            time.sleep(0.01)
        proc.send_signal(sig)
        err = proc.communicate(timeout=120)[1]
        assert proc.returncode == 130, err[-2000:]
        assert f"interrupted ({sig.name}); checkpoint saved" in err and "Traceback" not in err, err[-2000:]
        assert not (stopped / "results.json").exists()
        done = subprocess.run([sys.executable, *common, "--run-dir", str(stopped)], capture_output=True, text=True,
                              timeout=600)
        assert done.returncode == 0, done.stderr[-2000:]
        a, b = final_params(straight), final_params(stopped)
        assert all(torch.equal(a[k], b[k]) for k in a)


def test_checkpoints_hold_signals_only_where_they_are_not_ignored_and_give_them_back():
    """A trainer started as a background job (SIGINT ignored) keeps ignoring it; elsewhere it holds
    SIGINT and SIGTERM while open and restores the handlers when closed."""
    import signal

    from kivi_fast.experiments.training import Checkpoints

    solo = types.SimpleNamespace(world=1, share=lambda value: value)
    before = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        checkpoints = Checkpoints(lambda: None, 60.0, solo)
        assert signal.getsignal(signal.SIGINT) is signal.SIG_IGN
        assert signal.getsignal(signal.SIGTERM) is not before[signal.SIGTERM]  # held
        checkpoints.close()
        assert signal.getsignal(signal.SIGTERM) is before[signal.SIGTERM]
        signal.signal(signal.SIGINT, before[signal.SIGINT])
        checkpoints = Checkpoints(lambda: None, 60.0, types.SimpleNamespace(world=2, share=lambda value: value))
        assert {sig: signal.getsignal(sig) for sig in before} == before  # several processes: torchrun's
    finally:
        for sig, handler in before.items():
            signal.signal(sig, handler)


def test_bad_run_folders_and_checkpoints_end_in_one_line(tmp_path, capsys):
    """A --run-dir that is a file, an --out under a file: usage errors; a truncated checkpoint: a
    RunError naming it (torch.load raised OSError)."""
    a_file = tmp_path / "a_file"
    a_file.write_text("x")
    for argv in (["--run-dir", str(a_file)], ["--out", str(a_file / "below")]):
        with pytest.raises(SystemExit) as exit_info:
            cli.main(["vae", "--quick", "--no-progress", *argv])
        assert exit_info.value.code == 2 and "cannot make the folder" in capsys.readouterr().err
    good = tmp_path / "good"
    vae_cmd.train(vae_args(good, method="gaussian", epochs=1), good)
    damaged = tmp_path / "damaged"
    damaged.mkdir()
    (damaged / "checkpoint.pt").write_bytes((good / "checkpoint.pt").read_bytes()[:5000])
    with pytest.raises(runs.CheckpointError, match="checkpoint.pt is not a kivi_fast checkpoint"):
        vae_cmd.train(vae_args(damaged, method="gaussian", epochs=1), damaged)


def test_the_report_refuses_an_ais_of_an_earlier_epoch_and_a_folder_of_another_command(tmp_path, capsys):
    run_dir = tmp_path / "run"
    assert cli.main(["vae", "--quick", "--method", "gaussian", "--no-progress", "--run-dir", str(run_dir)]) == 0
    assert cli.main(["vae-ais", "--quick", "--no-progress", str(run_dir)]) == 0
    ais_file = run_dir / "ais.json"
    ais_file.write_text(json.dumps({**json.loads(ais_file.read_text()), "epoch": 0}))  # the run went on after it
    assert cli.main(["vae-report", str(run_dir), "--results", str(tmp_path / "r")]) == 1
    assert "ais.json is of epoch 0, the run ended at epoch 1: rerun kivi-fast vae-ais" in capsys.readouterr().err
    other = tmp_path / "other"
    other.mkdir()
    (other / "results.json").write_text(json.dumps({"epochs": 1, "test_error": 0.1}))
    (other / "history.json").write_text("[]")
    assert cli.main(["vae-report", str(other), "--results", str(tmp_path / "r2")]) == 1
    assert "is not a kivi-fast vae run's" in capsys.readouterr().err


def test_set_lr_writes_a_tensor_learning_rate_in_place():
    """A step captured in a CUDA graph reads Adam's learning rate from its tensor: the schedule must write
    that tensor, not replace it; a number stays a number."""
    w = torch.nn.Parameter(torch.zeros(3))
    as_tensor = torch.optim.Adam([w], lr=torch.tensor(1e-3))
    lr = as_tensor.param_groups[0]["lr"]
    set_lr(as_tensor, 5e-4)
    assert as_tensor.param_groups[0]["lr"] is lr and lr.item() == pytest.approx(5e-4)
    as_number = torch.optim.Adam([w], lr=1e-3)
    set_lr(as_number, 5e-4)
    assert as_number.param_groups[0]["lr"] == 5e-4


def test_two_processes_follow_one_process(tmp_path):
    common = ["--method", "kivi-ac", "--train-images", "64", "--batch", "16", "--n-q", "10", "--n-p", "10",
              "--epochs", "1", "--eval-images", "8", "--no-progress"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONFAULTHANDLER": "1"}  # (as test_mnist.py's: an abort's stacks)
    one = subprocess.run([sys.executable, "-m", "kivi_fast.cli", "vae", *common, "--run-dir", str(tmp_path / "one")],
                         cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert one.returncode == 0, one.stderr
    two = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                          "-m", "kivi_fast.cli", "vae", *common, "--run-dir", str(tmp_path / "two")],
                         cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert two.returncode == 0, two.stdout[-2000:] + two.stderr[-6000:]
    assert json.loads((tmp_path / "two" / "config.json").read_text())["world_size"] == 2
    a, b = final_params(tmp_path / "one"), final_params(tmp_path / "two")
    config = json.loads((tmp_path / "one" / "config.json").read_text())
    with torch.random.fork_rng():  # the trainer's start: its model built after torch.manual_seed(--seed)
        torch.manual_seed(config["seed"])
        start = build_vae(config["method"], n_q=config["n_q"], n_p=config["n_p"], lam=config["lam"],
                          clip=config["clip"], contrast=config["contrast"]).state_dict()
    moved = 0
    for k in a:
        # Adam moves every weight by about lr = 1e-3 a step, whatever its gradient's size, so a weight whose
        # gradient is ~0 may move differently when the two gradients differ by rounding (summed in another
        # order): allow a few such weights, each within a quarter of one step; a wrong shard or draw would
        # move most weights by a whole step
        diff = (a[k] - b[k]).abs()
        assert float(diff.max()) < 2.5e-4, k
        assert float((diff > 1e-6).double().mean()) < 1e-3, k
        # that start (4 steps of Adam at lr 1e-3 move a weight by at most ~4e-3; another draw's by ~0.7)
        assert float((a[k] - start[k]).abs().max()) < 0.02, k
        moved += int(not torch.equal(a[k], start[k]))
    assert moved > len(a) // 2  # the runs trained


def test_the_command_lines_write_their_files(tmp_path, capsys):
    assert cli.main(["vae", "--quick", "--method", "kivi", "--no-progress", "--run-dir", str(tmp_path)]) == 0
    for name in ("config.json", "history.json", "results.json", "curves.png", "samples.png", "reconstructions.png"):
        assert (tmp_path / name).exists(), name
    result = json.loads((tmp_path / "results.json").read_text())
    assert result["epochs"] == 1 and 0 < result["step_profile"]["kl_share"] < 1
    assert cli.main(["vae-ais", "--quick", "--no-progress", str(tmp_path)]) == 0
    out = json.loads((tmp_path / "ais.json").read_text())
    assert out["settings"]["steps"] == 20 and -800 < out["ais_log_likelihood"] < 0
    assert "AIS test log-likelihood" in capsys.readouterr().out
    # a mistyped second folder is named before any AIS runs (the first's ais.json is not rewritten)
    written = (tmp_path / "ais.json").stat().st_mtime_ns
    assert cli.main(["vae-ais", "--quick", "--no-progress", str(tmp_path), str(tmp_path / "typo")]) == 1
    assert "not a kivi-fast vae run folder" in capsys.readouterr().err
    assert (tmp_path / "ais.json").stat().st_mtime_ns == written
    # a second method, then the report: one figure, summary.json, the paired AIS difference
    other = tmp_path / "gaussian"
    assert cli.main(["vae", "--quick", "--method", "gaussian", "--no-progress", "--run-dir", str(other)]) == 0
    assert cli.main(["vae-ais", "--quick", "--no-progress", str(other)]) == 0
    assert cli.main(["vae-ais", "--quick", "--no-progress", "--split", "train", str(other)]) == 0
    assert json.loads((other / "ais_train.json").read_text())["split"] == "train"
    report = tmp_path / "report"
    assert cli.main(["vae-report", str(tmp_path), str(other), "--results", str(report)]) == 0
    summary = json.loads((report / "summary.json").read_text())
    assert set(summary["methods"]) == {"kivi", "gaussian"} and (report / "curves.png").exists()
    kivi = summary["methods"]["kivi"]
    assert kivi["ais_minus_gaussian"]["images"] == 8 and kivi["ais"]["settings"]["chains"] == 2
    assert "iwae_log_likelihood" in summary["methods"]["gaussian"]["ais"]
    assert "train_minus_test" in summary["methods"]["gaussian"]["ais_gap"]
    assert (report / "gaussian" / "samples.png").exists() and not (report / "gaussian" / "checkpoint.pt").exists()


@pytest.mark.parametrize("argv, message", [
    (["vae", "--train-images", "60000"], "50000"),
    (["vae", "--batch", "0"], "positive integer"),
    (["vae", "--lam", "0"], "lam"),
    (["vae", "--device", "tpu"], "--device"),
    (["vae", "--method", "avb"], "invalid choice"),
    (["vae", "--cuda-graph", "--device", "cpu"], "--cuda-graph needs a GPU"),
    (["vae", "--tf32"], "--tf32 needs a GPU"),
    (["vae", "--eval-images", "20000"], "--eval-images: at most the training images (50000) and the 10000"),
])
def test_bad_values_are_usage_errors(argv, message, tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_info:
        cli.main([*argv, "--run-dir", str(tmp_path)])
    assert exit_info.value.code == 2 and message in capsys.readouterr().err


def test_ais_on_a_folder_that_is_no_run_says_so(tmp_path, capsys):
    assert cli.main(["vae-ais", "--quick", str(tmp_path)]) == 1
    assert "not a kivi-fast vae run folder" in capsys.readouterr().err


def test_report_labels_name_what_differs_from_the_papers_settings():
    from kivi_fast.experiments.vae_report import run_label

    paper = {"method": "kivi-ac", "contrast": "diagonal", "lam": 1e-3, "clip": 1e-8}
    assert run_label(paper) == "kivi-ac"
    assert run_label({**paper, "contrast": "auto", "lam": 1e-2}) == "kivi-ac_auto_lam0.01"
    assert run_label({**paper, "method": "kivi", "contrast": "auto"}) == "kivi"  # kivi has no contrast
    assert run_label({**paper, "method": "gaussian", "lam": 5.0}) == "gaussian"
