"""The native extension: build it, load it, or fall back to Python, and say which path is in use.

``csrc/fileio.cpp`` (the disk tier's async file-I/O engine: thread pool, ``O_DIRECT``, GIL released)
is compiled on first use with ``torch.utils.cpp_extension.load`` into torch's extension cache
(``$TORCH_EXTENSIONS_DIR``, default ``~/.cache/torch_extensions``), so a machine builds it once;
``acshim build-ext`` (``build()``) compiles it ahead of time. ``csrc/pack.cu`` (packing many small
CUDA tensors into one transfer) is built only where CUDA is present. Without a working compiler the
Python path (``acshim.backends.fileio.PythonFileIO``) is used, with one warning and identical bytes.

``ACSHIM_NATIVE=0`` forces the Python path (tests run both); ``ACSHIM_NATIVE=1`` makes a failed
build an error instead of a fallback.

The extension's name carries a hash of its sources: torch's cache is keyed by name, and two acshim
versions (or checkouts) sharing one cache under one name rebuilt it in turn, each process loading
whichever build was there, an engine that could be another version's.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import os
import threading
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from importlib import resources
from types import ModuleType
from typing import Any

import torch

from ..backends.fileio import PythonFileIO

ENVIRONMENT_VARIABLE = "ACSHIM_NATIVE"
FILEIO_SOURCES = ("fileio.cpp",)
PACK_SOURCES = ("pack.cpp", "pack.cu")
IO_THREADS = 2


@dataclass(frozen=True)
class NativeStatus:
    """Which I/O path the disk tier uses and why (shown by ``acshim doctor``)."""

    path: str
    """``"native"`` or ``"python"``."""
    reason: str
    build_directory: str
    cuda_pack: str
    """``"native"``, ``"python"`` (CUDA present, build failed) or ``"not built: ..."``."""

    def __str__(self) -> str:
        return (f"disk I/O path: {self.path} ({self.reason}); extension cache: {self.build_directory}; "
                f"CUDA pack kernels: {self.cuda_pack}")


class NativeFileIO:
    """The native engine behind ``PythonFileIO``'s interface (blocking calls, GIL released)."""

    name = "native"

    def __init__(self, module: ModuleType, threads: int = IO_THREADS) -> None:
        self._engine = module.Engine(threads)

    def _run(self, write: bool, fd: int, tensor: torch.Tensor, offset: int, direct: bool) -> None:
        error = self._engine.submit(write, fd, tensor.data_ptr(), tensor.numel(), offset, direct).wait()
        if error:
            raise OSError(error, os.strerror(error))

    def write(self, fd: int, data: torch.Tensor, offset: int, direct: bool) -> None:
        self._run(True, fd, data, offset, direct)

    def read(self, fd: int, out: torch.Tensor, offset: int, direct: bool) -> None:
        self._run(False, fd, out, offset, direct)


class _Loader:
    """Process state of the extension: loaded once, on first use, under a lock."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.attempted = False
        self.module: ModuleType | None = None
        self.reason = "not loaded yet"
        self.warned = False
        self.io: NativeFileIO | None = None

    def load(self, verbose: bool = False) -> ModuleType | None:
        with self.lock:
            if self.attempted and not verbose:
                return self.module
            self.attempted = True
            try:
                from torch.utils.cpp_extension import load

                with _one_builder(build_directory()):
                    self.module = load(name=FILEIO_EXTENSION, sources=[_source(name) for name in FILEIO_SOURCES],
                                       extra_cflags=["-O2", "-std=c++17"], verbose=verbose)
                self.reason = f"compiled extension {FILEIO_EXTENSION} loaded"
            except Exception as error:  # any compiler/toolchain failure means: use the Python path
                self.module = None
                self.reason = f"build failed: {type(error).__name__}: {str(error).strip().splitlines()[-1:]}"
                if os.environ.get(ENVIRONMENT_VARIABLE) == "1":
                    raise RuntimeError(f"{ENVIRONMENT_VARIABLE}=1 but the native extension did not build: "
                                       f"{self.reason}") from error
                if not self.warned:
                    self.warned = True
                    warnings.warn(f"acshim: native disk I/O extension unavailable ({self.reason}); using the "
                                  "Python path (same results, holds the GIL a little more). Run `acshim doctor` "
                                  "for details.", RuntimeWarning, stacklevel=3)
            return self.module


_loader = _Loader()


def _extension_name(stem: str, sources: tuple[str, ...]) -> str:
    """``stem`` and the first 12 hex digits of the sources' SHA-256 (see the module docstring)."""
    digest = hashlib.sha256()
    for name in sources:
        digest.update(resources.files("acshim._csrc").joinpath(name).read_bytes())
    return f"{stem}_{digest.hexdigest()[:12]}"


FILEIO_EXTENSION = _extension_name("acshim_fileio", FILEIO_SOURCES)
PACK_EXTENSION = _extension_name("acshim_pack", PACK_SOURCES)


def _after_fork_in_child() -> None:
    _loader.lock = threading.Lock()  # another thread may have held it at the fork; the engine restarts
    # its own threads on its first use in the child (csrc/fileio.cpp)


os.register_at_fork(after_in_child=_after_fork_in_child)


BUILD_LOCK = "acshim-build.flock"
TORCH_BATON = "lock"


@contextlib.contextmanager
def _one_builder(directory: str) -> Iterator[None]:
    """Let one process at a time into torch's ``load`` for ``directory``, and clear a stale baton.

    torch serialises builds with a baton file (``<build dir>/lock``, ``torch.utils.file_baton``)
    that only its holder removes, and waits on it with no time limit: a process killed while
    compiling (SIGKILL, an out-of-memory kill, a CI timeout) leaves it behind, and every later
    first use of the disk tier then hangs forever. Every acshim process takes this ``flock`` before
    ``load``, and the kernel drops a ``flock`` when its holder dies, so a baton found while holding
    it was left by a dead process and is removed. (Hand-written: torch's baton has no owner to
    check and no timeout to set.)
    """
    os.makedirs(directory, exist_ok=True)
    descriptor = os.open(os.path.join(directory, BUILD_LOCK), os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(descriptor, fcntl.LOCK_EX)
        with contextlib.suppress(FileNotFoundError):
            os.remove(os.path.join(directory, TORCH_BATON))
        yield
    finally:
        os.close(descriptor)  # closing drops the flock


def _source(name: str) -> str:
    return str(resources.files("acshim._csrc").joinpath(name))


def _forced_python() -> bool:
    return os.environ.get(ENVIRONMENT_VARIABLE, "").lower() in ("0", "off", "false", "python")


def build_directory() -> str:
    """Where torch caches compiled extensions (``$TORCH_EXTENSIONS_DIR`` if set)."""
    from torch.utils.cpp_extension import _get_build_directory

    return _get_build_directory(FILEIO_EXTENSION, verbose=False)


def file_io(native: bool | None = None) -> Any:
    """The I/O engine the disk tier uses: native unless ``native=False``, ``ACSHIM_NATIVE=0``, or the
    build failed (then ``PythonFileIO``, after one warning)."""
    if native is False or (native is None and _forced_python()):
        return PythonFileIO()
    module = _loader.load()
    if module is None:
        if native is True:
            raise RuntimeError(f"native=True but the native extension is unavailable: {_loader.reason}")
        return PythonFileIO()
    with _loader.lock:
        if _loader.io is None:
            _loader.io = NativeFileIO(module)
        return _loader.io


def _cuda_pack_state(load: bool = True) -> str:
    if not torch.cuda.is_available():
        return "not built: no CUDA device"
    if not load and not _pack:
        return "not built yet (acshim build-ext builds it)"
    from torch.utils.cpp_extension import CUDA_HOME

    if CUDA_HOME is None:
        return "python: CUDA_HOME not found"
    return "native" if pack_module() is not None else "python: build failed"


_pack: list[ModuleType | None] = []


def pack_module() -> ModuleType | None:
    """The compiled CUDA pack kernels (``gather``/``scatter``), or None off CUDA or if the build
    failed; callers then use ``torch.cat`` of byte views, which gives the same bytes."""
    if not _pack:
        module = None
        if torch.cuda.is_available():
            try:
                from torch.utils.cpp_extension import _get_build_directory, load

                with _one_builder(_get_build_directory(PACK_EXTENSION, verbose=False)):
                    module = load(name=PACK_EXTENSION, sources=[_source(name) for name in PACK_SOURCES],
                                  extra_cuda_cflags=["-O2"])
            except Exception as error:  # fall back to torch ops, same bytes
                warnings.warn(f"acshim: CUDA pack kernels unavailable ({error}); using torch ops", RuntimeWarning,
                              stacklevel=2)
        _pack.append(module)
    return _pack[0]


def compile_extension(stem: str, sources: tuple[str, ...], verbose: bool = False) -> ModuleType:
    """Compile ``sources`` (files of ``csrc/``) into torch's extension cache, named ``stem`` and the
    sources' hash, one process at a time, and load it; raises where the toolchain fails."""
    from torch.utils.cpp_extension import _get_build_directory, load

    name = _extension_name(stem, sources)
    with _one_builder(_get_build_directory(name, verbose=False)):
        return load(name=name, sources=[_source(source) for source in sources], extra_cflags=["-O2", "-std=c++17"],
                    verbose=verbose)


def _built() -> bool:
    directory = build_directory()
    return os.path.isdir(directory) and any(name.endswith(".so") for name in os.listdir(directory))


def status(load: bool = True) -> NativeStatus:
    """Which path the disk tier uses and why. ``load=False`` compiles nothing: it loads the cached
    build if there is one, else reports that the first disk-tier use (or ``acshim build-ext``) builds it."""
    if _forced_python():
        path, reason = "python", f"forced by {ENVIRONMENT_VARIABLE}={os.environ[ENVIRONMENT_VARIABLE]}"
    elif not load and not _loader.attempted and not _built():
        path, reason = "python", "not built yet: the first disk-tier use builds it (or run acshim build-ext)"
    else:
        module = _loader.load()
        path, reason = ("native" if module is not None else "python"), _loader.reason
    cuda = _cuda_pack_state(load)
    return NativeStatus(path=path, reason=reason, build_directory=build_directory(), cuda_pack=cuda)


def build(verbose: bool = True) -> NativeStatus:
    """Compile (or re-check the cache of) the native extension now; ``acshim build-ext`` calls this.
    Raises ``RuntimeError`` if it cannot be built (the fallback stays available at run time)."""
    module = _loader.load(verbose=verbose)
    if module is None:
        raise RuntimeError(f"acshim native extension did not build: {_loader.reason}")
    return NativeStatus(path="native", reason=_loader.reason, build_directory=build_directory(),
                        cuda_pack=_cuda_pack_state())
