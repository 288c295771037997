"""Runs one of the GPU benches (bench/gpu.py or bench/train_steps.py) on the CPU, with torch.cuda's
calls, the CUDA build's testing switches and CUDA graphs stood in, for test_gpu_benches.py:

    python python_tests/gpu_stand_ins.py gpu --shapes 2x12x3 --dtypes float32 --target-s 0.01
    python python_tests/gpu_stand_ins.py train_steps --repeats 1

The benches' own code (their loops, tables, JSON, compiled sides, A/Bs) then runs as on a GPU; what
only a GPU has (timings, peak memory, stage clocks, graph capture) is faked: a device of two
multiprocessors with no memory in use, stage clocks 100 cycles apart, steps run eagerly, torch.compile
with its eager backend. A separate process, so that nothing here leaks into the other tests.
"""

from __future__ import annotations

import os
import sys
import types

import torch

BENCH = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "bench")
SWITCHES = ("set_paired_elimination", "set_gathered_selection", "set_two_blocks_per_sm", "set_generic_kernels",
            "set_gemm_kernel_values", "set_tile_subblocks", "set_balanced_tile_ranges", "set_paired_weight_dims",
            "set_weight_kernel", "set_product_tile_distances", "set_gemm_pair_distances", "set_force_generic")
OFF_BY_DEFAULT = ("set_gemm_kernel_values", "set_product_tile_distances", "set_gemm_pair_distances",
                  "set_force_generic")


def install() -> dict:
    """The stand-ins; returns {switch: [flags set, in order]} for the caller to report."""
    cuda = {"get_device_name": lambda *a: "stand-in",
            "synchronize": lambda *a: None, "reset_peak_memory_stats": lambda *a: None,
            "memory_allocated": lambda *a: 0, "max_memory_allocated": lambda *a: 0,
            "get_device_properties": lambda *a: types.SimpleNamespace(multi_processor_count=2)}
    for name, fn in cuda.items():
        setattr(torch.cuda, name, fn)
    calls = {name: [] for name in SWITCHES + ("set_forward_stage_clocks",)}

    def switch(name):
        state = {"flag": name not in OFF_BY_DEFAULT}  # the CUDA build's defaults

        def set_flag(flag: bool) -> bool:
            calls[name].append(flag)
            old, state["flag"] = state["flag"], flag
            return old
        return set_flag

    def set_clocks(clocks):
        calls["set_forward_stage_clocks"].append(clocks is not None)
        if clocks is not None:  # as if the forward kernel had read its clock at each stage
            clocks.copy_(torch.arange(clocks.numel()) * 100)

    torch.ops.kivi_fast_testing = types.SimpleNamespace(set_forward_stage_clocks=set_clocks,
                                                        **{name: switch(name) for name in SWITCHES})
    real_compile = torch.compile

    def eager_compile(fn, *, dynamic=None, fullgraph=False, mode=None):
        return real_compile(fn, backend="eager", dynamic=dynamic, fullgraph=fullgraph)
    torch.compile = eager_compile
    return calls


def main(argv: list[str]) -> int:
    script, args = argv[0], argv[1:]
    calls = install()
    sys.path.insert(0, BENCH)
    import gpu

    gpu.DEVICE = "cpu"
    gpu.capture = lambda run: run  # no CUDA graphs on the CPU: a graphed side's replay calls it again
    if script == "gpu":
        rc = gpu.main(args)
    elif script == "train_steps":
        import train_steps
        from kivi_fast.experiments import graphs

        # no CUDA graphs on the CPU: the graphed steps run eagerly, with torch's default Adam
        train_steps.trainer_step = lambda step, device, cuda_graph: graphs.trainer_step(step, device, False)
        train_steps.trainer_adam = lambda params, lr, device, cuda_graph: graphs.trainer_adam(params, lr, device, False)
        train_steps.VAE_BATCH, train_steps.VAE_SAMPLES = 4, 10
        train_steps.MNIST_BATCH, train_steps.MNIST_HIDDEN = 8, 5
        rc = train_steps.main(args)
    else:
        raise SystemExit(f"gpu_stand_ins.py: no bench {script!r} (gpu, train_steps)")
    # each switch set: how often to each value
    print("stand-ins set:", {name: {v: flags.count(v) for v in (True, False)} for name, flags in calls.items() if flags})
    return rc


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
