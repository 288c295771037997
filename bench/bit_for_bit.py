"""Whether a change to csrc/ keeps the kl op's results bit for bit: save them from one build, compare them
with another's.

    .venv/bin/python bench/bit_for_bit.py save /tmp/before.pt     # on the build before the change
    .venv/bin/python bench/bit_for_bit.py compare /tmp/before.pt  # on the build after it

Runs ``torch.ops.kivi_fast.kl`` forward (value, grad state, bandwidth) and backward (the gradient w.r.t.
q_z) with fixed seeds on shapes that take each of the CPU kernels' paths (few points in many dimensions,
row dots, register tiles, GEMMs, the refined solve, the sampled median, distances inside the Gram's
tiles), float32 and float64, both settings of ``reverse``, 1 and 2 threads, on the device-generic
kernels and on the CPU kernels with the Gram's register tiles and the few-points kernels' AVX-512 version
switched on and off where this CPU has them; and the other ops (sqdist, median_bandwidth, fit, ratio
and its backward) on the same shapes. Compares with ``torch.equal``: any bit counts.
"""

from __future__ import annotations

import argparse
import itertools
import sys

import torch

import kivi_fast

# (batch or None, n_p = n_q, d)
SHAPES = [(None, 100, 8), (128, 100, 8), (None, 100, 51), (None, 100, 700), (None, 1000, 32),
          (None, 10, 31400), (None, 300, 16), (None, 1100, 32)]


def switch(name):
    """A test switch of the ops, in the testing namespace or (older builds) as torch.ops.kivi_fast._name."""
    try:
        return getattr(torch.ops.kivi_fast_testing, name)
    except (AttributeError, RuntimeError):
        return getattr(torch.ops.kivi_fast, "_" + name)


def settings():
    """(generic, tiles, few_points_avx512): the device-generic kernels, and the CPU kernels with each
    setting of the switches this CPU can run."""
    tiles = [False, True] if switch("gram_tiles_available")() else [False]
    return [(True, False, False)] + [(False, t, a) for t, a in itertools.product(tiles, [False, True])]


def set_few_points_avx512(flag):
    """The few-points kernels' AVX-512 (True) or AVX2 version; returns the old setting (older builds:
    their switch forced AVX2)."""
    try:
        return switch("set_few_points_avx512")(flag)
    except (AttributeError, RuntimeError):
        return not switch("set_few_points_avx2")(not flag)


def run_all():
    results = {}
    for (batch, n, d), dtype, reverse, threads, (generic, tiles, avx512) in itertools.product(
            SHAPES, [torch.float32, torch.float64], [True, False], [1, 2], settings()):
        g = torch.Generator().manual_seed(1000 * n + d + (batch or 0))
        lead = () if batch is None else (batch,)
        p = torch.randn(*lead, n, d, generator=g, dtype=torch.float64).to(dtype)
        q = (torch.randn(*lead, n, d, generator=g, dtype=torch.float64) * 0.8 + 0.3).to(dtype).requires_grad_(True)
        old_threads = torch.get_num_threads()
        torch.set_num_threads(threads)
        old_tiles, old_avx512 = switch("set_gram_tiles")(tiles), set_few_points_avx512(avx512)
        old_generic = switch("set_force_generic")(generic)
        try:
            out = torch.ops.kivi_fast.kl(p, q, 1e-3, 1e-8, None, reverse, True)
            weights = torch.arange(1, out[0].numel() + 1, dtype=out[0].dtype).reshape(out[0].shape)
            (grad,) = torch.autograd.grad((out[0] * weights).sum(), q)
        finally:
            switch("set_force_generic")(old_generic)
            switch("set_gram_tiles")(old_tiles)
            set_few_points_avx512(old_avx512)
            torch.set_num_threads(old_threads)
        key = f"{batch}x({n}, {d}) {dtype} reverse={reverse} threads={threads} " + (
            "generic" if generic else f"tiles={tiles} avx512={avx512}")
        results[key] = [t.detach().clone() for t in out[:3]] + [grad.clone()]
    # the other ops, on the CPU kernels with the default switches (the ratio's backward: weighted_grad)
    ops = torch.ops.kivi_fast
    for (batch, n, d), dtype, threads in itertools.product(SHAPES, [torch.float32, torch.float64], [1, 2]):
        g = torch.Generator().manual_seed(7 + 1000 * n + d + (batch or 0))
        p = torch.randn(batch or 1, n, d, generator=g, dtype=torch.float64).to(dtype)
        q = (torch.randn(batch or 1, n, d, generator=g, dtype=torch.float64) * 0.8 + 0.3).to(dtype)
        old_threads = torch.get_num_threads()
        torch.set_num_threads(threads)
        try:
            sq = ops.sqdist(p, q)
            med = ops.median_bandwidth(torch.cat([p, q], 1))
            alpha, sigma = ops.fit(p, q, 1e-3, None)
            z = q[:, ::3].clone().requires_grad_(True)
            r, w = ops.ratio(z, p, q, alpha, 1.0 / (1e-3 * n), sigma)
            (grad,) = torch.autograd.grad(r.sum(), z)
        finally:
            torch.set_num_threads(old_threads)
        key = f"other ops {batch}x({n}, {d}) {dtype} threads={threads}"
        results[key] = [t.detach().clone() for t in (sq, med, alpha, sigma, r, w, grad)]
    return results


def main():
    assert kivi_fast.backend() == "cpp", "the compiled ops are not built"
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("action", choices=["save", "compare"])
    ap.add_argument("path")
    args = ap.parse_args()
    results = run_all()
    if args.action == "save":
        torch.save(results, args.path)
        print(f"saved {len(results)} cases to {args.path}")
        return 0
    saved = torch.load(args.path)
    names = {4: ["kl", "state", "sigma", "grad"],
             7: ["sqdist", "median", "alpha", "sigma", "ratio", "ratio state", "grad"]}
    differ = [f"{key}: {name}" for key, outs in results.items() if key in saved
              for name, a, b in zip(names[len(outs)], outs, saved[key]) if not torch.equal(a, b)]
    missing = sorted(set(saved) ^ set(results))
    for line in differ + [f"not in both: {k}" for k in missing]:
        print("DIFFERS", line)
    same = len(results) - len({line.split(":")[0] for line in differ})
    print(f"{same} of {len(results)} cases bit for bit equal" + ("" if not missing else f", {len(missing)} unmatched"))
    return 1 if differ or missing else 0


if __name__ == "__main__":
    sys.exit(main())
