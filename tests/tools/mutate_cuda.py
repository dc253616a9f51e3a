"""Mutation test of the CUDA backend's stream ordering: delete each wait, ``record_stream`` and host
synchronisation from ``backends/cuda.py`` in turn and check that the storage tests turn red.

No GPU is needed: the storage tests run the real ``CudaBackend`` over the simulated CUDA runtime
(``backends/simcuda.py``), which poisons (NaN) every read that is not ordered after its write and
reports memory freed while another stream may still use it. A mutation the tests do not catch means
either the line is not needed or the tests miss a case: both are worth knowing.

Each mutant is a copy of the source tree (under ``--work``, default ``$TMPDIR/acshim-mutants``) in
which one call statement is replaced by ``pass``; the tests run from that copy, so the installed
package is untouched. Usage, from the repository root::

    python tests/tools/mutate_cuda.py                  # every mutation, pytest -x -n 2 tests/storage
    python tests/tools/mutate_cuda.py --tests tests/storage/test_exactness.py -k simulated  # a quick look

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
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
TARGET = Path("backends/cuda.py")
SYNC = re.compile(r"\.(wait_stream|wait_event|synchronize)\(|record_stream\(")
COPIED = ("acshim", "backends", "csrc", "compat_matrix", "tests", "benchmarks", "examples", "docs", "README.md",
          "setup.py", "pyproject.toml")


def mutations(source: str) -> list[tuple[int, str]]:
    """(line number, line) of every statement that orders work: waits, record_stream, syncs."""
    found = []
    for number, line in enumerate(source.splitlines(), 1):
        code = line.split("#", 1)[0]
        if SYNC.search(code) and not code.strip().startswith(("def ", "class ", '"""')):
            found.append((number, line))
    return found


def mutant(work: Path, source: str, number: int) -> Path:
    """A copy of the tree with line ``number`` of the target replaced by ``pass``."""
    tree = work / f"line-{number}"
    if tree.exists():
        shutil.rmtree(tree)
    tree.mkdir(parents=True)
    for name in COPIED:
        path = ROOT / name
        if path.is_dir():
            shutil.copytree(path, tree / name, ignore=shutil.ignore_patterns("__pycache__", "*.so", "*.o"))
        else:
            shutil.copy2(path, tree / name)
    lines = source.splitlines()
    line = lines[number - 1]
    indent = line[:len(line) - len(line.lstrip())]
    lines[number - 1] = f"{indent}pass  # mutated: {line.strip()}"
    (tree / TARGET).write_text("\n".join(lines) + "\n")
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
    parser.add_argument("--only", type=int, nargs="*", help="mutate only these line numbers")
    args, extra = parser.parse_known_args(argv)  # anything else goes to pytest (e.g. -k simulated)
    args.tests = [*args.tests, *extra]
    source = (ROOT / TARGET).read_text()
    found = [(n, line) for n, line in mutations(source) if not args.only or n in args.only]
    work = Path(args.work)
    rows = []
    try:
        for number, line in found:
            tree = mutant(work, source, number)
            red, first, seconds = run_tests(tree, args.tests, args.workers, args.timeout)
            rows.append((number, line.strip(), red, first, seconds))
            print(f"{TARGET}:{number:<4} {'caught  ' if red else 'SURVIVED'} {seconds:6.0f} s  {line.strip()}"
                  f"\n{'':16}{first}", flush=True)
            shutil.rmtree(tree, ignore_errors=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    print("\n| line | deleted statement | caught | first failing test |\n|---|---|---|---|")
    for number, code, red, first, _ in rows:
        print(f"| {number} | `{code}` | {'yes' if red else '**no**'} | {first} |")
    survived = [row for row in rows if not row[2]]
    print(f"\n{len(rows) - len(survived)} of {len(rows)} mutations caught")
    return 1 if survived else 0


if __name__ == "__main__":
    raise SystemExit(main())
