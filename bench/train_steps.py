"""Training steps on a GPU with kivi_fast's CUDA kernels and with the device-generic ATen kernels they
replace, in one process: the paper's VAE step (batch 128, n_q = n_p = 100, z in 8 dimensions; kivi-ac,
the paper's setting, and kivi) and the MNIST BNN step (L = 400, 10 posterior samples, KIVI per layer).

    python bench/train_steps.py --json bench/train_steps.json
    python bench/train_steps.py --profile    # the replayed steps' kernels by GPU time instead

Each step is the trainers' own ``step_profile`` (kivi_fast/experiments/vae.py and mnist.py): median
seconds of a forward + backward, and of its KL part alone. "generic" forces the device-generic kernels
(torch.ops.kivi_fast_testing.set_force_generic), which is what CUDA tensors ran before csrc/cuda/.
Then the VAE and MNIST trainers' whole steps (forward, backward, Adam) eager, captured in a CUDA graph
(``--cuda-graph``), and that with the networks' matmuls in TF32 (``--tf32``), with the CUDA kernels;
for the VAE also its KL part alone captured in a CUDA graph, and its share of the graphed step.
Random inputs of the real shapes: no data files are needed.
"""

from __future__ import annotations

import argparse
import contextlib
import sys

import torch

import gpu as gpu_bench  # bench/gpu.py: the device line and the JSON file
from kivi_fast.experiments import mnist as mnist_exp
from kivi_fast.experiments import vae as vae_exp
from kivi_fast.experiments.graphs import trainer_adam, trainer_step
from kivi_fast.experiments.training import timed
from kivi_fast.nn.classification import ClassificationBNN
from kivi_fast.nn.vae import build_vae

# The paper's sizes (python_tests/test_gpu_benches.py shrinks them to run the script through on the CPU).
VAE_BATCH, VAE_SAMPLES = 128, 100  # images a step; n_q = n_p posterior and prior samples an image
MNIST_BATCH, MNIST_HIDDEN = 100, 400


def paper_vae(method: str, device):
    """The paper's VAE (n_q = n_p = 100 samples, lam 1e-3) for ``method``, on device."""
    return build_vae(method, n_q=VAE_SAMPLES, n_p=VAE_SAMPLES, lam=1e-3, clip=1e-8, contrast="diagonal").to(device)


def median_replayed(run, inputs: dict, device, repeats: int) -> float:
    """Median seconds of run(inputs) over ``repeats`` calls after five (the warm-up, and a capture)."""
    for _ in range(5):
        run(inputs)
    times = sorted(timed(lambda: run(inputs), device)[0] for _ in range(repeats))
    return times[len(times) // 2]


def vae_profile(method: str, device, repeats: int) -> dict:
    torch.manual_seed(0)
    model = paper_vae(method, device)
    x = (torch.rand(VAE_BATCH, 784, device=device) < 0.3).float()
    g = torch.Generator(device=device).manual_seed(1)
    vae_exp.step_profile(model, x, g, repeats=3)  # warm-up: cuBLAS handles, the caching allocator
    return vae_exp.step_profile(model, x, g, repeats=repeats)


def full_steps(setup, device, repeats: int) -> dict:
    """Median seconds of a trainer's whole step (forward, backward, Adam) on one batch: eager, captured in
    a CUDA graph and replayed (``--cuda-graph``), and that with the networks' matmuls in TF32
    (``--tf32``). ``setup(cuda_graph)`` -> (the trainer's step with its optimizer for that setting, its
    inputs), on a freshly seeded model."""
    out = {}
    for name in ("eager", "graph", "graph_tf32"):
        graph = name != "eager"
        torch.manual_seed(0)
        with tf32(name == "graph_tf32"):
            step, inputs = setup(graph)
            out[name] = median_replayed(trainer_step(step, device, graph), inputs, device, repeats)
    return out


def graphed_vae_kl(method: str, device, repeats: int) -> float:
    """Median seconds of the VAE's KL part alone (forward, and the gradient w.r.t. the samples, at the
    paper's shapes: N(0, I) draws in place of the encoder's, which the timing does not depend on),
    captured in a CUDA graph and replayed: what the KL costs inside the graphed step, where the host's
    launches no longer count (its share of that step: the issue's target)."""
    torch.manual_seed(0)
    model = paper_vae(method, device)
    g = torch.Generator(device=device).manual_seed(1)
    inputs = {"z": torch.randn(VAE_BATCH, model.n_q, model.encoder.z_dim, device=device, generator=g),
              "prior": torch.randn(VAE_BATCH, model.n_p, model.encoder.z_dim, device=device, generator=g)}

    def kl_part(inp):
        z = inp["z"].detach().requires_grad_()
        return torch.autograd.grad(model.estimated_kl(z, inp["prior"]).mean(), z)[0]

    return median_replayed(trainer_step(kl_part, device, True), inputs, device, repeats)


@contextlib.contextmanager
def tf32(enabled: bool):
    """The trainers' --tf32 inside: float32 CUDA matmuls on tensor cores."""
    old = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = enabled
    try:
        yield
    finally:
        torch.backends.cuda.matmul.allow_tf32 = old


def graph_profile(setup, device, rows: int = 20, with_tf32: bool = False) -> str:
    """torch.profiler's table of three replays of a trainer's step captured in a CUDA graph, by GPU
    time: where the replayed step's time goes (the KL's kernels against the networks' and Adam's)."""
    torch.manual_seed(0)
    with tf32(with_tf32):
        step, inputs = setup(True)
        run = trainer_step(step, device, True)
        for _ in range(5):
            run(inputs)

        def replays():
            for _ in range(3):
                run(inputs)
        return gpu_bench.profile_table(replays, rows)


def vae_step(method: str, device):
    """The VAE trainer's step (the paper's batch and sample sizes) and its inputs, for full_steps."""
    def setup(cuda_graph: bool):
        model = paper_vae(method, device)
        g = torch.Generator(device=device).manual_seed(1)
        inputs = {"x": (torch.rand(VAE_BATCH, 784, device=device) < 0.3).float(), **model.draws(VAE_BATCH, g, device)}
        return vae_exp.make_train_step(model, trainer_adam(model.parameters(), 1e-3, device, cuda_graph)), inputs
    return setup


def mnist_bnn(device) -> ClassificationBNN:
    """The paper's MNIST BNN (two hidden layers of MNIST_HIDDEN, KIVI per layer, 10 prior samples)."""
    return ClassificationBNN((784, MNIST_HIDDEN, MNIST_HIDDEN, 10), "kivi", lam=1e-3, clip=1e-8,
                             n_prior=10).to(device)


def mnist_step(device):
    """The MNIST trainer's step (L = 400, 10 samples) and its inputs, for full_steps."""
    def setup(cuda_graph: bool):
        model = mnist_bnn(device)
        inputs = {"x": torch.rand(MNIST_BATCH, 784, device=device),
                  "y": torch.randint(0, 10, (MNIST_BATCH,), device=device)}
        optimizer = trainer_adam(model.parameters(), 1e-3, device, cuda_graph)
        return mnist_exp.make_train_step(model, optimizer, 60000, 10), inputs
    return setup


def mnist_profile(device, repeats: int) -> dict:
    torch.manual_seed(0)
    model = mnist_bnn(device)
    x = torch.rand(MNIST_BATCH, 784, device=device)
    y = torch.randint(0, 10, (MNIST_BATCH,), device=device)
    mnist_exp.step_profile(model, x, y, 60000, 10, repeats=3)
    return mnist_exp.step_profile(model, x, y, 60000, 10, repeats=repeats)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--json", metavar="PATH", help="save the device and the results as JSON")
    ap.add_argument("--profile", action="store_true", help="print the replayed steps' kernels by GPU time")
    args = ap.parse_args(argv)
    info = gpu_bench.device_info("bench/train_steps.py")
    if info is None:
        return 2
    device = torch.device(gpu_bench.DEVICE)
    if args.profile:
        for name, setup in {"vae kivi-ac": vae_step("kivi-ac", device), "mnist L=400": mnist_step(device)}.items():
            print(f"{name}: three replays of the step captured in a CUDA graph\n{graph_profile(setup, device)}",
                  flush=True)
        print("vae kivi-ac, --tf32: three replays of the step captured in a CUDA graph\n"
              f"{graph_profile(vae_step('kivi-ac', device), device, with_tf32=True)}", flush=True)
        return 0
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
        gpu_bench.save_json(args.json, info, rows)  # after each row: a run cut off keeps what it timed
        print(f"{name:18} " + "  ".join(
            f"{k}: step {row[k]['step_seconds'] * 1e3:6.2f} ms, KL {row[k]['kl_seconds'] * 1e3:6.2f} ms "
            f"({100 * row[k]['kl_share']:4.1f}%)" for k in ("generic", "cuda")), flush=True)
    setups = {"vae kivi-ac full step": vae_step("kivi-ac", device), "vae kivi full step": vae_step("kivi", device),
              "mnist L=400 full step": mnist_step(device)}
    for name, setup in setups.items():
        row = {"case": name, **full_steps(setup, device, args.repeats)}
        kl = ""
        if name.startswith("vae"):  # the KL alone, graphed too: its share of the graphed step
            row["kl_graph"] = graphed_vae_kl(name.split()[1], device, args.repeats)
            row["kl_graph_share"] = row["kl_graph"] / row["graph"]
            kl = f"; its KL graphed alone {row['kl_graph'] * 1e3:.2f} ms ({100 * row['kl_graph_share']:.0f}%)"
        rows.append(row)
        gpu_bench.save_json(args.json, info, rows)  # after each row: a run cut off keeps what it timed
        print(f"{row['case']:24} eager {row['eager'] * 1e3:6.2f} ms, CUDA graph {row['graph'] * 1e3:6.2f} ms, "
              f"and with --tf32 {row['graph_tf32'] * 1e3:6.2f} ms{kl}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
