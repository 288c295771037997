"""How often the backward's gradient lands on fresh pages, and what that costs, per call.

    python bench/faults.py [--shape 10x314000] [--calls 300] [--lib build.so]

Calls torch.autograd.grad(kivi_fast.kl(p, q), q) (float32, 1 thread) `calls` times on the inputs of
bench/run.py's shape and times the backward alone, with the process's minor page faults around it.
Prints the median and quartiles of the backward's time, how many calls faulted (more than 16 faults:
a gradient on fresh 4 KB pages takes thousands, on huge pages a few) and the faults per call. With
--lib, the ops of that build (bench/build_renamed.sh; NS from the file name, NS.so) instead of the
installed package's: torch.autograd.grad of torch.ops.NS.kl's value on [1, n, d] samples (the op's
autograd formula, no Python wrapper); without, kivi_fast.kl on the [n, d] samples.
Session 15 kept the gradients' buffers between calls (csrc/kept_outputs.h) after this showed a third
of (10, 314000)'s backward calls faulting in the 12.5 MB gradient page by page.
"""
import argparse
import os
import resource
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from run import make_inputs, parse_shape  # noqa: E402


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", default="10x314000", help="NxD or BxNxD (n_p = n_q = N)")
    ap.add_argument("--calls", type=int, default=300)
    ap.add_argument("--lib", default=None, help="a build from bench/build_renamed.sh (its namespace from the file name)")
    args = ap.parse_args()
    torch.set_num_threads(1)
    p, q = make_inputs(*parse_shape(args.shape), torch.float32)
    if args.lib:
        torch.ops.load_library(args.lib)
        op = getattr(torch.ops, os.path.splitext(os.path.basename(args.lib))[0]).kl
        p3, q3 = (p, q) if p.dim() == 3 else (p[None], q[None])
        kl = lambda qs: op(p3, qs, 1e-3, 1e-8, None, True)[0].sum()  # noqa: E731
        q = q3
    else:
        import kivi_fast
        kl = lambda qs: kivi_fast.kl(p, qs).sum()  # noqa: E731
    qs = q.clone().requires_grad_(True)
    times, faulted, total = [], 0, 0
    for _ in range(args.calls):
        value = kl(qs)
        f0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        t0 = time.perf_counter()
        torch.autograd.grad(value, qs)
        t1 = time.perf_counter()
        faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - f0
        times.append((t1 - t0) * 1e3)
        faulted += faults > 16
        total += faults
    times.sort()
    k = len(times)
    print(f"{args.shape} float32 1 thread, backward of {k} calls: median {times[k // 2]:.2f} ms "
          f"(quartiles {times[k // 4]:.2f}-{times[3 * k // 4]:.2f}, max {times[-1]:.2f}); "
          f"{faulted} calls with more than 16 page faults, {total / k:.0f} faults a call on average")


if __name__ == "__main__":
    main()
