"""What float32 GEMMs cost in accuracy: the reason ours keeps float64 GEMMs for float32 inputs.

    .venv/bin/python bench/precision.py [--json bench/precision.json]

The pure-PyTorch side of bench/run.py computes the squared distances (and, through autograd, the
gradient's products) with GEMMs in the input dtype; ours converts float32 inputs to float64 first. This
script measures, for float32 inputs, how far each lands from the float64 computation on the *same*
(float32-rounded) inputs by the pure-PyTorch test oracle ``kivi_fast.reference.kl`` (coordinate
differences, no GEMM), for the value and the gradient w.r.t. q_z (max-norm relative error):

- ``pure f32 GEMM``: bench/pure_torch.py as benchmarked;
- ``pure f32 GEMM, centred``: the same after subtracting the pooled mean in float64 (the usual cure for
  the cancellation in ||x||^2 + ||y||^2 - 2 x.y);
- ``ours``: kivi_fast.kl;
- ``ours, f32 backward product``: ours in float64 except the backward's product of the weights with the
  points (W @ [q; p], what a float32 GEMM would do for the backward of the wide shapes), emulated.

The problems are posteriors q = shift + spread * N(0, I) against a prior N(0, I), the situation of a
trained BNN layer (weights moved away from the prior's mean, with a smaller spread), at lam = 1e-3.
The library's contract (README, python_tests/test_precision_and_autograd.py) is 1e-3 relative.
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import pure_torch  # noqa: E402

import kivi_fast  # noqa: E402
from kivi_fast import reference  # noqa: E402

# the oracle materializes [N, N, d] differences: (100, 2000) stands in for the wide layers
SHAPES = [(100, 8), (100, 32), (100, 51), (300, 64), (100, 700), (100, 2000), (10, 20000)]
SHIFTS = [0.0, 3.0, 20.0]
SPREADS = [1.0, 0.2, 0.05]
SEEDS = [0, 1, 2]
CONTRACT = 1e-3


def _centred_pure(p, q, lam):
    centre = torch.cat([p.detach(), q.detach()]).double().mean(0)
    return pure_torch.kl((p.double() - centre).float(), (q.double() - centre).float(), lam, gemm_in_input_dtype=True)


def _value_and_grad(fn, p, q, lam):
    q = q.clone().requires_grad_(True)
    value = fn(p, q, lam)
    (grad,) = torch.autograd.grad(value, q)
    return value.detach().double(), grad.double()


def _f32_weight_product(p, q, lam, clip=1e-8):
    """Ours in float64 but the backward's product W @ [q; p] in float32 (a speed-up not taken): the
    fit with the reverse ratio trick (p / q) and the gradient of KL = -mean_j log r(q_j),
    -(1/n) sum_c W_jc (c - q_j) with W_jc = coef_c k(c, q_j) / (sigma^2 r_j)."""
    p64, q64 = p.double(), q.double()
    fit = reference.DensityRatio(lam).fit(p64, q64)
    centres = torch.cat([q64, p64])
    coef = torch.cat([fit.alpha, torch.full((p.shape[0],), fit.beta, dtype=torch.float64)])
    k = torch.exp(-reference._sqdist(q64, centres) / (2 * fit.sigma**2))
    r = k @ coef
    w = torch.where((r > clip)[:, None], coef * k / (fit.sigma**2 * r[:, None]), 0.0)
    grad = -((w.float() @ centres.float()).double() - w.sum(1, keepdim=True) * q64) / q.shape[0]
    return -torch.log(r.clamp_min(clip)).mean(), grad


# name -> (p, q, lam) -> (value, gradient w.r.t. q), float64
VARIANTS = {
    "pure f32 GEMM": lambda p, q, lam: _value_and_grad(
        lambda a, b, c: pure_torch.kl(a, b, c, gemm_in_input_dtype=True), p, q, lam),
    "pure f32 GEMM, centred": lambda p, q, lam: _value_and_grad(_centred_pure, p, q, lam),
    "ours": lambda p, q, lam: _value_and_grad(kivi_fast.kl, p, q, lam),
    "ours, f32 backward product": _f32_weight_product,
}


def _rel(a, b):
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-300))


def measure(lam: float = 1e-3) -> list[dict]:
    rows = []
    for (n, d), shift, spread, seed in itertools.product(SHAPES, SHIFTS, SPREADS, SEEDS):
        g = torch.Generator().manual_seed(seed)
        p = torch.randn(n, d, generator=g, dtype=torch.float64).float()
        q = (shift + spread * torch.randn(n, d, generator=g, dtype=torch.float64)).float()
        v64, g64 = _value_and_grad(reference.kl, p.double(), q.double(), lam)
        row = {"n": n, "d": d, "shift": shift, "spread": spread, "seed": seed}
        for name, fn in VARIANTS.items():
            v32, g32 = fn(p, q, lam)
            row[name] = {"value": _rel(v32, v64), "grad": _rel(g32, g64)}
        rows.append(row)
    return rows


def table(rows: list[dict]) -> str:
    lines = ["| shape (n, d) | cases | " + " | ".join(f"{v}: max value err / max grad err / grad > 1e-3"
                                                    for v in VARIANTS) + " |",
             "|---|---:|" + "---:|" * len(VARIANTS)]
    for shape in SHAPES + [None]:
        sel = [r for r in rows if shape == (r["n"], r["d"])] if shape is not None else rows
        cells = []
        for v in VARIANTS:
            mv = max(r[v]["value"] for r in sel)
            mg = max(r[v]["grad"] for r in sel)
            bad = sum(r[v]["grad"] > CONTRACT for r in sel)
            cells.append(f"{mv:.1e} / {mg:.1e} / {bad}")
        label = f"{shape}" if shape is not None else "**all**"
        lines.append(f"| {label} | {len(sel)} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json", default=None, help="write every case's errors here")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    print(f"kivi_fast backend: {kivi_fast.backend()}; lam 1e-3; {len(SHAPES) * len(SHIFTS) * len(SPREADS) * len(SEEDS)} "
          f"problems (shifts {SHIFTS}, spreads {SPREADS}, seeds {SEEDS})", file=sys.stderr)
    rows = measure()
    print(table(rows))
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
