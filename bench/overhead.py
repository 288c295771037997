"""What kivi_fast.kernel_kl's Python side and autograd graph cost on top of the bare op, per call.

    python bench/overhead.py [--shape 100x8] [--seconds 10]

Times, alternately in one process (this VM's speed drifts between runs), float32, 1 thread:
  - kl:      torch.autograd.grad(kivi_fast.kernel_kl(p, q), q), unbatched [n, d] samples (a training step);
  - op:      the same through torch.ops.kivi_fast.kl on [1, n, d] samples (no argument checks);
  - op fwd:  the op's forward alone, keeping the gradient state;
  - trivial: torch.autograd.grad((q * 2).sum(), q), the autograd engine's fixed cost here.
kl - op is the wrapper's cost (argument checks, and any view nodes it adds to the graph); op - op fwd
is the backward with the engine's fixed cost. Prints the median of each, in microseconds.
"""
import argparse
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from run import make_inputs, parse_shape, shape_arg  # noqa: E402

import kivi_fast  # noqa: E402


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", type=shape_arg, default="100x8", help="NxD (n_p = n_q = N)")
    ap.add_argument("--seconds", type=float, default=10.0)
    args = ap.parse_args()
    torch.set_num_threads(1)
    if kivi_fast.backend() != "cpp":
        raise SystemExit("the compiled ops are not built (pip install --no-build-isolation -e .)")
    b, n, d, batched = parse_shape(args.shape)
    if batched:
        raise SystemExit("an unbatched shape NxD, please")
    p, q = make_inputs(b, n, d, False, torch.float32)
    q.requires_grad_()
    p1, q1 = p[None].contiguous(), q.detach()[None].clone().requires_grad_()
    ones = torch.ones(1)
    op = torch.ops.kivi_fast.kl
    calls = {
        "kl": lambda: torch.autograd.grad(kivi_fast.kernel_kl(p, q), q),
        "op": lambda: torch.autograd.grad(op(p1, q1, 1e-3, 1e-8, None, True, True)[0], q1, ones),
        "op fwd": lambda: op(p1, q1.detach(), 1e-3, 1e-8, None, True, True),
        "trivial": lambda: torch.autograd.grad((q * 2).sum(), q),
    }
    times = {k: [] for k in calls}
    for f in calls.values():
        for _ in range(20):
            f()
    end = time.perf_counter() + args.seconds
    while time.perf_counter() < end:
        for k, f in calls.items():
            t0 = time.perf_counter()
            f()
            times[k].append(time.perf_counter() - t0)
    med = {k: statistics.median(v) * 1e6 for k, v in times.items()}
    print(f"{args.shape} float32, 1 thread, {len(times['kl'])} calls each (median, us):")
    for k, v in med.items():
        print(f"  {k:8s} {v:8.1f}")
    print(f"  wrapper (kl - op) {med['kl'] - med['op']:.1f} us; backward with the engine (op - op fwd) "
          f"{med['op'] - med['op fwd']:.1f} us")


if __name__ == "__main__":
    main()
