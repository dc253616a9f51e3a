"""Run a script or module as ``python script.py`` / ``python -m module`` would, in this process.

Scripts: ``sys.argv`` exactly as given, ``__name__ == "__main__"``, ``__file__`` absolute,
``sys.path[0]`` the script's real directory, and the script module stays ``sys.modules["__main__"]``
afterwards (atexit handlers, pickling and ``multiprocessing`` spawn look it up there). Written here
rather than with ``runpy.run_path`` because run_path rewrites ``sys.argv[0]`` to the path it is
given and puts the previous ``__main__`` back when the script returns. Modules go through
``runpy.run_module(alter_sys=True)``, which is what ``python -m`` itself uses.

Exceptions propagate to the caller unchanged; ``script_traceback`` trims the runner's own frames
so the printed traceback starts where ``python script.py``'s does.
"""

from __future__ import annotations

import importlib.machinery
import importlib.util
import io
import os
import runpy
import sys
import types
import zipfile
from collections.abc import Callable, Sequence
from dataclasses import dataclass


class ScriptNotFound(OSError):
    """The script path does not name a readable file."""


def run_script(path: str, args: Sequence[str] = ()) -> None:
    """Execute the file ``path`` as ``__main__`` with ``sys.argv = [path, *args]``. A directory or
    zip file with a ``__main__.py`` runs through ``runpy.run_path`` (there ``sys.argv[0]`` is the
    absolute path, where python keeps it as typed)."""
    absolute = os.path.abspath(path)
    if os.path.isdir(absolute) or zipfile.is_zipfile(absolute):
        sys.argv[:] = [absolute, *args]
        if sys.path:
            del sys.path[0]  # run_path puts the directory / archive there, as python does
        runpy.run_path(absolute, run_name="__main__")
        return
    try:
        with io.open_code(absolute) as file:
            source = file.read()
    except OSError as error:
        raise ScriptNotFound(error.errno, f"can't open file {absolute!r}: [Errno {error.errno}] {error.strerror}") from None
    code = compile(source, absolute, "exec", dont_inherit=True)
    main = types.ModuleType("__main__")
    main.__dict__.update(
        __file__=absolute, __cached__=None, __spec__=None, __package__=None,
        __loader__=importlib.machinery.SourceFileLoader("__main__", absolute), __builtins__=__builtins__)
    sys.argv[:] = [path, *args]
    _set_path0(os.path.dirname(os.path.realpath(absolute)))
    sys.modules["__main__"] = main
    exec(code, main.__dict__)


def module_found(name: str) -> bool:
    """Put the working directory first on ``sys.path`` (as ``python -m`` does, whichever way acshim
    itself was started) and say whether module ``name`` can be found there or on the rest of the path."""
    _set_path0(os.getcwd())
    try:
        return importlib.util.find_spec(name) is not None
    except ImportError:  # a parent package that does not exist or fails to import
        return False


def run_module(name: str, args: Sequence[str] = ()) -> None:
    """Execute module ``name`` as ``python -m name`` would (``sys.path[0]`` = the working directory)."""
    sys.argv[:] = [name, *args]  # runpy replaces argv[0] with the module's file, as python -m does
    _set_path0(os.getcwd())
    runpy.run_module(name, run_name="__main__", alter_sys=True)


@dataclass
class ExitReport:
    """The one line (or full report) this process prints at exit: registered once per process."""

    registered: bool = False
    filtered: bool = True
    """Stay silent in a process that is not a rank and ran no region (see ``report_regions_at_exit``)."""
    render: Callable[[], str] | None = None
    """The full report (``acshim run --report``), printed after the counts line."""
    withheld: bool = False

    def print(self) -> None:
        """What the at-exit handler prints (to stderr)."""
        from ..region import STATS

        if self.withheld:
            return
        rank = os.environ.get("RANK")
        if self.filtered and rank is None and STATS.forwards == 0:
            return
        suffix = f" (rank {rank})" if rank is not None else ""
        if self.render is not None:
            print(f"{STATS}{suffix}\n{self.render()}", file=sys.stderr, flush=True)
            return
        print(f"{STATS}{suffix}", file=sys.stderr, flush=True)


EXIT_REPORT = ExitReport()
"""This process's at-exit report (one per process: ``atexit`` runs it once)."""


def report_regions_at_exit(*, only_ranks_and_users: bool = False, detailed: Callable[[], str] | None = None) -> None:
    """With ``ACSHIM_REPORT_REGIONS=1``, print this process's region counts to stderr at exit, one
    line, `` (rank N)`` appended under a launcher. ``only_ranks_and_users`` (child processes): stay
    silent in a process that is not a rank and ran no region (a launcher that imported accelerate).
    ``detailed`` (``acshim run --report``): the full report's ``render``, printed after the line,
    whatever the environment says. Registers once per process; a call without the filter lifts it."""
    if detailed is not None:
        EXIT_REPORT.render = detailed
    elif os.environ.get("ACSHIM_REPORT_REGIONS") != "1":
        return
    EXIT_REPORT.filtered = EXIT_REPORT.filtered and only_ranks_and_users
    if EXIT_REPORT.registered:
        return
    EXIT_REPORT.registered = True
    import atexit

    atexit.register(EXIT_REPORT.print)


def withhold_report() -> None:
    """No report at exit: the run was refused before it ran (``--budget`` that cannot be met), so
    there is nothing to report (counts of zero and the inputs of a call that never ran would say
    otherwise)."""
    EXIT_REPORT.withheld = True


def print_error_line(message: str) -> None:
    """Print ``message`` to stderr on a line of its own: it starts with a line break, since the script
    may have left its last line unfinished (a tqdm bar redraws its line with ``\\r`` and no newline)."""
    sys.stdout.flush()
    print(f"\n{message}", file=sys.stderr, flush=True)


def record_rank_message(message: str) -> None:
    """Under torchrun (``TORCHELASTIC_ERROR_FILE`` set: also ``accelerate launch``, which starts ranks
    through it), write ``message`` where the launcher's failure summary reads a rank's root cause, in
    the layout of torch's ``ErrorHandler.record_exception`` (torch/distributed/elastic/multiprocessing/
    errors/error_handler.py; the summary shows ``extraInfo.py_callstack`` if present, else
    ``message``), for a run that ends with an error of acshim's own rather than an exception. A file
    the script wrote stays."""
    path = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if not path or os.path.exists(path):
        return
    import json
    import time

    data = {"message": {"message": message, "extraInfo": {"timestamp": str(int(time.time()))}}}
    try:
        with open(path, "w") as file:
            json.dump(data, file)
    except OSError:  # best effort: the message is on stderr either way
        pass


def record_rank_error(error: BaseException) -> None:
    """Under torchrun (``TORCHELASTIC_ERROR_FILE`` set), write ``error`` where torchrun's failure
    summary reads a rank's root cause, as ``@record`` would; a file the script wrote stays. Call
    from inside the ``except`` block."""
    path = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if not path or os.path.exists(path):
        return
    try:
        from torch.distributed.elastic.multiprocessing.errors import ErrorHandler

        ErrorHandler().record_exception(error)
    except Exception:  # best effort: the traceback is on stderr either way
        pass


def _set_path0(directory: str) -> None:
    # ``acshim`` (console script) or ``python -m acshim`` put their own directory first; the
    # script must see its own instead, as under ``python script.py``.
    if sys.path:
        sys.path[0] = directory
    else:
        sys.path.insert(0, directory)


def script_traceback(error: BaseException, filename: str | None) -> types.TracebackType | None:
    """The traceback of ``error`` from the script's first frame on (the runner's own frames and
    runpy's removed); None for errors raised before the script ran (e.g. a SyntaxError)."""
    tb = error.__traceback__
    while tb is not None:
        code_file = tb.tb_frame.f_code.co_filename
        if filename is not None and os.path.abspath(code_file) == filename:
            return tb
        if filename is None and tb.tb_frame.f_globals.get("__name__") == "__main__" and not _is_runner_frame(code_file):
            return tb
        tb = tb.tb_next
    return None


def _is_runner_frame(code_file: str) -> bool:
    return os.path.abspath(code_file) in {os.path.abspath(__file__), os.path.abspath(runpy.__file__)}
