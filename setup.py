"""Package layout: ``backends/`` sits at the repository root (as DeepSpeed keeps ``accelerator/``)
and installs as the subpackage ``acshim.backends``; ``csrc/`` installs as ``acshim._csrc``. pyproject.toml cannot map a root folder into a
package found by ``find``, so the package list is computed here; all metadata lives in pyproject."""

from setuptools import find_packages, setup

packages = find_packages(include=["acshim", "acshim.*"])
packages += ["acshim.backends"] + [f"acshim.backends.{p}" for p in find_packages("backends")]
packages += ["acshim._csrc"]  # csrc/: native extension sources, compiled on first use

setup(
    packages=packages,
    package_dir={"acshim": "acshim", "acshim.backends": "backends", "acshim._csrc": "csrc"},
    package_data={"acshim": ["py.typed"], "acshim._csrc": ["*.cpp", "*.h", "*.cu", "*.cuh"]},
)
