"""Backend selection and the build: the compiled library is used, can be forced off, and is parallel."""

import os
import shutil
import subprocess
import sys

import pytest
import torch

import kivi_fast
from kivi_fast import _backend

from conftest import bench_module


def run_python(code, **env):
    full_env = dict(os.environ, **env)
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=full_env, timeout=120)


def test_compiled_backend_is_in_use():
    assert kivi_fast.backend() == "cpp", "build the ops: pip install --no-build-isolation -e ."


def test_environment_variable_forces_the_reference():
    out = run_python("import kivi_fast; print(kivi_fast.backend())", KIVI_FAST_BACKEND="reference")
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "reference"


@pytest.mark.parametrize("backend", ["cpp", "reference"])
def test_a_compiled_call_can_be_the_first_call(backend):
    """torch.compile(fullgraph=True) as a process's first use: the backend is then chosen while dynamo
    traces (it used to fail there, on the library's file search). Same value and gradient as eager.
    (The reference reads the samples' values in its checks: graph breaks, so not fullgraph there.)"""
    code = f"""
import torch, kivi_fast
p, q = torch.randn(30, 3, dtype=torch.float64), torch.randn(30, 3, dtype=torch.float64, requires_grad=True)
f = torch.compile(lambda a, b: kivi_fast.kernel_kl(a, b), fullgraph={backend == "cpp"}, backend="eager")
value = f(p, q); (grad,) = torch.autograd.grad(value, q)
eager = kivi_fast.kernel_kl(p, q); (eager_grad,) = torch.autograd.grad(eager, q)
torch.testing.assert_close(value, eager); torch.testing.assert_close(grad, eager_grad)
print(kivi_fast.backend())
"""
    out = run_python(code, KIVI_FAST_BACKEND=backend)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.strip() == backend


def test_the_constant_mark_is_torchs_own():
    """_backend.constant_under_compile marks a function as torch.compiler.assume_constant_result does
    (the test above shows dynamo honours it on the backend's choice)."""
    def ours():
        pass

    def torchs():
        pass

    _backend.constant_under_compile(ours)
    torch.compiler.assume_constant_result(torchs)
    assert vars(ours) == vars(torchs) and vars(ours)


def test_importing_and_calling_leaves_dynamo_unimported():
    """torch._dynamo takes ~1 s to import: the library, the CLI and a first call of each estimator on
    the CPU do not import it (the CLI's start-up is then torch's own)."""
    code = """
import sys, torch, kivi_fast, kivi_fast.cli
p, q = torch.randn(30, 3), torch.randn(30, 3, requires_grad=True)
(kivi_fast.kl(p, q) + kivi_fast.kernel_kl(p, q) + kivi_fast.adaptive_contrast_kl(q)).backward()
print(kivi_fast.backend(), "torch._dynamo" in sys.modules)
"""
    out = run_python(code)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.split() == ["cpp", "False"]


def test_bad_environment_variable_is_an_error():
    out = run_python("import kivi_fast; kivi_fast.backend()", KIVI_FAST_BACKEND="fortran")
    assert out.returncode != 0 and "KIVI_FAST_BACKEND" in out.stderr


def test_library_is_built_with_openmp():
    """at::parallel_for (inlined from torch's headers) runs serially unless our library is compiled with
    OpenMP: then the library itself calls the OpenMP runtime's fork (GCC's GOMP_parallel, LLVM's
    __kmpc_fork_call). Its own undefined symbols, not ldd's list, which holds libtorch's libgomp too."""
    path = _backend._library_path()
    assert path is not None
    if not sys.platform.startswith("linux") or shutil.which("nm") is None:
        pytest.skip("reads the library's dynamic symbols with binutils' nm (Linux)")
    symbols = subprocess.run(["nm", "-D", "--undefined-only", path], capture_output=True, text=True,
                             check=True).stdout
    assert "GOMP_parallel" in symbols or "__kmpc_fork_call" in symbols, symbols[:2000]


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
                 lambda: torch.ops.kivi_fast_testing.set_gathered_selection(True),
                 lambda: torch.ops.kivi_fast_testing.set_gemm_kernel_values(True),
                 lambda: torch.ops.kivi_fast_testing.set_generic_kernels(True),
                 lambda: torch.ops.kivi_fast_testing.set_tile_subblocks(True),
                 lambda: torch.ops.kivi_fast_testing.set_balanced_tile_ranges(True),
                 lambda: torch.ops.kivi_fast_testing.set_product_tile_distances(True),
                 lambda: torch.ops.kivi_fast_testing.set_gemm_pair_distances(True),
                 lambda: torch.ops.kivi_fast_testing.set_paired_weight_dims(True),
                 lambda: torch.ops.kivi_fast_testing.set_weight_kernel(True),
                 lambda: torch.ops.kivi_fast_testing.set_forward_stage_clocks(None)):
        with pytest.raises(RuntimeError, match="built without its CUDA kernels"):
            call()


def configure_as_if_torch_were_cuda(tmp_path, torch_cuda: str, env: dict) -> str:
    """CMakeLists.txt's configure (no build) with torch's CUDA version given (KIVI_FAST_TEST_TORCH_CUDA)
    on this machine's CPU torch: its output, with CMake's line wrapping undone."""
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    run = subprocess.run(["cmake", "-S", str(root), "-B", str(tmp_path / "build"), f"-DPython_EXECUTABLE={sys.executable}",
                          f"-DKIVI_FAST_TEST_TORCH_CUDA={torch_cuda}", "-DKIVI_FAST_CUDA_EMULATION=OFF",
                          "-DCMAKE_CUDA_ARCHITECTURES=90"],
                         capture_output=True, text=True, env={**os.environ, **env}, timeout=300)
    assert run.returncode != 0  # (each test's configure stops at the check it is for)
    return " ".join((run.stdout + run.stderr).split())


@pytest.mark.skipif(shutil.which("cmake") is None, reason="no cmake on this machine")
def test_a_cuda_torch_without_a_cuda_compiler_stops_the_build_saying_what_to_do(tmp_path):
    out = configure_as_if_torch_were_cuda(tmp_path, "13.0", {"CUDACXX": str(tmp_path / "no" / "nvcc")})
    assert "torch is a CUDA 13.0 build, but no working CUDA compiler (nvcc) was found" in out, out[-3000:]
    assert "Install a CUDA 13.x toolkit" in out and "-Ccmake.define.KIVI_FAST_CUDA=OFF" in out, out[-3000:]


@pytest.mark.skipif(shutil.which("cmake") is None or shutil.which("nvcc") is None, reason="no cmake or no nvcc")
def test_a_cuda_compiler_of_another_major_version_than_torchs_stops_the_build(tmp_path):
    import re

    version = re.search(r"release (\d+)\.", subprocess.run(["nvcc", "--version"], capture_output=True,
                                                            text=True).stdout)
    other = int(version.group(1)) - 1
    out = configure_as_if_torch_were_cuda(tmp_path, f"{other}.4", {"CUDACXX": shutil.which("nvcc")})
    assert f"torch is a CUDA {other}.4 build, but the CUDA compiler" in out, out[-3000:]
    assert f"nvcc of a CUDA {other}.x toolkit" in out and "-Ccmake.define.KIVI_FAST_CUDA=OFF" in out, out[-3000:]


@pytest.mark.skipif(shutil.which("nvcc") is None or shutil.which("c++filt") is None,
                    reason="no nvcc, or no c++filt, on this machine")
def test_the_cuda_sources_compile_with_nvcc(tmp_path):
    """csrc/cuda/'s .cu files through nvcc's front end (host and device code to C++; no GPU needed),
    against this torch's headers and with CMakeLists.txt's CUDA flags (bench/sass.py's, with the
    header a CPU wheel of torch lacks stubbed): a change that the CPU emulation (g++) accepts must
    build with CUDA too."""
    from pathlib import Path

    sass = bench_module("sass")
    root = Path(__file__).resolve().parents[1]
    flags = sass.nvcc_flags(sass.write_stub_include(tmp_path / "include"))
    sources = sorted((root / "csrc" / "cuda").glob("*.cu"))
    assert [s.name for s in sources] == ["contrast.cu", "kl.cu", "median.cu"]
    runs = [subprocess.Popen(["nvcc", *flags, "--resource-usage", "-cuda", str(s), "-o", str(tmp_path / (s.stem + ".ii"))],
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for s in sources]
    kernels = set()
    for source, run in zip(sources, runs):
        out = run.communicate(timeout=600)[0]
        assert run.returncode == 0, f"{source.name}:\n{out[-4000:]}"
        assert "warning" not in out.lower(), f"{source.name}:\n{out[-4000:]}"
        usage = sass.parse_ptxas(out)
        assert all(u["registers"] > 0 for u in usage.values()), usage
        kernels |= {sass.short_name(k) for k in usage}
    # bench/sass.py reads ptxas's report of each kernel (both variants of the forward kernel)
    assert {"kl_forward_kernel<float, 1>", "kl_forward_kernel<double, 2>", "standardize_kernel<float>",
            "digit_histogram_kernel"} <= kernels, kernels


@pytest.mark.skipif(shutil.which("g++") is None, reason="no g++ on this machine")
def test_the_cpp_sources_compile_as_in_a_cuda_build():
    """The branches of csrc/*.cpp that only a CUDA build compiles (KIVI_FAST_WITH_CUDA: generic.cpp's
    calls into cuda::, ops.cpp's CUDA registrations) through g++'s front end with that macro set, so
    that CI (a CPU build) checks them too; no CUDA headers are needed, kivi.h declares cuda::."""
    from pathlib import Path

    import torch

    root = Path(__file__).resolve().parents[1]
    torch_include = Path(torch.__file__).parent / "include"
    flags = ["-std=gnu++20", "-fsyntax-only", "-Wall", "-Wextra", "-Wno-unused-parameter", "-DKIVI_FAST_WITH_CUDA",
             f"-D_GLIBCXX_USE_CXX11_ABI={int(torch._C._GLIBCXX_USE_CXX11_ABI)}", "-isystem", str(torch_include),
             "-isystem", str(torch_include / "torch" / "csrc" / "api" / "include"), "-I", str(root / "csrc")]
    sources = [root / "csrc" / name for name in ("generic.cpp", "ops.cpp")]
    for source in sources:  # the branches themselves: a rename would leave this test checking nothing
        assert "KIVI_FAST_WITH_CUDA" in source.read_text(), source.name
    runs = [subprocess.Popen(["g++", *flags, str(s)], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
            for s in sources]
    for source, run in zip(sources, runs):
        out = run.communicate(timeout=600)[0]
        assert run.returncode == 0 and "warning" not in out.lower(), f"{source.name}:\n{out[-4000:]}"
