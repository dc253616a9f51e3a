"""Let torch.distributed's Gloo worker threads drop their last work before the interpreter finalizes.

Since torch 2.13 every backward stashes a Python object in the thread-local state that collectives
launched from it capture (``torch.autograd.graph._engine_run_backward``). A Gloo worker thread
(``pt_gloo_runloop``) drops its reference to a finished work a moment after the work completes; if
that moment falls after ``Py_Finalize`` began (a rank that leaves right after ``barrier()`` on a
loaded machine), releasing the stashed object cannot take the GIL and the process aborts with
"terminate called without an active exception" (pytorch/pytorch#179291 describes the same race for
a process group never destroyed; ``destroy_process_group`` does not join those threads either).
At exit, while the interpreter is whole, acshim collects cyclic garbage and waits (one second at
most) until every such thread is seen asleep twice in a row: it has gone back to waiting for work.
Written by hand because torch offers no way to wait for its worker threads.
"""

from __future__ import annotations

import atexit
import gc
import os
import sys
import time

_RUNLOOP = "pt_gloo_runloop"


def _runloop_states() -> list[str]:
    """The scheduler state letter (``R`` running or runnable, ``S`` asleep...) of each Gloo worker
    thread of this process, from ``/proc/self/task``; empty where there are none (or no procfs)."""
    states = []
    try:
        tasks = os.listdir("/proc/self/task")
    except OSError:
        return states
    for task in tasks:
        try:
            with open(f"/proc/self/task/{task}/stat", encoding="ascii", errors="replace") as file:
                stat = file.read()
        except OSError:
            continue  # the thread ended meanwhile
        name_start, name_end = stat.find("("), stat.rfind(")")
        if stat[name_start + 1:name_end] == _RUNLOOP:
            states.append(stat[name_end + 2:name_end + 3])
    return states


def settle_collective_threads(timeout: float = 1.0, interval: float = 0.005) -> bool:
    """Wait until every Gloo worker thread is asleep on two looks ``interval`` apart, ``timeout``
    seconds at most. Returns whether they settled (True at once where torch.distributed is unused)."""
    if "torch.distributed" not in sys.modules:
        return True
    gc.collect()  # works a garbage cycle still holds are released here, with the GIL to be had
    deadline = time.monotonic() + timeout
    quiet = 0
    while True:
        states = _runloop_states()
        quiet = quiet + 1 if all(state in "SDI" for state in states) else 0
        if not states or quiet >= 2:
            return True
        if time.monotonic() >= deadline:
            return False
        time.sleep(interval)


def register() -> None:
    """Run ``settle_collective_threads`` at exit (once per process; handlers registered later run first)."""
    if not getattr(register, "done", False):
        register.done = True  # type: ignore[attr-defined]
        atexit.register(settle_collective_threads)
