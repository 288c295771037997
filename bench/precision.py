"""How often, and by how much, each side misses the 1e-3 accuracy contract on float32 inputs.

    .venv/bin/python bench/precision.py [--json bench/precision.json] [--quick]

kivi_fast promises float32 results (the KL value and its gradient w.r.t. q_z) within 1e-3 relative of
the float64 computation on the same float32 inputs. For each side of bench/run.py,

- ``ours``: kivi_fast.kernel_kl;
- ``strong``: bench/pure_torch.py's strong side (float64 products, float32 only where measured safe);
- ``fast``: bench/pure_torch.py's fast side (float32 throughout),

this measures the relative error of the value (max |error| / max |oracle|, over a batch's elements)
and of the gradient (max-norm relative: max |error| / max |oracle gradient|), and counts a miss where
either exceeds 1e-3. Two sets of problems, both float32, lam = 1e-3:

1. ``draws``: posteriors q = shift + spread N(0, I) against a prior N(0, I), the situation of a trained
   BNN layer (weights moved off the prior's mean, with a smaller spread): shifts 0 / 3 / 20, spreads
   1 / 0.2 / 0.05, 3 seeds, 7 shapes (189 problems). The oracle is the test oracle
   ``kivi_fast.reference.kernel_kl`` in float64 (coordinate differences, no GEMM); it materializes [N, N, d]
   differences, so (100, 2000) and (10, 20000) stand in for the wide layers.
2. ``bench shapes``: bench/run.py's shapes, with its own inputs (``make_inputs``, seed 0) and the same
   27 (shift, spread, seed) draws as above; each element of a batched shape counts as one problem. The
   oracle is the strong side run on the inputs converted to float64 (float64 throughout: Gram, fit
   and the backward's product), which part 1 checks against ``kivi_fast.reference.kernel_kl``
   (``strong f64 vs reference``: within 6e-10) — the reference cannot hold these shapes' [N, N, d].
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
import time
import warnings
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import pure_torch  # noqa: E402

with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    import kivi_fast  # noqa: E402
    from kivi_fast import reference  # noqa: E402

SHAPES = [(100, 8), (100, 32), (100, 51), (300, 64), (100, 700), (100, 2000), (10, 20000)]
SHIFTS = [0.0, 3.0, 20.0]
SPREADS = [1.0, 0.2, 0.05]
SEEDS = [0, 1, 2]
CONTRACT = 1e-3
LAM = 1e-3
# bench/run.py's shapes (B, n, d, batched), without importing it (it imports this module's neighbours)
BENCH_SHAPES = "10x314000,100x700,100x51,100x8,128x100x8,1000x32,2000x32,100x50000"
QUICK_BENCH_SHAPES = "100x8,128x100x8,100x700,1000x32"

SIDES = {
    "ours": lambda p, q: kivi_fast.kernel_kl(p, q, LAM),
    "strong": lambda p, q: pure_torch.kl(p, q, LAM, side="strong"),
    "fast": lambda p, q: pure_torch.kl(p, q, LAM, side="fast"),
}


def value_and_grad(fn, p, q):
    q = q.detach().clone().requires_grad_(True)
    value = fn(p, q)
    (grad,) = torch.autograd.grad(value.sum(), q)
    return value.detach().double(), grad.double()


def rel_errors(v, g, v64, g64) -> tuple[torch.Tensor, torch.Tensor]:
    """Per batch element ([B] or []): value and gradient max-norm relative errors."""
    if v64.dim() == 0:
        v, g, v64, g64 = v[None], g[None], v64[None], g64[None]
    ve = (v - v64).abs() / v64.abs().clamp_min(1e-300)
    ge = (g - g64).abs().amax((-2, -1)) / g64.abs().amax((-2, -1)).clamp_min(1e-300)
    return ve, ge


def draw(shape, shift, spread, seed):
    b, n, d, batched = shape
    g = torch.Generator().manual_seed(seed)
    lead = (b,) if batched else ()
    p = torch.randn(*lead, n, d, generator=g, dtype=torch.float64).float()
    q = (shift + spread * torch.randn(*lead, n, d, generator=g, dtype=torch.float64)).float()
    return p, q


def bench_inputs(shape):
    """bench/run.py's make_inputs(..., float32, seed=0)."""
    b, n, d, batched = shape
    g = torch.Generator().manual_seed(0)
    lead = (b,) if batched else ()
    p = torch.randn(*lead, n, d, generator=g, dtype=torch.float64).float()
    q = (0.8 * torch.randn(*lead, n, d, generator=g, dtype=torch.float64) + 0.3).float()
    return p, q


def parse_shape(s):
    parts = [int(v) for v in s.lower().split("x")]
    return (1, parts[0], parts[1], False) if len(parts) == 2 else (parts[0], parts[1], parts[2], True)


def shape_name(shape):
    b, n, d, batched = shape
    return f"{b}x({n}, {d})" if batched else f"({n}, {d})"


def measure_draws() -> list[dict]:
    rows = []
    for (n, d), shift, spread, seed in itertools.product(SHAPES, SHIFTS, SPREADS, SEEDS):
        p, q = draw((1, n, d, False), shift, spread, seed)
        v64, g64 = value_and_grad(lambda a, b: reference.kernel_kl(a, b, LAM), p.double(), q.double())
        row = {"shape": f"({n}, {d})", "shift": shift, "spread": spread, "seed": seed}
        for name, fn in SIDES.items():
            ve, ge = rel_errors(*value_and_grad(fn, p, q), v64, g64)
            row[name] = {"value": float(ve.max()), "grad": float(ge.max())}
        # the oracle of part 2 against the reference (float64 inputs)
        ve, ge = rel_errors(*value_and_grad(SIDES["strong"], p.double(), q.double()), v64, g64)
        row["strong f64 vs reference"] = {"value": float(ve.max()), "grad": float(ge.max())}
        rows.append(row)
    return rows


def measure_bench_shapes(shapes: list[str]) -> list[dict]:
    rows = []
    for s in shapes:
        shape = parse_shape(s)
        cases = [("bench inputs", None, None, 0)] + [("draw", *c) for c in itertools.product(SHIFTS, SPREADS, SEEDS)]
        for kind, shift, spread, seed in cases:
            p, q = bench_inputs(shape) if kind == "bench inputs" else draw(shape, shift, spread, seed)
            v64, g64 = value_and_grad(SIDES["strong"], p.double(), q.double())
            row = {"shape": shape_name(shape), "inputs": kind, "shift": shift, "spread": spread, "seed": seed,
                   "elements": shape[0]}
            for name, fn in SIDES.items():
                ve, ge = rel_errors(*value_and_grad(fn, p, q), v64, g64)
                row[name] = {"value": float(ve.max()), "grad": float(ge.max()),
                             "misses": int(((ve > CONTRACT) | (ge > CONTRACT)).sum())}
            rows.append(row)
        print(f"  {shape_name(shape)}: {len(cases)} problems", file=sys.stderr, flush=True)
    return rows


def _misses(row, side):
    if "misses" in row[side]:
        return row[side]["misses"]
    return int(row[side]["value"] > CONTRACT or row[side]["grad"] > CONTRACT)


def summary(rows: list[dict], sides) -> list[dict]:
    """Per shape and over all: problems, and per side max value error, max gradient error, misses."""
    out = []
    names = list(dict.fromkeys(r["shape"] for r in rows))
    for shape in names + [None]:
        sel = [r for r in rows if shape is None or r["shape"] == shape]
        entry = {"shape": shape or "all", "problems": sum(r.get("elements", 1) for r in sel)}
        for side in sides:
            entry[side] = {"value": max(r[side]["value"] for r in sel), "grad": max(r[side]["grad"] for r in sel),
                           "misses": sum(_misses(r, side) for r in sel)}
        out.append(entry)
    return out


def table(summ: list[dict], sides) -> str:
    lines = ["| shape | problems | " + " | ".join(f"{s}: max value err / max grad err / misses" for s in sides) + " |",
             "|---|---:|" + "---:|" * len(sides)]
    for e in summ:
        cells = [f"{e[s]['value']:.1e} / {e[s]['grad']:.1e} / {e[s]['misses']}" for s in sides]
        label = f"**{e['shape']}**" if e["shape"] == "all" else e["shape"]
        lines.append(f"| {label} | {e['problems']} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json", default=None, help="write the summaries and every problem's errors here")
    ap.add_argument("--quick", action="store_true", help="part 2 on bench/run.py's --quick shapes only")
    ap.add_argument("--skip-draws", action="store_true", help="part 2 only")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    t0 = time.perf_counter()
    print(f"kivi_fast backend: {kivi_fast.backend()}; lam {LAM}; contract {CONTRACT} relative", file=sys.stderr)
    out = {"backend": kivi_fast.backend(), "lam": LAM, "contract": CONTRACT, "torch": torch.__version__}
    if not args.skip_draws:
        print(f"part 1: {len(SHAPES) * len(SHIFTS) * len(SPREADS) * len(SEEDS)} drawn problems against "
              "kivi_fast.reference.kernel_kl", file=sys.stderr, flush=True)
        draws = measure_draws()
        s1 = summary(draws, list(SIDES) + ["strong f64 vs reference"])
        print("\n### Drawn problems, oracle kivi_fast.reference.kernel_kl (float64)\n")
        print(table(s1, list(SIDES) + ["strong f64 vs reference"]))
        out["draws_summary"], out["draws"] = s1, draws
    shapes = (QUICK_BENCH_SHAPES if args.quick else BENCH_SHAPES).split(",")
    print(f"part 2: bench/run.py's shapes {shapes}", file=sys.stderr, flush=True)
    bench = measure_bench_shapes(shapes)
    s2 = summary(bench, list(SIDES))
    print("\n### bench/run.py's shapes (its inputs + 27 draws), oracle the strong side in float64\n")
    print(table(s2, list(SIDES)))
    out["bench_summary"], out["bench"] = s2, bench
    out["seconds"] = time.perf_counter() - t0
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
