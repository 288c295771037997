"""The estimators' value where the true KL is 0: p and q both N(0, I), n samples each, in d dimensions,
averaged over independent draws (the README's "at q = p" numbers).

    .venv/bin/python scripts/bias_at_q_equals_p.py            # n = 100, d = 8 and 32, 100 draws (~15 s)
    .venv/bin/python scripts/bias_at_q_equals_p.py --n 500 --dims 8 --draws 20

Prints the mean value of each estimator with its standard error: kivi_fast.kl (default contrast, and
per dimension), adaptive_contrast_kl (p known as N(0, I)) and kernel_kl (the paper's estimator, lam 1e-3).
"""

from __future__ import annotations

import argparse
import statistics

import torch

import kivi_fast


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--n", type=int, default=100, help="samples on each side")
    ap.add_argument("--dims", default="8,32", help="comma-separated dimensions")
    ap.add_argument("--draws", type=int, default=100, help="independent draws of p's and q's samples")
    args = ap.parse_args(argv)
    if args.n < 2 or args.draws < 2:
        ap.error("--n and --draws must be at least 2")
    try:
        dims = [int(d) for d in args.dims.split(",")]
    except ValueError:
        ap.error(f"--dims must be comma-separated integers, got {args.dims!r}")
    estimators = {
        "kl": lambda p, q, g: kivi_fast.kl(p, q, generator=g),
        'kl, contrast="diagonal"': lambda p, q, g: kivi_fast.kl(p, q, contrast="diagonal", generator=g),
        "adaptive_contrast_kl": lambda p, q, g: kivi_fast.adaptive_contrast_kl(q, generator=g),
        "kernel_kl (lam 1e-3)": lambda p, q, g: kivi_fast.kernel_kl(p, q),
    }
    print(f"mean value at q = p = N(0, I), n = {args.n} a side, {args.draws} draws (± standard error)")
    for d in dims:
        values = {name: [] for name in estimators}
        for seed in range(args.draws):
            g = torch.Generator().manual_seed(seed)
            p, q = (torch.randn(args.n, d, generator=g, dtype=torch.float64) for _ in range(2))
            for name, estimate in estimators.items():
                values[name].append(estimate(p, q, torch.Generator().manual_seed(1000 + seed)).item())
        cells = [f"{name} {statistics.mean(v):+.3f} ± {statistics.stdev(v) / len(v) ** 0.5:.3f}"
                 for name, v in values.items()]
        print(f"d = {d}: " + "; ".join(cells))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
