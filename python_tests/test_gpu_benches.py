"""bench/gpu.py and bench/train_steps.py, the benches of scripts/gpu_check.sh, run through on the CPU
(python_tests/gpu_stand_ins.py stands in for torch.cuda, the CUDA build's switches and CUDA graphs):
each of gpu_check.sh's bench commands completes, writes the JSON that bench/gpu_tables.py turns into
the GPU section's tables, and the profile sets each A/B switch both ways. Their numbers here mean
nothing; what is checked is that a lease's minutes are not spent on a script's own errors."""

import ast
import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
STAND_INS = os.path.join(ROOT, "python_tests", "gpu_stand_ins.py")
FAST = ["--dtypes", "float32", "--target-s", "0.01"]


def stand_in(*args) -> str:
    run = subprocess.run([sys.executable, STAND_INS, *map(str, args)], capture_output=True, text=True,
                         timeout=600, cwd=ROOT)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    return run.stdout


def switches_set(output: str) -> dict:
    """{switch: {True: times set, False: times set}} from the stand-ins' last line."""
    line = [ln for ln in output.splitlines() if ln.startswith("stand-ins set: ")][-1]
    return ast.literal_eval(line[len("stand-ins set: "):])


def rows(path) -> list:
    with open(path) as f:
        data = json.load(f)
    assert data["device"]["gpu"] == "stand-in"
    return data["rows"]


def test_bench_compiled_and_steps_write_what_gpu_tables_reads(tmp_path):
    stand_in("gpu", *FAST, "--shapes", "3x12x3,30x4", "--json", tmp_path / "cuda_results.json")
    stand_in("gpu", *FAST, "--compiled", "--compile-mode", "reduce-overhead", "--graphed", "--passes", "fwd+bwd",
             "--shapes", "3x12x3", "--json", tmp_path / "cuda_compiled.json")
    stand_in("train_steps", "--repeats", "1", "--json", tmp_path / "train_steps.json")

    bench = rows(tmp_path / "cuda_results.json")
    assert [(r["shape"], r["pass"]) for r in bench] == [("3x(12, 3)", "fwd"), ("3x(12, 3)", "fwd+bwd"),
                                                        ("(30, 4)", "fwd"), ("(30, 4)", "fwd+bwd")]
    assert all(r[k] > 0 for r in bench for k in ("ours_s", "strong_s", "fast_s", "strong_ratio", "fast_ratio"))
    (compiled,) = rows(tmp_path / "cuda_compiled.json")
    for side in ("strong", "fast"):  # every compiled and graphed side ran, beside ours run the same way
        for way in ("compiled", "graphed"):
            assert compiled[f"{side}_{way}_s"] > 0 and compiled[f"{side}_{way}_vs_ours_{way}"] > 0
    steps = {r["case"]: r for r in rows(tmp_path / "train_steps.json")}
    for case in ("vae kivi-ac", "vae kivi", "mnist kivi L=400"):
        assert all(steps[case][k]["step_seconds"] > 0 for k in ("generic", "cuda"))
    for case in ("vae kivi-ac full step", "vae kivi full step", "mnist L=400 full step"):
        assert all(steps[case][k] > 0 for k in ("eager", "graph", "graph_tf32"))
    assert 0 < steps["vae kivi-ac full step"]["kl_graph_share"]

    tables = subprocess.run([sys.executable, os.path.join(ROOT, "bench", "gpu_tables.py"), str(tmp_path),
                             "--markdown"], capture_output=True, text=True, timeout=300)
    assert tables.returncode == 0, tables.stderr
    assert "| 3x(12, 3) | float32 | fwd+bwd | compiled phase |" in tables.stdout
    assert "| (30, 4) | float32 | fwd+bwd | bench phase |" in tables.stdout
    assert "| vae kivi-ac full step |" in tables.stdout


def test_the_profile_times_each_switch_both_ways_and_reads_the_stage_clocks():
    # 3 x (12, 3): a batch of more than one wave on the stand-in's two multiprocessors;
    # (300, 3): more than 512 points, the generic path (its tiled distances); (20, 50): the weight state;
    # (40, 100): the fused wide path's tiled distances, and with d >= N its distances by cuBLAS
    out = stand_in("gpu", *FAST, "--profile", "--shapes", "3x12x3,300x3,20x50,40x100")
    switches = switches_set(out)
    for name in ("set_paired_elimination", "set_gathered_selection", "set_two_blocks_per_sm", "set_generic_kernels",
                 "set_gemm_kernel_values", "set_tile_subblocks", "set_balanced_tile_ranges", "set_paired_weight_dims",
                 "set_weight_kernel", "set_product_tile_distances", "set_gemm_pair_distances"):
        assert switches[name][True] > 0 and switches[name][False] > 0, (name, switches)
    # on, then off, for the default kernel and each switch's other variant (the stand-in fills the
    # clocks on the generic path too)
    clocks = switches["set_forward_stage_clocks"]
    assert clocks[True] == clocks[False] >= 3
    assert out.count("kl_forward_kernel, block 0: 500 cycles: distances 100 (20%)") == clocks[True]
    for line in ("set_paired_elimination: on", "set_gathered_selection: on", "set_two_blocks_per_sm: on",
                 "set_generic_kernels: on", "set_gemm_kernel_values: on", "set_tile_subblocks: on",
                 "set_balanced_tile_ranges: on", "set_paired_weight_dims: on", "set_weight_kernel: on",
                 "set_product_tile_distances: on", "set_gemm_pair_distances: on",
                 "(one column a step)", "(the median a pass for every digit)",
                 "floors: ours fwd+bwd at 1 x (3, 2)", "torch's fwd+bwd of q * 2 there", "host: "):
        assert line in out, line
    steps = stand_in("train_steps", "--profile")
    assert steps.count("three replays of the step captured in a CUDA graph") == 3
