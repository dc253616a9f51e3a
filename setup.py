"""Package layout: ``backends/`` sits at the repository root (as DeepSpeed keeps ``accelerator/``)
and installs as the subpackage ``acshim.backends``; ``csrc/`` (native sources) installs as
``acshim._csrc`` and ``compat_matrix/`` (data) as ``acshim._compat_matrix``. pyproject.toml cannot
map root folders into a package found by ``find``, so the package list is computed here; all other
metadata lives in pyproject.toml."""

from setuptools import find_packages, setup

packages = find_packages(include=["acshim", "acshim.*"])
packages += ["acshim.backends"] + [f"acshim.backends.{p}" for p in find_packages("backends")]
packages += ["acshim._csrc"]  # csrc/: native extension sources, compiled on first use
packages += ["acshim._compat_matrix"]  # compat_matrix/: the rows `acshim compat` prints

setup(
    packages=packages,
    package_dir={"acshim": "acshim", "acshim.backends": "backends", "acshim._csrc": "csrc",
                 "acshim._compat_matrix": "compat_matrix"},
    package_data={"acshim": ["py.typed"], "acshim._csrc": ["*.cpp", "*.h", "*.cu", "*.cuh"],
                  "acshim._compat_matrix": ["*.toml", "*.md"]},
)
