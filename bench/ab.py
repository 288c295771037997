"""A/B of two builds of the C++ ops in one process (bench/build_renamed.sh makes them).

    python bench/ab.py /tmp/kfA.so /tmp/kfB.so 128x100x8 [--seconds 8] [--pass fwd]
    python bench/ab.py /tmp/kfA.so /tmp/kfB.so 128x100x8 --op ratio   # the ratio op instead

run.py compares ours with pure PyTorch; this compares two versions of ours, for a change to csrc/.
Separate processes, or runs minutes apart, differ by tens of percent on this VM (its speed drifts);
here the two builds are called alternately, A B then B A, on the same inputs, and the result is the
median over the pairs of the ratio A time / B time (> 1: B is faster) with its interquartile range.
The pass is the kl op's forward keeping the gradient state (fwd) or that plus torch.autograd.grad
(fwd+bwd, the default), float32, 1 thread (--threads), the inputs of bench/run.py's shapes (n_p = n_q = n).
--switch NAME=0|1 sets a test switch (csrc/testing.cpp) of each build that has it, e.g. the few-points
kernels' AVX-512 version (set_few_points_avx512=1; builds before it had set_few_points_avx2) or the
Gram's GEMMs (set_gram_tiles=0). --op ratio: the ratio op instead (DensityRatio's evaluation, kivi_fast.kl's second kernel term), at q
against the ratio fitted to p and q (2n points; coefficients and bandwidth made up: the op's time does
not depend on them), forward without a gradient to come (grad_state=False where the build's op takes
it) or forward + backward (its weighted_grad).
"""
import argparse
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from run import make_inputs, parse_shape, shape_arg  # noqa: E402


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("lib_a")
    ap.add_argument("lib_b")
    ap.add_argument("shape", type=shape_arg, help="NxD or BxNxD")
    ap.add_argument("--seconds", type=float, default=5.0)
    ap.add_argument("--pass", dest="which", choices=["fwd", "fwd+bwd"], default="fwd+bwd")
    ap.add_argument("--dtype", choices=["float32", "float64"], default="float32")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--op", choices=["kl", "ratio"], default="kl")
    ap.add_argument("--switch", action="append", default=[], metavar="NAME=0|1",
                    help="a test switch of both builds (their NS_testing.NAME), e.g. set_few_points_avx512=1")
    args = ap.parse_args()
    for lib in (args.lib_a, args.lib_b):
        if not os.path.isfile(lib):
            ap.error(f"no library file {lib} (bench/build_renamed.sh builds one)")
    torch.set_num_threads(args.threads)
    names = []
    for lib in (args.lib_a, args.lib_b):
        torch.ops.load_library(lib)
        names.append(os.path.basename(lib).split(".")[0])
    if names[0] == names[1]:
        raise SystemExit("the two builds need different namespaces (bench/build_renamed.sh's NS)")
    for switch in args.switch:  # on each build that has it (a switch renamed between them: give both names)
        name, _, flag = switch.partition("=")
        found = [ns for ns in names if hasattr(getattr(torch.ops, ns + "_testing"), name)]
        if not found:
            raise SystemExit(f"neither build has the test switch {name}")
        for ns in found:
            getattr(getattr(torch.ops, ns + "_testing"), name)(flag == "1")
    b, n, d, _ = parse_shape(args.shape)
    # batched [B, n, d] samples (B = 1 for NxD) at the op: the C++ side only, no Python wrapper
    p, q = make_inputs(b, n, d, True, getattr(torch, args.dtype))
    q.requires_grad_()

    alpha = torch.randn(b, n, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    sigma = torch.full((b,), d ** 0.5, dtype=torch.float64)

    def call(ns):
        if args.op == "ratio":
            op = getattr(torch.ops, ns).ratio
            if args.which == "fwd":  # no gradient to come: no grad state, where the build's op can skip it
                no_state = (False,) if any(a.name == "grad_state" for a in op.default._schema.arguments) else ()
                return lambda: op(q.detach(), p, q.detach(), alpha, 0.5, sigma, *no_state)[0]
            return lambda: torch.autograd.grad(op(q, p, q.detach(), alpha, 0.5, sigma)[0].sum(), q)[0]
        op = getattr(torch.ops, ns).kl
        if args.which == "fwd":
            return lambda: op(p, q.detach(), 1e-3, 1e-8, None, True, True)[0]
        return lambda: torch.autograd.grad(op(p, q, 1e-3, 1e-8, None, True, True)[0].sum(), q)[0]

    fa, fb = call(names[0]), call(names[1])
    diff = (fa() - fb()).abs().max().item()
    for _ in range(3):
        fa(), fb()
    ta, tb, ratio = [], [], []
    end = time.perf_counter() + args.seconds
    while time.perf_counter() < end:
        for first, second in ((fa, fb), (fb, fa)):
            t0 = time.perf_counter()
            first()
            t1 = time.perf_counter()
            second()
            t2 = time.perf_counter()
            a, b_ = (t1 - t0, t2 - t1) if first is fa else (t2 - t1, t1 - t0)
            ta.append(a)
            tb.append(b_)
            ratio.append(a / b_)
    q1, _, q3 = statistics.quantiles(ratio, n=4)
    print(f"{args.op} {args.shape} {args.dtype} {args.which} {args.threads} thr: A {statistics.median(ta) * 1e6:.0f} us, "
          f"B {statistics.median(tb) * 1e6:.0f} us, A/B {statistics.median(ratio):.3f} "
          f"(IQR {q1:.3f}-{q3:.3f}, {len(ratio)} pairs); max |A - B| of the result {diff:.2g}")


if __name__ == "__main__":
    main()
