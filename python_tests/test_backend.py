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
