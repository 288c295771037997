"""The smallest lam each backend fits correctly: the KL estimate against a 40-digit evaluation of the
same formula (mpmath), per backend (CPU kernels, device-generic kernels, reference) and dtype.

    .venv/bin/python bench/lam_floor.py --n 60 --shift 0 --exponents 8,10,12,14,16

n prior and n posterior samples in d = 8 (the posterior shifted by --shift); lam = 10^-e for each
exponent. The backends are called below the public API, which refuses lam < 1e-10. Each cell prints
the estimate and its relative error. kivi_fast._validate.MIN_LAM comes from these runs;
python_tests/test_errors.py checks every backend against the same oracle at the floor.
"""

from __future__ import annotations

import argparse

import mpmath
import torch

import kivi_fast
from kivi_fast import reference


def oracle(p: torch.Tensor, q: torch.Tensor, lam: float, sigma: float, clip: float) -> float:
    """-mean_j log max(r(q_j), clip) of the reverse-ratio fit, in mpmath's precision."""
    P, Q = p.tolist(), q.tolist()
    s2 = 2 * mpmath.mpf(sigma) ** 2
    k = lambda a, b: mpmath.exp(-sum((mpmath.mpf(x) - mpmath.mpf(y)) ** 2 for x, y in zip(a, b)) / s2)  # noqa: E731
    k_qq = mpmath.matrix([[k(a, b) for b in Q] for a in Q])
    k_qp = [[k(a, b) for b in P] for a in Q]
    lam_ = mpmath.mpf(lam)
    rhs = mpmath.matrix([sum(row) / (lam_ * len(Q) * len(P)) for row in k_qp])
    alpha = -mpmath.lu_solve(k_qq / len(Q) + lam_ * mpmath.eye(len(Q)), rhs)
    total = 0
    for j in range(len(Q)):
        r = sum(alpha[i] * k_qq[i, j] for i in range(len(Q))) + sum(k_qp[j]) / (lam_ * len(P))
        total += mpmath.log(max(r, mpmath.mpf(clip)))
    return float(-total / len(Q))


def backend_kl(name: str, p: torch.Tensor, q: torch.Tensor, lam: float, sigma: torch.Tensor, clip: float) -> float:
    if name == "reference":
        return float(reference._kl_and_clipped(p[None], q[None], lam, clip, sigma, True)[0][0])
    torch.ops.kivi_fast_testing.set_force_generic(name == "generic")
    try:
        return float(torch.ops.kivi_fast.kl(p[None], q[None], lam, clip, sigma, True, False)[0][0])
    finally:
        torch.ops.kivi_fast_testing.set_force_generic(False)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--n", type=int, default=60)
    ap.add_argument("--shift", type=float, default=0.0)
    ap.add_argument("--exponents", default="8,10,12,14,16")
    ap.add_argument("--dps", type=int, default=40, help="mpmath's decimal digits")
    args = ap.parse_args()
    if kivi_fast.backend() != "cpp":
        raise SystemExit("build the compiled ops first (bash scripts/run.sh setup)")
    mpmath.mp.dps = args.dps
    g = torch.Generator().manual_seed(0)
    p = torch.randn(args.n, 8, generator=g, dtype=torch.float64)
    q = torch.randn(args.n, 8, generator=g, dtype=torch.float64) + args.shift
    sigma = reference.median_bandwidth(torch.cat([q, p]))
    for e in (int(x) for x in args.exponents.split(",")):
        lam = 10.0 ** -e
        truth = oracle(p, q, lam, float(sigma), 1e-8)
        row = [f"lam=1e-{e:02d}", f"oracle={truth:.8g}"]
        for name in ("cpp", "generic", "reference"):
            for dtype in (torch.float64, torch.float32):
                try:
                    v = backend_kl(name, p.to(dtype), q.to(dtype), lam, sigma.reshape(1), 1e-8)
                    row.append(f"{name}-{str(dtype)[6:]}={v:.6g}({abs(v - truth) / abs(truth):.1e})")
                except ValueError:  # the factorization failed: "increase lam"
                    row.append(f"{name}-{str(dtype)[6:]}=not positive definite")
        print(" ".join(row), flush=True)


if __name__ == "__main__":
    main()
