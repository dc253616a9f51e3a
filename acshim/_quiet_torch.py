"""Import torch for acshim without torch's import-time "Failed to initialize NumPy" warning.

torch's CPU wheels do not depend on NumPy, and ``import torch`` without it prints that UserWarning
(from ``torch/_subclasses/functional_tensor.py``) although acshim never needs NumPy. Only that
warning, and only during torch's first import, is silenced: code that really uses NumPy still gets
torch's "Numpy is not available" error, and a torch imported before acshim warns as usual.
"""

from __future__ import annotations

import sys
import warnings

if "torch" not in sys.modules:
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="Failed to initialize NumPy", category=UserWarning)
        import torch  # noqa: F401
