"""kivi_fast.kl in a training loop: an implicit posterior fitted to Bayesian linear regression,
whose exact posterior is Gaussian, recovers that posterior's mean and variances."""

import math

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


def test_implicit_posterior_recovers_the_blr_posterior():
    """With adaptive contrast (Appendix D). The plain estimator is biased when the posterior sits far
    from the prior (the kl-accuracy study measures it), so this loop is the AC's job."""
    torch.manual_seed(0)
    x, y, noise, mu, cov = blr_problem()
    d = x.shape[1]
    generator = torch.nn.Sequential(
        torch.nn.Linear(4, 32), torch.nn.Tanh(), torch.nn.Linear(32, d)
    ).double()
    steps, n = 1500, 200
    opt = torch.optim.Adam(generator.parameters(), lr=5e-3)
    # A decaying step size: with a constant one the sampled KL gradients keep q's spread noisy
    # (seen: up to 1.3x the posterior std after 1000 steps, or divergence at lr = 3e-3). The loop is
    # chaotic: results that differ in the last bit (another CPU, another summation order) end on
    # another run, so its settings must pass on most runs, not on one. With 100 samples and lr 1e-2,
    # 2 of seeds 0-5 ended with 2-4x the posterior std (q escapes late in training); with 200 samples
    # and lr 5e-3 all six end within 2% of it (std) and 0.02 std of the mean.
    schedule = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 1 - step / steps)
    for step in range(steps):
        w = generator(torch.randn(n, 4, dtype=torch.float64))
        log_lik = (-0.5 * ((y - w @ x.T) / noise) ** 2 - math.log(noise) - 0.5 * math.log(2 * math.pi)).sum(-1)
        kl = kivi_fast.adaptive_contrast_kl(w, None, lam=1e-3)
        loss = kl - log_lik.mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        schedule.step()
    with torch.no_grad():
        w = generator(torch.randn(20000, 4, dtype=torch.float64))
    std = cov.diagonal().sqrt()
    assert ((w.mean(0) - mu).abs() < 0.25 * std).all(), (w.mean(0), mu)
    assert ((w.std(0) / std - 1).abs() < 0.2).all(), (w.std(0), std)
