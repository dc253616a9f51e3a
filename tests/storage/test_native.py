"""The native extension: built once and cached, reported by status(), and a missing compiler
falls back to the Python path with exactly one warning (results identical: see test_disk.py)."""

from __future__ import annotations

import warnings

import pytest
import torch

from acshim.backends.fileio import PythonFileIO
from acshim.storage import native


def test_status_reports_native_path_when_the_extension_builds():
    status = native.status()
    assert status.path == "native", status  # this machine has a compiler; CI too
    assert "loaded" in status.reason and status.build_directory
    assert isinstance(native.file_io(), native.NativeFileIO)
    assert native.build(verbose=False).path == "native"  # `acshim build-ext`: cached, no rebuild


def test_environment_variable_forces_the_python_path(monkeypatch):
    monkeypatch.setenv(native.ENVIRONMENT_VARIABLE, "0")
    assert isinstance(native.file_io(), PythonFileIO)
    status = native.status()
    assert status.path == "python" and native.ENVIRONMENT_VARIABLE in status.reason


def test_missing_compiler_falls_back_with_one_warning(monkeypatch):
    import torch.utils.cpp_extension as cpp_extension

    def no_compiler(*args, **kwargs):
        raise OSError("g++: command not found")

    monkeypatch.setattr(cpp_extension, "load", no_compiler)
    monkeypatch.setattr(native, "_loader", native._Loader())
    monkeypatch.delenv(native.ENVIRONMENT_VARIABLE, raising=False)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        engines = [native.file_io() for _ in range(3)]
    assert all(isinstance(engine, PythonFileIO) for engine in engines)
    assert len([w for w in caught if "Python path" in str(w.message)]) == 1
    status = native.status(load=False)
    assert status.path == "python" and "command not found" in status.reason
    with pytest.raises(RuntimeError, match="did not build"):
        native.build(verbose=False)
    with pytest.raises(RuntimeError, match="native=True"):
        native.file_io(True)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only machine (GPU: pytest -m cuda)")
def test_cuda_pack_kernels_are_not_built_without_cuda():
    assert not torch.cuda.is_available()
    assert native.pack_module() is None
    assert native.status().cuda_pack.startswith("not built")


def test_a_baton_left_by_a_killed_build_does_not_hang_the_next_process(tmp_path):
    """torch waits with no time limit on ``<build dir>/lock``, which only a live builder removes; a
    build killed mid-compile left it and every later first use of the disk tier hung (seen in CI,
    where a timed-out run killed a build). A fresh process must clear it and load."""
    import fcntl
    import os
    import subprocess
    import sys

    directory = native.build_directory()
    os.makedirs(directory, exist_ok=True)
    baton = os.path.join(directory, native.TORCH_BATON)
    guard = os.open(os.path.join(directory, native.BUILD_LOCK), os.O_RDWR | os.O_CREAT, 0o600)
    try:  # plant the baton while no acshim process can be building (as a killed builder leaves it)
        fcntl.flock(guard, fcntl.LOCK_EX)
        open(baton, "w").close()
    finally:
        os.close(guard)
    done = subprocess.run([sys.executable, "-c", "from acshim.storage import native; print(native.build(False).path)"],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and done.stdout.strip() == "native", done.stderr[-2000:]
    guard = os.open(os.path.join(directory, native.BUILD_LOCK), os.O_RDWR)
    try:  # torch takes the baton on every load, built or not: look while no acshim process can be loading
        fcntl.flock(guard, fcntl.LOCK_EX)
        assert not os.path.exists(baton)
    finally:
        os.close(guard)
