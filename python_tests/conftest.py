"""Shared fixtures: the implementations under test and hypothesis settings.

``impl`` runs a test on each implementation that users can get: the compiled CPU kernels, the
device-generic kernels (what CUDA tensors run, forced on CPU here) and the pure-PyTorch fallback.
"""

import contextlib
import importlib.util
import os
import re
import sys
from pathlib import Path

# OpenMP threads that wait for work sleep rather than spin: the suite's worker processes (pytest-xdist,
# two on the 2-core CI machine) each run torch's default thread count, so a spinning team takes the
# cores the other worker's threads need. Measured here: test_ops_vs_reference.py and
# test_precision_and_autograd.py took 74 s spinning, 44 s sleeping (53 s with one thread a worker,
# which would also leave the kernels' multi-thread paths to the tests that ask for two threads). Set
# before torch loads libgomp, which reads it once; the workers and the processes that tests start
# inherit it.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import pytest  # noqa: E402
import torch  # noqa: E402
from hypothesis import HealthCheck, settings

# torch.compile's on-disk cache is not keyed on the CPU capability its C++ kernels were generated for:
# after a run of the suite under ATEN_CPU_CAPABILITY=avx2 (torch's kernels as on an AVX2-only machine,
# the other CPU kind CI may draw), a run under the default AVX-512 loaded that run's graphs and failed
# inside them ("index out of bounds", test_bench_sides.py's compiled sides). One cache a capability.
if "TORCHINDUCTOR_CACHE_DIR" not in os.environ:
    try:
        from torch._inductor.runtime.cache_dir_utils import default_cache_dir
    except ImportError:  # (another torch's layout: its default cache)
        pass
    else:
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = \
            f"{default_cache_dir()}-{torch.backends.cpu.get_cpu_capability().lower()}"

# The implementation fixtures only switch a flag and restore it, so sharing them across the
# examples of one test is intended.

import kivi_fast
from kivi_fast import _backend

settings.register_profile(
    "default", max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture], derandomize=True
)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "default"))


def bench_module(name: str):
    """bench/<name>.py, loaded by its path as module bench_<name> (bench/ on sys.path would let its
    scripts shadow other modules; registered, since dynamo finds a traced function's globals by its
    module's name)."""
    key = "bench_" + name
    if key not in sys.modules:
        path = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "bench", name + ".py")
        spec = importlib.util.spec_from_file_location(key, path)
        module = importlib.util.module_from_spec(spec)
        sys.modules[key] = module
        spec.loader.exec_module(module)
    return sys.modules[key]


def has_ops() -> bool:
    return kivi_fast.backend() == "cpp"


@contextlib.contextmanager
def no_host_sync():
    """Any read of a device value by the host raises inside (torch's sync debug mode)."""
    old = torch.cuda.get_sync_debug_mode()
    torch.cuda.set_sync_debug_mode("error")
    try:
        yield
    finally:
        torch.cuda.set_sync_debug_mode(old)


class DeviceOps(torch.utils._python_dispatch.TorchDispatchMode):
    """The ops called inside, by name, less those that would not launch on a device: views and
    allocations (every overload of these ops), and the CPU's value checks (these overloads; on a GPU
    they do not run). On a GPU each op left is a launch. Names are matched exactly: a real reduction
    such as aten.amax is counted."""
    VIEWS_AND_ALLOCATIONS = {"detach", "expand", "unsqueeze", "squeeze", "view", "_unsafe_view", "_reshape_alias",
                             "alias", "as_strided", "select", "slice", "permute", "transpose", "t", "empty",
                             "empty_like", "empty_strided", "new_empty"}
    VALUE_CHECKS = {"aten._local_scalar_dense.default", "aten.any.default", "aten.eq.Scalar", "aten.isnan.default",
                    "aten.max.default"}

    def __init__(self):
        super().__init__()
        self.names = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = str(func)
        if func.overloadpacket.__name__ not in self.VIEWS_AND_ALLOCATIONS and name not in self.VALUE_CHECKS:
            self.names.append(name)
        return func(*args, **(kwargs or {}))


@contextlib.contextmanager
def implementation(name: str):
    """Run kivi_fast's public functions on one implementation: "cpu", "generic" or "reference"."""
    if name in ("cpu", "generic") and not has_ops():
        pytest.fail("the compiled ops are not built (pip install --no-build-isolation -e .)")
    saved = _backend.backend()  # (loaded first: restoring a name never set would leave None behind)
    old_flag = None
    try:
        if name == "reference":
            _backend._state["name"] = "reference"
        elif name == "generic":
            old_flag = torch.ops.kivi_fast_testing.set_force_generic(True)
        yield
    finally:
        if old_flag is not None:
            torch.ops.kivi_fast_testing.set_force_generic(old_flag)
        _backend._state["name"] = saved


IMPLEMENTATIONS = ["cpu", "generic", "reference"]


@pytest.fixture(params=IMPLEMENTATIONS)
def impl(request):
    with implementation(request.param):
        yield request.param


@pytest.fixture(params=["cpu", "generic"])
def compiled(request):
    with implementation(request.param):
        yield request.param


@pytest.fixture(autouse=True)
def _torch_threads_restored():
    """Every test leaves torch's thread count as it found it: the trainers set one thread (runs.begin)
    and tests call them in this process, where the kernels' tests that set no count of their own would
    otherwise run on one thread or two depending on what ran before them in the same worker."""
    threads = torch.get_num_threads()
    yield
    if torch.get_num_threads() != threads:
        torch.set_num_threads(threads)


@pytest.fixture
def one_thread():
    """One torch thread for a training loop of small tensors, as the experiments run (runs.begin):
    with two threads on a busy 2-core machine such a loop spends most of its time waiting. (The count
    is given back after the test by _torch_threads_restored, as after every test.)"""
    torch.set_num_threads(1)
    yield


def assert_last_good_checkpoint(run_dir, error: str) -> None:
    """After a run that diverged with ``error`` (which names the epoch and step), the checkpoint on disk
    holds finite parameters from no later than that step."""
    from kivi_fast.experiments import runs

    state = runs.load_checkpoint(Path(run_dir) / "checkpoint.pt")
    assert all(torch.isfinite(v).all() for v in state["model"].values() if v.is_floating_point())
    failed = tuple(int(v) for v in re.search(r"epoch (\d+), step (\d+)", error).groups())
    assert (state["epoch"], state["step"]) <= failed, (state["epoch"], state["step"], error)
