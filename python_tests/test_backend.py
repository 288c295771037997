"""Backend selection and the build: the compiled library is used, can be forced off, and is parallel."""

import os
import subprocess
import sys

import pytest

import kivi_fast
from kivi_fast import _backend


def run_python(code, **env):
    full_env = dict(os.environ, **env)
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=full_env, timeout=120)


def test_compiled_backend_is_in_use():
    assert kivi_fast.backend() == "cpp", "build the ops: pip install --no-build-isolation -e ."


def test_environment_variable_forces_the_reference():
    out = run_python("import kivi_fast; print(kivi_fast.backend())", KIVI_FAST_BACKEND="reference")
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "reference"


def test_bad_environment_variable_is_an_error():
    out = run_python("import kivi_fast; kivi_fast.backend()", KIVI_FAST_BACKEND="fortran")
    assert out.returncode != 0 and "KIVI_FAST_BACKEND" in out.stderr


def test_library_is_built_with_openmp():
    """at::parallel_for runs serially unless the library is compiled with OpenMP."""
    path = _backend._library_path()
    assert path is not None
    if not sys.platform.startswith("linux"):
        pytest.skip("ldd is Linux-only")
    libs = subprocess.run(["ldd", path], capture_output=True, text=True).stdout
    assert "gomp" in libs or "omp" in libs, libs


def test_cuda_tensors_dispatch_to_the_cuda_or_the_generic_kernels():
    """Without a GPU too: CPU tensors go to the CPU kernels; CUDA tensors of kl and kl_grad go to the
    CUDA kernels when torch is a CUDA build (CMakeLists.txt builds csrc/cuda/ then), and every other
    op's (or, with a CPU torch, every op's) to the device-generic (CompositeExplicitAutograd) kernels,
    which test_ops_vs_reference runs on CPU."""
    import torch

    kivi_fast.backend()
    cuda_kernels = {"kl", "kl_grad"} if torch.version.cuda else set()
    for op in ("sqdist", "rbf_gram", "median_bandwidth", "fit", "ratio", "kl", "weighted_grad", "kl_grad"):
        table = torch._C._dispatch_dump_table(f"kivi_fast::{op}")
        entries = dict(line.split(": ", 1) for line in table.splitlines() if ": " in line)
        assert "[kernel]" in entries["CPU"], (op, entries["CPU"])
        expected = "[kernel]" if op in cuda_kernels else "default backend kernel"
        assert expected in entries["CUDA"], (op, entries["CUDA"])


def test_the_cuda_kernels_switches_say_when_the_build_has_no_cuda_kernels():
    """The benches' switches of the CUDA kernels (torch.ops.kivi_fast_testing) raise a clear error in a
    build without them (a CPU torch), instead of setting a flag nothing reads."""
    import torch

    kivi_fast.backend()
    if torch.version.cuda:
        pytest.skip("a CUDA build of torch: the CUDA kernels are built")
    for call in (lambda: torch.ops.kivi_fast_testing.set_two_blocks_per_sm(True),
                 lambda: torch.ops.kivi_fast_testing.set_paired_elimination(True),
                 lambda: torch.ops.kivi_fast_testing.set_forward_stage_clocks(None)):
        with pytest.raises(RuntimeError, match="built without its CUDA kernels"):
            call()
