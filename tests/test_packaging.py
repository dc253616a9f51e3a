"""The package as users install it: a built wheel carries backends/ as acshim.backends and csrc/ as
acshim._csrc, declares the console script, and imports without the source tree."""

from __future__ import annotations

import os
import subprocess
import sys
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_wheel_ships_backends_csrc_and_console_script(tmp_path: Path) -> None:
    subprocess.run([sys.executable, "-m", "pip", "wheel", str(ROOT), "--no-deps", "--no-build-isolation",
                    "-q", "-w", str(tmp_path / "dist")], check=True, cwd=tmp_path)
    (wheel,) = (tmp_path / "dist").glob("acshim-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    assert "acshim/backends/__init__.py" in names
    assert "acshim/_csrc/__init__.py" in names and "acshim/_csrc/fileio.cpp" in names
    assert "acshim/_compat_matrix/engine.toml" in names and "acshim/_compat_matrix/README.md" in names
    assert not any(n.startswith(("backends/", "csrc/", "tests/")) for n in names)
    entry_points = zipfile.ZipFile(wheel).read(next(n for n in names if n.endswith("entry_points.txt"))).decode()
    assert "acshim = acshim.cli:main" in entry_points

    target = tmp_path / "site"
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", str(target), str(wheel)],
                   check=True, cwd=tmp_path)
    env = {k: v for k, v in os.environ.items() if k != "ACSHIM_COMPAT_DIR"} | {"PYTHONPATH": str(target)}
    probe = ("import acshim, acshim.backends, acshim._csrc, acshim.compat; "
             "assert acshim.compat.load_rows(); print(acshim.__file__); print(acshim.backends.__file__)")
    result = subprocess.run([sys.executable, "-c", probe], env=env, cwd=tmp_path, capture_output=True, text=True,
                            check=True)
    package_file, backends_file = result.stdout.split()
    assert package_file.startswith(str(target)) and backends_file.startswith(str(target / "acshim" / "backends"))
