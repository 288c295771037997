"""bench/gpu_tables.py, which turns a GPU run's JSON into the GPU section's tables: each side at its
strongest (eager, compiled or graphed), ours included, from the run that timed it, on made-up rows."""

import json
import os
import subprocess
import sys

BENCH = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "bench")


def row(shape, ours, strong, fast, **extra):
    out = {"shape": shape, "dtype": "float32", "pass": "fwd+bwd", "ours_s": ours, "strong_s": strong,
           "fast_s": fast, "strong_ratio": strong / ours, "fast_ratio": fast / ours}
    out.update(extra)
    return out


def tables(tmp_path, files: dict) -> dict:
    """{shape: {column: cell}} of the bench table that gpu_tables.py prints (markdown) for these files."""
    for name, rows in files.items():
        (tmp_path / name).write_text(json.dumps({"device": {"gpu": "made up"}, "rows": rows}))
    run = subprocess.run([sys.executable, os.path.join(BENCH, "gpu_tables.py"), str(tmp_path), "--markdown"],
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr
    lines = [line for line in run.stdout.splitlines() if line.startswith("| ")]
    head = [c.strip() for c in lines[0].strip("|").split("|")]
    cells = [[c.strip() for c in line.strip("|").split("|")] for line in lines[1:]]
    return {c[0]: dict(zip(head, c)) for c in cells if c[0].startswith("(")}


def test_each_pure_side_at_its_strongest_from_the_run_that_timed_it(tmp_path):
    bench = [row("(1000, 32)", 1e-3, 4e-3, 3e-3, ours_mb=8.0, strong_mb=30.0, fast_mb=20.0),
             row("(5000, 64)", 7e-3, 12e-3, 9e-3, ours_mb=380.0, strong_mb=800.0, fast_mb=510.0)]
    # the compiled phase's own runs: at (1000, 32) strong compiled beats strong eager and fast compiled
    # loses; (2000, 32) only there, its fast compiled left out. The ratios are the benches' medians of
    # each round's ratio, which need not be the ratios of the medians.
    compiled = [row("(1000, 32)", 1.1e-3, 4.4e-3, 3.3e-3, strong_compiled_s=2.2e-3, strong_compiled_ratio=1.9,
                    fast_compiled_s=5.5e-3, fast_compiled_ratio=5.1, ours_compiled_s=1.0e-3, ours_compiled_ratio=0.9,
                    strong_compiled_vs_ours_compiled=2.1, fast_compiled_vs_ours_compiled=5.4),
                row("(2000, 32)", 2e-3, 7e-3, 5e-3, strong_compiled_s=8e-3, strong_compiled_ratio=4.1,
                    ours_compiled_s=1.9e-3, strong_compiled_vs_ours_compiled=4.2,
                    ours_mb=33.0, strong_mb=110.0, fast_mb=61.0)]
    compiled[1]["strong_ratio"] = 3.6  # (a median of ratios, not 7 / 2)
    t = tables(tmp_path, {"cuda_results.json": bench, "cuda_compiled.json": compiled})
    small, mid, large = t["(1000, 32)"], t["(2000, 32)"], t["(5000, 64)"]
    assert small["timed in"] == mid["timed in"] == "compiled phase" and large["timed in"] == "bench phase"
    # ours at its best too: compiled here, from the compiled run, not the bench phase's eager 1.0
    assert small["ours at its best"] == "1 (compiled)" and small["strong at its best"] == "2.2 (compiled)"
    assert small["strong/ours"] == "2.10"  # both compiled: the bench's own like-for-like ratio
    assert small["fast at its best"] == "3.3" and small["fast/ours"] == "3.30"  # eager over compiled: 3.3 / 1.0
    assert small["eager"] == "4.00 / 3.00" and small["compiled"] == "2.10 / 5.40"
    assert small["peak MB ours / strong / fast"] == "8.0 / 30.0 / 20.0"  # the bench phase's
    assert mid["strong at its best"] == "7" and mid["strong/ours"] == f"{7 / 1.9:.2f}"
    assert mid["eager"] == "3.60 / 2.50" and mid["compiled"] == "4.20 / -"
    assert mid["peak MB ours / strong / fast"] == "33.0 / 110.0 / 61.0"
    assert large["ours at its best"] == "7" and large["strong/ours"] == "1.71"
    assert large["fast/ours"] == "1.29" and large["compiled"] == "-"


def test_a_graphed_best_takes_the_graphed_ratio():
    """Where ours and a pure side are both at their best graphed, the ratio is the bench's own
    graphed-against-graphed one; where they are at their best different ways, the ratio of the medians."""
    sys.path.insert(0, BENCH)
    try:
        import gpu_tables
    finally:
        sys.path.remove(BENCH)
    r = row("(100, 8)", 0.5, 2.0, 3.0, ours_compiled_s=0.9, strong_compiled_s=0.3, fast_compiled_s=1.0,
            ours_graphed_s=0.2, strong_graphed_s=0.6, fast_graphed_s=0.5, strong_graphed_vs_ours_graphed=3.05,
            fast_graphed_vs_ours_graphed=2.45)
    assert gpu_tables.strongest(r, "ours") == ("graphed", 0.2)
    assert gpu_tables.best_ratio(r, "fast") == 2.45
    assert gpu_tables.best_ratio(r, "strong") == 0.3 / 0.2  # strong compiled, ours graphed


def test_files_from_different_gpus_are_refused(tmp_path):
    for name, gpu in (("cuda_results.json", "NVIDIA H100"), ("cuda_compiled.json", "NVIDIA H200")):
        (tmp_path / name).write_text(json.dumps({"device": {"gpu": gpu}, "rows": [row("(100, 8)", 1e-3, 2e-3, 2e-3)]}))
    run = subprocess.run([sys.executable, os.path.join(BENCH, "gpu_tables.py"), str(tmp_path)],
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 2 and "different GPUs" in run.stderr


def test_bad_arguments_of_the_bench_scripts_end_in_one_line(tmp_path):
    """A shape or dtype that is not one, or a run file that is not one: an error naming it, before any
    timing (--dtypes float16 ran the self-check and the machine's rates first, then a traceback a shape)."""
    not_json = tmp_path / "run.json"
    not_json.write_text("not json")
    cases = [(["run.py", "--shapes", "100x8,garbage"], "argument --shapes: a shape is NxD or BxNxD"),
             (["run.py", "--dtypes", "float16"], "argument --dtypes: expected comma-separated dtypes"),
             (["gpu.py", "--shapes", "0x8"], "argument --shapes: a shape is NxD or BxNxD, of positive"),
             (["spread.py", str(tmp_path / "missing.json")], "missing.json: not a JSON file of bench/run.py"),
             (["bounds.py", str(not_json)], "run.json: not a JSON file of bench/run.py")]
    for argv, message in cases:
        run = subprocess.run([sys.executable, os.path.join(BENCH, argv[0]), *argv[1:]], capture_output=True,
                             text=True, timeout=300)
        assert run.returncode != 0 and message in run.stderr and "Traceback" not in run.stderr, (argv, run.stderr)
