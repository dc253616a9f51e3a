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


def _anonymous_resident() -> int:
    import ctypes

    ctypes.CDLL("libc.so.6").malloc_trim(0)
    with open("/proc/self/status") as status:
        return next(int(line.split()[1]) * 1024 for line in status if line.startswith("RssAnon:"))


def test_a_workers_bounce_buffer_is_resident_from_its_start_not_from_its_first_unaligned_write(tmp_path):
    """csrc/fileio.cpp: an O_DIRECT write from an address that is not page-aligned goes through the
    worker's 1 MiB bounce buffer. It is populated when the worker starts (the engine starts before a
    budget's baseline is read), so the first such write adds nothing to the process: touched on
    that write instead, the two workers' buffers were 2 MiB of a plan's "held besides" (HF Llama
    8x512), counted against its budget."""
    import os

    from acshim.backends.fileio import aligned_empty
    from acshim.storage.disk import open_private_file

    module = native._loader.load()
    if module is None:
        pytest.skip(f"native extension unavailable: {native.status(load=False).reason}")
    fd, direct = open_private_file(str(tmp_path), True)
    try:
        if not direct:
            pytest.skip(f"{tmp_path} takes no O_DIRECT: no bounce buffer is used")
        engine = native.NativeFileIO(module, threads=1)
        warm = torch.zeros(4096, dtype=torch.uint8)  # the worker has started once a job has run (bytes)
        engine.write(fd, warm, 0, True)
        data = torch.arange(3 * 2**20 + 1, dtype=torch.int32).to(torch.uint8)[1:]  # a byte past: unaligned
        assert data.data_ptr() % 4096 != 0
        before = _anonymous_resident()
        engine.write(fd, data, 4096, True)
        grown = _anonymous_resident() - before
        back = aligned_empty(data.numel())  # a direct read fills an aligned, padded buffer
        engine.read(fd, back, 4096, True)
        assert torch.equal(back[:data.numel()], data)
        assert grown < 512 * 1024, f"the first unaligned O_DIRECT write made the process {grown / 2**20:.2f} MiB larger"
    finally:
        os.close(fd)
