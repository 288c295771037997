"""Training steps on a GPU with kivi_fast's CUDA kernels and with the device-generic ATen kernels they
replace, in one process: the paper's VAE step (batch 128, n_q = n_p = 100, z in 8 dimensions; kivi-ac,
the paper's setting, and kivi) and the MNIST BNN step (L = 400, 10 posterior samples, KIVI per layer).

    python bench/train_steps.py --json bench/train_steps.json

Each step is the trainers' own ``step_profile`` (kivi_fast/experiments/vae.py and mnist.py): median
seconds of a forward + backward, and of its KL part alone. "generic" forces the device-generic kernels
(torch.ops.kivi_fast_testing.set_force_generic), which is what CUDA tensors ran before csrc/cuda/.
Then the VAE and MNIST trainers' whole steps (forward, backward, Adam) eager and captured in a CUDA
graph (``--cuda-graph``), with the CUDA kernels.
Random inputs of the real shapes: no data files are needed.
"""

from __future__ import annotations

import argparse
import sys

import torch

import gpu as gpu_bench  # bench/gpu.py: the device line and the JSON file
from kivi_fast.experiments import mnist as mnist_exp
from kivi_fast.experiments import vae as vae_exp
from kivi_fast.experiments.graphs import CapturedStep, capturable_adam
from kivi_fast.experiments.training import timed
from kivi_fast.nn.classification import ClassificationBNN
from kivi_fast.nn.vae import build_vae


def vae_profile(method: str, device, repeats: int) -> dict:
    torch.manual_seed(0)
    model = build_vae(method, n_q=100, n_p=100, lam=1e-3, clip=1e-8, contrast="diagonal").to(device)
    x = (torch.rand(128, 784, device=device) < 0.3).float()
    g = torch.Generator(device=device).manual_seed(1)
    vae_exp.step_profile(model, x, g, repeats=3)  # warm-up: cuBLAS handles, the caching allocator
    return vae_exp.step_profile(model, x, g, repeats=repeats)


def vae_full_steps(method: str, device, repeats: int) -> dict:
    """Median seconds of the VAE trainer's whole step (forward, backward, Adam) on one batch: eager, and
    captured in a CUDA graph and replayed (``--cuda-graph``: graphs.CapturedStep, capturable Adam)."""
    out = {}
    for name in ("eager", "graph"):
        torch.manual_seed(0)
        model = build_vae(method, n_q=100, n_p=100, lam=1e-3, clip=1e-8, contrast="diagonal").to(device)
        g = torch.Generator(device=device).manual_seed(1)
        inputs = {"x": (torch.rand(128, 784, device=device) < 0.3).float(), **model.draws(128, g, device)}
        if name == "graph":
            step = vae_exp.make_train_step(model, capturable_adam(model.parameters(), 1e-3, device))
            run = CapturedStep(step, device)
        else:
            run = vae_exp.make_train_step(model, torch.optim.Adam(model.parameters(), lr=1e-3))
        for _ in range(5):  # warm-up (and the capture)
            run(inputs)
        times = sorted(timed(lambda: run(inputs), device)[0] for _ in range(repeats))
        out[name] = times[len(times) // 2]
    return out


def mnist_full_steps(device, repeats: int) -> dict:
    """Median seconds of the MNIST trainer's whole step (L = 400, 10 samples; forward, backward, Adam):
    eager, and captured in a CUDA graph and replayed (``--cuda-graph``)."""
    out = {}
    for name in ("eager", "graph"):
        torch.manual_seed(0)
        model = ClassificationBNN((784, 400, 400, 10), "kivi", lam=1e-3, clip=1e-8, n_prior=10).to(device)
        inputs = {"x": torch.rand(100, 784, device=device), "y": torch.randint(0, 10, (100,), device=device)}
        opt = (capturable_adam(model.parameters(), 1e-3, device) if name == "graph"
               else torch.optim.Adam(model.parameters(), lr=1e-3))
        step = mnist_exp.make_train_step(model, opt, 60000, 10)
        run = CapturedStep(step, device) if name == "graph" else step
        for _ in range(5):  # warm-up (and the capture)
            run(inputs)
        times = sorted(timed(lambda: run(inputs), device)[0] for _ in range(repeats))
        out[name] = times[len(times) // 2]
    return out


def mnist_profile(device, repeats: int) -> dict:
    torch.manual_seed(0)
    model = ClassificationBNN((784, 400, 400, 10), "kivi", lam=1e-3, clip=1e-8, n_prior=10).to(device)
    x = torch.rand(100, 784, device=device)
    y = torch.randint(0, 10, (100,), device=device)
    mnist_exp.step_profile(model, x, y, 60000, 10, repeats=3)
    return mnist_exp.step_profile(model, x, y, 60000, 10, repeats=repeats)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--json", metavar="PATH", help="save the device and the results as JSON")
    args = ap.parse_args(argv)
    info = gpu_bench.device_info("bench/train_steps.py")
    if info is None:
        return 2
    device = torch.device("cuda")
    cases = {"vae kivi-ac": lambda: vae_profile("kivi-ac", device, args.repeats),
             "vae kivi": lambda: vae_profile("kivi", device, args.repeats),
             "mnist kivi L=400": lambda: mnist_profile(device, args.repeats)}
    rows = []
    for name, run in cases.items():
        row = {"case": name}
        for kernels in ("generic", "cuda"):
            old = torch.ops.kivi_fast_testing.set_force_generic(kernels == "generic")
            try:
                row[kernels] = run()
            finally:
                torch.ops.kivi_fast_testing.set_force_generic(old)
        rows.append(row)
        print(f"{name:18} " + "  ".join(
            f"{k}: step {row[k]['step_seconds'] * 1e3:6.2f} ms, KL {row[k]['kl_seconds'] * 1e3:6.2f} ms "
            f"({100 * row[k]['kl_share']:4.1f}%)" for k in ("generic", "cuda")), flush=True)
    full_steps = {"vae kivi-ac full step": lambda: vae_full_steps("kivi-ac", device, args.repeats),
                  "vae kivi full step": lambda: vae_full_steps("kivi", device, args.repeats),
                  "mnist L=400 full step": lambda: mnist_full_steps(device, args.repeats)}
    for name, run in full_steps.items():
        row = {"case": name, **run()}
        rows.append(row)
        print(f"{row['case']:24} eager {row['eager'] * 1e3:6.2f} ms, CUDA graph {row['graph'] * 1e3:6.2f} ms",
              flush=True)
    gpu_bench.save_json(args.json, info, rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
