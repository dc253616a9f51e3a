"""Mutation test of the CUDA backend's stream ordering: delete each wait, ``record_stream``, host
synchronisation, stream-ordered release, unregister, device guard and capture check from
``backends/cuda.py`` (and the portable flag, error clearing and the session's CUDA-path checks of
issue 27) in turn and check that the storage tests turn red.

No GPU is needed: the storage tests run the real ``CudaBackend`` over the simulated CUDA runtime
(``backends/simcuda.py``), which poisons (NaN) every read that is not ordered after its write and
reports memory freed while another stream may still use it. A mutation the tests do not catch means
either the line is not needed or the tests miss a case: both are worth knowing.

Each mutant is a copy of the source tree (under ``--work``, default ``$TMPDIR/acshim-mutants``) in
which one statement is replaced by ``pass`` (or a device guard by ``nullcontext()``, a flag by 0, a
check by its permissive value); the tests run from that copy, so the installed
package is untouched. Usage, from the repository root::

    python tests/tools/mutate_cuda.py                  # every mutation, pytest -x -n 2 tests/storage
    python tests/tools/mutate_cuda.py --tests tests/storage/test_exactness.py -k simulated  # a quick look
    python tests/tools/mutate_cuda.py --new --tests tests/storage/test_gpu_paths.py  # issue 27's only

Prints one row per mutation (line, code, caught or not, the first failing test) and exits 1 if
any mutation survived.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
TARGET = Path("backends/cuda.py")
SYNC = re.compile(r"\.(wait_stream|wait_event|synchronize)\(|record_stream\(")
NEW_CALLS = re.compile(r"self\._(retire|lend|check_capture|unpin)\(|pool\.close\(|\.kept_used\(|self\._clear_error\(")
GUARD = re.compile(r"with (self\._on_device\(\)|runtime\.device\(device\)):")
SWAPS = {  # issue 27: a check replaced by its permissive value, a flag by 0
    "self.backend_override.handles(tensor)": "True",
    "HOST_REGISTER_PORTABLE)": "0)",
    "self.raise_write_errors(wait=wait)": "self.raise_write_errors(wait=True)",
    # a reload ordered before the default stream, not the stream current at unpack (the stream the
    # autograd node runs on: its forward op's, a side stream's in test_gpu_paths)
    "current = self.runtime.current_stream(self.device)": "current = self.runtime.default_stream",
}
TARGETS = (TARGET, Path("backends/runtime.py"), Path("acshim/storage/offload_session.py"))
COPIED = ("acshim", "backends", "csrc", "compat_matrix", "tests", "benchmarks", "examples", "docs", "README.md",
          "setup.py", "pyproject.toml")


@dataclass(frozen=True)
class Mutation:
    """Line ``number`` of ``target`` becomes ``replacement``; ``new``: one of issue 27's."""

    target: Path
    number: int
    line: str
    replacement: str
    new: bool


def _statement(code: str) -> bool:
    return not code.strip().startswith(("def ", "class ", '"""'))


def mutations(source: str, target: Path = TARGET) -> list[Mutation]:
    """Every statement that orders work (waits, record_stream, syncs: in ``backends/cuda.py``) and
    every check issue 27 added (stream-ordered release, unregister, device guard, capture check,
    portable flag, error clearing, the session's checks)."""
    found = []
    for number, line in enumerate(source.splitlines(), 1):
        code = line.split("#", 1)[0]
        indent = line[:len(line) - len(line.lstrip())]
        if not _statement(code):
            continue
        if target == TARGET and SYNC.search(code):
            found.append(Mutation(target, number, line, f"{indent}pass  # mutated: {line.strip()}", False))
        elif NEW_CALLS.search(code):
            found.append(Mutation(target, number, line, f"{indent}pass  # mutated: {line.strip()}", True))
        elif target == TARGET and GUARD.search(code):
            swapped = GUARD.sub('with __import__("contextlib").nullcontext():', line)
            found.append(Mutation(target, number, line, swapped, True))
        else:
            for old, new in SWAPS.items():
                if old in code:
                    found.append(Mutation(target, number, line, line.replace(old, new), True))
    return found


def mutant(work: Path, mutation: Mutation) -> Path:
    """A copy of the tree with ``mutation`` applied."""
    tree = work / f"{mutation.target.stem}-{mutation.number}"
    if tree.exists():
        shutil.rmtree(tree)
    tree.mkdir(parents=True)
    for name in COPIED:
        path = ROOT / name
        if path.is_dir():
            shutil.copytree(path, tree / name, ignore=shutil.ignore_patterns("__pycache__", "*.so", "*.o"))
        else:
            shutil.copy2(path, tree / name)
    lines = (ROOT / mutation.target).read_text().splitlines()
    lines[mutation.number - 1] = mutation.replacement
    (tree / mutation.target).write_text("\n".join(lines) + "\n")
    return tree


def run_tests(tree: Path, tests: list[str], workers: int, timeout: float) -> tuple[bool, str, float]:
    """(red, first failing test, seconds) of the tests run from ``tree``."""
    command = [sys.executable, "-m", "pytest", "-x", "-q", "-p", "no:cacheprovider", *tests]
    if workers > 1:
        command += ["-n", str(workers)]
    start = time.monotonic()
    try:
        done = subprocess.run(command, cwd=tree, capture_output=True, text=True, timeout=timeout,
                              env=dict(os.environ, PYTHONDONTWRITEBYTECODE="1"))
    except subprocess.TimeoutExpired:
        return True, "timed out (a hang: caught)", time.monotonic() - start
    failed = re.findall(r"^(?:FAILED|ERROR) (\S+)", done.stdout, re.M)
    last = done.stdout.strip().splitlines()[-1:] or [""]
    return done.returncode != 0, failed[0] if failed else last[0], time.monotonic() - start


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tests", nargs="+", default=["tests/storage"], help="pytest arguments (default: tests/storage)")
    parser.add_argument("--workers", type=int, default=2, help="pytest-xdist workers (default 2)")
    parser.add_argument("--timeout", type=float, default=1800, help="seconds per mutant")
    parser.add_argument("--work", default=os.path.join(tempfile.gettempdir(), "acshim-mutants"))
    parser.add_argument("--only", nargs="*", help="mutate only these lines (N of backends/cuda.py, or path:N)")
    parser.add_argument("--new", action="store_true", help="only issue 27's mutations")
    args, extra = parser.parse_known_args(argv)  # anything else goes to pytest (e.g. -k simulated)
    args.tests = [*args.tests, *extra]
    found = [m for target in TARGETS for m in mutations((ROOT / target).read_text(), target)]
    if args.new:
        found = [m for m in found if m.new]
    if args.only:
        wanted = {item if ":" in item else f"{TARGET}:{item}" for item in args.only}
        found = [m for m in found if f"{m.target}:{m.number}" in wanted]
    work = Path(args.work)
    rows = []
    try:
        for mutation in found:
            tree = mutant(work, mutation)
            red, first, seconds = run_tests(tree, args.tests, args.workers, args.timeout)
            where = f"{mutation.target}:{mutation.number}"
            rows.append((where, mutation.line.strip(), red, first, seconds))
            print(f"{where:<34} {'caught  ' if red else 'SURVIVED'} {seconds:6.0f} s  {mutation.line.strip()}"
                  f"\n{'':16}{first}", flush=True)
            shutil.rmtree(tree, ignore_errors=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    print("\n| line | mutated statement | caught | first failing test |\n|---|---|---|---|")
    for where, code, red, first, _ in rows:
        print(f"| {where} | `{code}` | {'yes' if red else '**no**'} | {first} |")
    survived = [row for row in rows if not row[2]]
    print(f"\n{len(rows) - len(survived)} of {len(rows)} mutations caught")
    return 1 if survived else 0


if __name__ == "__main__":
    raise SystemExit(main())
