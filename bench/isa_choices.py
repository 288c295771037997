"""The CPU kernels' instruction-set choice (csrc/cpu/isa.h, prefer_512_bit) timed both ways in one
process on this CPU: the 512-bit kernels (the few-points kernels' AVX-512 version, the Gram by MKL's
GEMMs) against the 256-bit ones (the few-points kernels' AVX2 version, the Gram by gram_tiles' AVX2
register tiles, which also moves the differences' limit from 32 dimensions to 8), both switches set
together as a CPU of either kind runs them. The few-points shapes (an MNIST layer: up to 32 points in
many dimensions) time the first pair, the others mostly the second.

    python bench/isa_choices.py [--seconds 3] [--threads 1] [--json out.json]

The kl op forward + backward (and forward alone for the few-points shapes), float32 and float64, on
bench/run.py's inputs; the two settings alternate, A B then B A, and each row gives the median times
and the median of the pairs' ratios (> 1: the 256-bit choice is faster) with its interquartile range.
Needs a CPU with AVX-512 to compare anything (elsewhere both settings run the AVX2 kernels).
"""
import argparse
import json
import os
import statistics
import sys
import time

import torch

import kivi_fast

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from run import make_inputs  # noqa: E402

FEW_POINTS = [(1, 10, 314000), (1, 10, 31400), (1, 16, 100000)]
GRAM = [(1, 100, 16), (1, 100, 32), (1, 1000, 32), (1, 2000, 32), (1, 100, 51), (1, 100, 700), (1, 100, 50000),
        (1, 1000, 64), (128, 100, 16)]


def alternate(f, set_choice, seconds):
    """Median times of f under choice False (512-bit) and True (256-bit), and of their ratio."""
    def timed(flag):
        set_choice(flag)
        t = time.perf_counter()
        f()
        return time.perf_counter() - t
    for _ in range(2):
        timed(False), timed(True)
    wide, narrow, ratio = [], [], []
    end = time.perf_counter() + seconds
    while time.perf_counter() < end or len(ratio) < 6:
        for order in ((False, True), (True, False)):
            t = {flag: timed(flag) for flag in order}
            wide.append(t[False])
            narrow.append(t[True])
            ratio.append(t[False] / t[True])
    q1, _, q3 = statistics.quantiles(ratio, n=4)
    return statistics.median(wide), statistics.median(narrow), statistics.median(ratio), q1, q3


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seconds", type=float, default=3.0, help="per row")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--json", help="write the rows here")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    if kivi_fast.backend() != "cpp":
        raise SystemExit("the compiled ops are not built (bash scripts/run.sh setup)")
    switches, ops = torch.ops.kivi_fast_testing, torch.ops.kivi_fast
    old = {switch: switch(True) for switch in (switches.set_few_points_avx512, switches.set_gram_tiles)}
    # Both switches together, as a CPU of either kind runs them: with the tiles on, the Gram's backward
    # takes the few-points kernels' weighted sums too.
    def set_choice(narrow):
        switches.set_gram_tiles(narrow)
        switches.set_few_points_avx512(not narrow)

    choices = {
        "few points: AVX-512 / AVX2": FEW_POINTS,
        "Gram: MKL GEMMs / AVX2 tiles": GRAM,
    }
    rows = []
    print(f"{args.threads} thread(s); ratio > 1: the 256-bit choice is faster")
    try:
        for choice, shapes in choices.items():
            for b, n, d in shapes:
                for dtype in (torch.float32, torch.float64):
                    p, q = make_inputs(b, n, d, True, dtype)
                    q.requires_grad_()
                    passes = {"fwd+bwd": lambda: torch.autograd.grad(
                        ops.kl(p, q, 1e-3, 1e-8, None, True, True)[0].sum(), q)}
                    if shapes is FEW_POINTS:
                        passes["fwd"] = lambda: ops.kl(p, q.detach(), 1e-3, 1e-8, None, True, True)
                    for which, f in passes.items():
                        wide, narrow, ratio, q1, q3 = alternate(f, set_choice, args.seconds)
                        shape = f"({n}, {d})" if b == 1 else f"{b} x ({n}, {d})"
                        rows.append(dict(choice=choice, shape=shape, dtype=str(dtype)[6:], passes=which,
                                         wide_ms=wide * 1e3, narrow_ms=narrow * 1e3, ratio=ratio, iqr=[q1, q3]))
                        print(f"{choice} {shape} {str(dtype)[6:]} {which}: {wide * 1e3:.3f} / {narrow * 1e3:.3f} ms, "
                              f"{ratio:.2f} ({q1:.2f}-{q3:.2f})", flush=True)
    finally:
        for switch, flag in old.items():
            switch(flag)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(threads=args.threads, cpu=torch.backends.cpu.get_cpu_capability(), rows=rows), f, indent=1)


if __name__ == "__main__":
    main()
