"""The ``kivi-fast toy`` experiment: a --quick smoke run, and the target density against scipy."""

import argparse
import json
import math

import numpy as np
import pytest
import torch

from kivi_fast.experiments import toy

scipy_stats = pytest.importorskip("scipy.stats")
scipy_integrate = pytest.importorskip("scipy.integrate")


def _args(argv):
    parser = argparse.ArgumentParser()
    toy.add_arguments(parser)
    return parser.parse_args(argv)


def test_target_log_prob_matches_scipy_mixture():
    z = np.linspace(-12.0, 12.0, 2001)
    expected = np.log(0.5 * scipy_stats.norm.pdf(z, loc=-3.0, scale=1.0)
                      + 0.5 * scipy_stats.norm.pdf(z, loc=3.0, scale=1.0))
    got = toy.target_log_prob(torch.from_numpy(z)).numpy()
    np.testing.assert_allclose(got, expected, rtol=1e-12, atol=1e-12)
    # far in the tails, where the pdfs underflow, it stays finite and follows the nearer component
    far = toy.target_log_prob(torch.tensor([-60.0, 60.0], dtype=torch.float64))
    np.testing.assert_allclose(far.numpy(), math.log(0.5) + scipy_stats.norm.logpdf([-60.0, 60.0], loc=[-3.0, 3.0]),
                               rtol=1e-12)
    # float32 in, float32 out; shape preserved
    z32 = torch.randn(3, 5)
    assert toy.target_log_prob(z32).shape == (3, 5)
    assert toy.target_log_prob(z32).dtype == torch.float32


def test_target_cdf_matches_scipy_mixture():
    z = np.linspace(-8.0, 8.0, 161)
    expected = 0.5 * scipy_stats.norm.cdf(z, -3.0, 1.0) + 0.5 * scipy_stats.norm.cdf(z, 3.0, 1.0)
    np.testing.assert_allclose(toy.target_cdf(torch.from_numpy(z)).numpy(), expected, atol=1e-12)


def test_histogram_entropy_of_a_gaussian():
    rng = np.random.default_rng(0)
    z = rng.normal(1.0, 2.0, size=400_000)
    exact = 0.5 * math.log(2 * math.pi * math.e * 4.0)
    assert abs(toy.histogram_entropy(z, 0.02) - exact) < 0.01


def test_quick_run_writes_the_documented_files(tmp_path, capsys):
    run_dir = tmp_path / "toy"
    args = _args(["--quick", "--no-progress", "--out", str(tmp_path), "--run-dir", str(run_dir), "--seed", "3"])
    threads = torch.get_num_threads()
    assert toy.run(args) == 0
    assert torch.get_num_threads() == threads  # restored

    for name in ("results.json", "densities.png", "training.png"):
        assert (run_dir / name).is_file() and (run_dir / name).stat().st_size > 0, name
    assert (run_dir / "densities.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"

    results = json.loads((run_dir / "results.json").read_text())
    for key in toy.RESULT_KEYS:
        assert key in results, key
    assert results["experiment"] == "toy_mixture"
    assert results["settings"]["quick"] is True and results["settings"]["seed"] == 3
    assert results["settings"]["lam"] == 0.003 and results["settings"]["clip"] == 1e-8
    assert set(results["methods"]) == {"kivi", "gaussian_vi"}
    for name, method in results["methods"].items():
        for key in toy.METHOD_KEYS:
            assert key in method, (name, key)
        assert math.isfinite(method["kl"]) and method["kl"] > -0.05  # a KL (up to estimation error)
        assert 0.0 <= method["mass_left"] <= 1.0 and 0.0 <= method["mass_right"] <= 1.0
    # The Gaussian's KL (Monte Carlo, exact entropy) and its histogram estimate (KIVI's) against
    # quadrature of q log(q / p) for the fitted mean and std; its mass right of 0 against scipy's.
    gauss = results["methods"]["gaussian_vi"]
    mean, std = gauss["mean"], gauss["std"]
    assert std > 0

    def integrand(z):
        log_q = scipy_stats.norm.logpdf(z, mean, std)
        return math.exp(log_q) * (log_q - float(toy.target_log_prob(torch.tensor(z, dtype=torch.float64))))

    exact, _ = scipy_integrate.quad(integrand, mean - 12 * std, mean + 12 * std, points=[-3.0, 0.0, 3.0], limit=200)
    assert abs(gauss["kl"] - exact) < 5 * gauss["kl_stderr"] + 1e-6, (gauss["kl"], exact, gauss["kl_stderr"])
    assert abs(gauss["kl_histogram"] - exact) < 0.05, (gauss["kl_histogram"], exact)
    assert gauss["mass_right"] == pytest.approx(scipy_stats.norm.sf(0.0, mean, std), abs=1e-9)

    out = capsys.readouterr().out
    assert "KIVI" in out and "Gaussian VI" in out and str(run_dir) in out


def test_cli_parses_the_toy_subcommand():
    args = _args([])
    assert args.steps == 3000 and args.n_samples == 100 and args.lam == 0.003 and args.clip == 1e-8
    assert args.contrast == "reference" and args.out == "runs" and args.run_dir is None
    assert _args(["--bandwidth", "median"]).bandwidth == "median"
    assert _args(["--bandwidth", "0.7"]).bandwidth == 0.7
    with pytest.raises(SystemExit):
        _args(["--bandwidth", "-1"])


def test_progress_bar_says_what_it_shows(tmp_path, capsys):
    """The bar shows the training objective, a biased estimate for KIVI, not the evaluated KL."""
    args = _args(["--steps", "21", "--eval-samples", "1000", "--bin-width", "0.1", "--run-dir", str(tmp_path / "toy")])
    assert toy.run(args) == 0
    captured = capsys.readouterr()
    assert "KL (training estimate)=" in captured.err and "ELBO=" not in captured.err
    assert "KL from 1000 samples of each q" in captured.out
