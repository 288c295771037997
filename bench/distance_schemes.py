"""What cheaper squared distances would cost the accuracy contract, measured before a GPU kernel takes them.

    .venv/bin/python bench/distance_schemes.py [--json bench/distance_schemes.json]

The tiled distances of csrc/cuda/kl.cu (``tile_sqdist``) take float64 differences of the samples: a
subtraction and a multiply-add a pair and dimension on the GPU's float64 units. Each scheme below is
evaluated by the test oracle (``kivi_fast.reference.kernel_kl`` in float64) with its squared distances
replaced by the scheme's:

- ``float64 differences``: the GPU's scheme, summed dimension by dimension (the control);
- ``float32 slabs``: the difference and its square in float32, summed by float32 multiply-adds over
  each slab of 32 dimensions (tile_sqdist's slab), the slabs' sums added in float64: the float32
  units, at twice the float64 rate on an H100 or H200;
- ``float64 GEMM``: |x|^2 + |y|^2 - 2 x.y in float64, clamped at 0: a multiply-add a pair and
  dimension, the form of a GEMM (cuBLAS, the float64 tensor cores);
- ``GEMM from x_0``: the same of the points relative to the first stacked one (x - x_0, x_0 the
  first of q_z's samples, the denominator's, stacked first): the CPU kernels' Gram paths' centring;
- ``GEMM from a middle point``: relative to the middle of three stacked points' coordinates (the
  first, the middle one and the last), the reference of ``set_product_tile_distances``'s kernels.

Three sets of float32 problems, lam = 1e-3: bench/precision.py's 189 draws (a prior N(0, I) against
posteriors shifted by 0 / 3 / 20 with spreads 1 / 0.2 / 0.05); ``offset``: both samples moved 1e3
or 1e4 from the origin (posteriors shifted by 0 / 3, spreads 1 / 0.2; (100, 64) and (100, 700); 16
problems); ``outlier``: x_0 alone moved 1e4 or 1e5 from the others (the same 16 draws otherwise). The gradient w.r.t. q_z keeps its exact formula; the kernel values it weighs come from the
scheme's distances, as in the GPU's backward. A problem misses where the value's or the gradient's
relative error (bench/precision.py's) exceeds 1e-3. Ten minutes on one core.
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import precision  # noqa: E402

from kivi_fast import reference  # noqa: E402

SLAB = 32  # csrc/cuda/kl.cu's kTileDims
EXACT = reference._sqdist
OFFSETS = [1e3, 1e4]
OUTLIERS = [1e4, 1e5]
OFFSET_SHAPES = [(100, 64), (100, 700)]


def float64_differences(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    out = torch.zeros(x.shape[:-1] + (y.shape[-2],), dtype=torch.float64)
    for k in range(x.shape[-1]):
        diff = x[..., :, None, k] - y[..., None, :, k]
        out = out + diff * diff
    return out


def float32_slabs(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    xf, yf = x.float(), y.float()
    out = torch.zeros(x.shape[:-1] + (y.shape[-2],), dtype=torch.float64)
    for s0 in range(0, x.shape[-1], SLAB):
        acc = torch.zeros(out.shape, dtype=torch.float32)
        for k in range(s0, min(x.shape[-1], s0 + SLAB)):
            diff = (xf[..., :, None, k] - yf[..., None, :, k]).double()  # rounded to float32
            acc = (diff * diff + acc.double()).float()  # a float32 multiply-add: one rounding
        out = out + acc.double()
    return out


def float64_gemm(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    g = x @ y.mT
    return (x.pow(2).sum(-1)[..., :, None] + y.pow(2).sum(-1)[..., None, :] - 2 * g).clamp_min(0)


STACKED: list[torch.Tensor] = []  # the problem's stacked points [q_z; prior_z] (set by main)


def gemm_from_first(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    ref = STACKED[0][..., :1, :]
    return float64_gemm(x - ref, y - ref)


def gemm_from_middle(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    s = STACKED[0]
    ref = s[..., [0, s.shape[-2] // 2, s.shape[-2] - 1], :].median(-2, keepdim=True).values
    return float64_gemm(x - ref, y - ref)


SCHEMES = {"float64 differences": float64_differences, "float32 slabs": float32_slabs,
           "float64 GEMM": float64_gemm, "GEMM from x_0": gemm_from_first, "GEMM from a middle point": gemm_from_middle}


def with_distances(scheme):
    """reference._sqdist with the scheme's values and the exact formula's gradient."""
    def sqdist(x, y):
        exact = EXACT(x, y)
        return scheme(x.detach(), y.detach()) + (exact - exact.detach())
    return sqdist


def problems():
    """(set, shape, offset, shift, spread, seed, p, q): float32 samples."""
    for (n, d), shift, spread, seed in itertools.product(precision.SHAPES, precision.SHIFTS, precision.SPREADS,
                                                         precision.SEEDS):
        yield ("draws", (n, d), 0.0, shift, spread, seed, *precision.draw((1, n, d, False), shift, spread, seed))
    for (n, d), offset, shift, spread in itertools.product(OFFSET_SHAPES, OFFSETS, [0.0, 3.0], [1.0, 0.2]):
        p, q = precision.draw((1, n, d, False), shift, spread, 0)
        yield ("offset", (n, d), offset, shift, spread, 0, (p.double() + offset).float(), (q.double() + offset).float())
    for (n, d), outlier, shift, spread in itertools.product(OFFSET_SHAPES, OUTLIERS, [0.0, 3.0], [1.0, 0.2]):
        p, q = precision.draw((1, n, d, False), shift, spread, 0)
        q = q.double()
        q[..., 0, :] += outlier
        yield ("outlier", (n, d), outlier, shift, spread, 0, p, q.float())


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json", default=None, help="write the summaries and every problem's errors here")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    oracle = lambda a, b: reference.kernel_kl(a, b, precision.LAM)  # noqa: E731
    rows = []
    for kind, (n, d), offset, shift, spread, seed, p, q in problems():
        p, q = p.double(), q.double()
        STACKED[:] = [torch.cat([q, p], -2)]  # (kernel_kl's default, reverse: q_z is the denominator, stacked first)
        v64, g64 = precision.value_and_grad(oracle, p, q)
        row = {"set": kind, "shape": f"({n}, {d})", "offset": offset, "shift": shift, "spread": spread, "seed": seed}
        try:
            for name, scheme in SCHEMES.items():
                reference._sqdist = with_distances(scheme)
                v, g = precision.value_and_grad(oracle, p, q)
                # as the op's float32 outputs
                ve, ge = precision.rel_errors(v.float().double(), g.float().double(), v64, g64)
                row[name] = {"value": float(ve.max()), "grad": float(ge.max())}
        finally:
            reference._sqdist = EXACT
        rows.append(row)
        print(f"  {kind} {row['shape']} offset {offset:g} shift {shift} spread {spread} seed {seed}: "
              + ", ".join(f"{k} {row[k]['value']:.1e} / {row[k]['grad']:.1e}" for k in SCHEMES),
              file=sys.stderr, flush=True)
    out = {"lam": precision.LAM, "contract": precision.CONTRACT, "slab": SLAB, "torch": torch.__version__}
    for kind in ("draws", "offset", "outlier"):
        summ = precision.summary([r for r in rows if r["set"] == kind], list(SCHEMES))
        print(f"\n### {kind}: squared distances by each scheme, oracle kivi_fast.reference.kernel_kl (float64)\n")
        print(precision.table(summ, list(SCHEMES)))
        out[f"{kind}_summary"] = summ
    out["problems"] = rows
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
