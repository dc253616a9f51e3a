"""The facade's entry points as patches for the real DeepSpeed (``ACSHIM_PATCHES`` targets).

When the real package is installed, ``acshim.install()`` replaces its checkpointing functions with
these. Each runs the facade function with the facade's state bound to the real module's globals, so
``deepspeed.checkpointing.PARTITION_ACTIVATIONS = True`` written by a script (or by DeepSpeed's own
tests through ``setattr``) is what the patched ``checkpoint`` reads, and what the patched
``configure`` writes is what the script reads back. The RNG tracker, timers and offload engine stay
the facade's own: the real module's objects under those names are upstream classes.
"""

from __future__ import annotations

import functools
import sys
from collections.abc import Callable
from typing import Any

from . import UPSTREAM_CHECKPOINTING
from .runtime.activation_checkpointing import checkpointing as facade
from .runtime.activation_checkpointing._state import STATE, StateBackedModule


def upstream_globals() -> dict[str, Any] | None:
    """The real upstream checkpointing module's globals, or None when the facade serves that name."""
    module = sys.modules.get(UPSTREAM_CHECKPOINTING)
    if module is None or isinstance(module, StateBackedModule):
        return None
    return vars(module)


def _on_upstream_globals(function: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(function)
    def patched(*args: Any, **kwargs: Any) -> Any:
        with STATE.bound_to(upstream_globals()):
            return function(*args, **kwargs)

    return patched


checkpoint = _on_upstream_globals(facade.checkpoint)
non_reentrant_checkpoint = _on_upstream_globals(facade.non_reentrant_checkpoint)
configure = _on_upstream_globals(facade.configure)
is_configured = _on_upstream_globals(facade.is_configured)
reset = _on_upstream_globals(facade.reset)
get_cuda_rng_tracker = _on_upstream_globals(facade.get_cuda_rng_tracker)
model_parallel_cuda_manual_seed = _on_upstream_globals(facade.model_parallel_cuda_manual_seed)
model_parallel_reconfigure_tp_seed = _on_upstream_globals(facade.model_parallel_reconfigure_tp_seed)
partition_activations_in_checkpoint = _on_upstream_globals(facade.partition_activations_in_checkpoint)
set_num_layers = _on_upstream_globals(facade.set_num_layers)
