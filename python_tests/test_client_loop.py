"""kivi_fast in a user's training loop: implicit posteriors fitted to Bayesian linear regression,
whose exact posterior is Gaussian, recover that posterior's mean and standard deviations.

A training loop is chaotic: results that differ in the last bit (another CPU's BLAS, another torch)
end on another trajectory. So the loop runs for five seeds at once (five generators, one batched
``adaptive_contrast_kl`` call a step: batch elements are independent, so this is five runs) and the
test asserts on the median over the seeds and on four seeds of five: the estimator's sampled
gradients occasionally leave one run with a spread too wide (a std ratio of 1.35 was seen on one seed
of fifteen). With these settings, compiled ops on an AMD EPYC with torch 2.13, seeds 0-14 ended with
|mean error| <= 0.04 posterior std and std ratios in [0.97, 1.08].
"""

import math
import statistics

import torch

import kivi_fast


def blr_problem(seed=0, n=20, d=2, noise=0.5):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, d, generator=g, dtype=torch.float64)
    w_true = torch.randn(d, generator=g, dtype=torch.float64)
    y = x @ w_true + noise * torch.randn(n, generator=g, dtype=torch.float64)
    # prior N(0, I), Gaussian likelihood: posterior N(mu, cov) in closed form.
    cov = torch.linalg.inv(torch.eye(d, dtype=torch.float64) + x.T @ x / noise**2)
    mu = cov @ x.T @ y / noise**2
    return x, y, noise, mu, cov


def train_generators(seeds, steps=600, n=200, lr=1e-2):
    """One MLP generator per seed, trained together on the ELBO with adaptive contrast (Appendix D).
    A linearly decaying step size: with a constant one the sampled KL gradients keep q's spread noisy."""
    x, y, noise, mu, cov = blr_problem()
    d = x.shape[1]
    generators = []
    for seed in seeds:
        torch.manual_seed(seed)
        generators.append(torch.nn.Sequential(torch.nn.Linear(4, 32), torch.nn.Tanh(), torch.nn.Linear(32, d)).double())
    opt = torch.optim.Adam([p for g in generators for p in g.parameters()], lr=lr)
    schedule = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 1 - step / steps)
    rng = torch.Generator().manual_seed(1000 + seeds[0])
    for _ in range(steps):
        w = torch.stack([g(torch.randn(n, 4, dtype=torch.float64, generator=rng)) for g in generators])  # [S, n, d]
        log_lik = (-0.5 * ((y - w @ x.T) / noise) ** 2 - math.log(noise) - 0.5 * math.log(2 * math.pi)).sum(-1)
        kl = kivi_fast.adaptive_contrast_kl(w, None, lam=1e-3, generator=rng)  # [S]
        loss = (kl - log_lik.mean(-1)).sum()
        opt.zero_grad()
        loss.backward()
        opt.step()
        schedule.step()
    std = cov.diagonal().sqrt()
    mean_errors, std_ratios = [], []
    with torch.no_grad():
        for g in generators:
            w = g(torch.randn(20000, 4, dtype=torch.float64, generator=rng))
            mean_errors.append(((w.mean(0) - mu).abs() / std).max().item())
            std_ratios.append((w.std(0) / std).tolist())
    return mean_errors, std_ratios


def test_implicit_posteriors_recover_the_blr_posterior():
    mean_errors, std_ratios = train_generators(seeds=[0, 1, 2, 3, 4])
    worst_ratio_gap = [max(abs(r - 1) for r in ratios) for ratios in std_ratios]
    assert statistics.median(mean_errors) < 0.1, mean_errors
    assert statistics.median(worst_ratio_gap) < 0.1, std_ratios
    good = [e < 0.25 and gap < 0.25 for e, gap in zip(mean_errors, worst_ratio_gap)]
    assert sum(good) >= 4, (mean_errors, std_ratios)
