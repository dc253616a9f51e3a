"""Where saved tensors live: device, host memory or disk, prefetched back ahead of backward.

Two scopes, one engine. ``offload()`` is a context manager around forward: every tensor autograd
saves inside it moves (what torch's ``save_on_cpu``/``offload_wrapper`` do).
``boundary_offload()`` is a ``RegionOptions.saved_tensors_scope``: the boundary inputs of
checkpointed regions move (DeepSpeed ``checkpoint_in_cpu``, FairScale ``offload_to_cpu``, SMP
``offload_activations``). Tiers: ``host`` (CPU tensors stay put, free) and ``disk`` (private
unlinked files, ``O_DIRECT``). Transfers run on ``acshim.backends``; disk I/O on the native
extension in ``csrc/`` or its Python fallback (``native.status()``).

Modules: ``scopes`` (public contexts), ``session`` (pack/unpack glue), ``scheduler`` (prefetch
window), ``layout`` (bytes of a tensor and its rebuild), ``residents`` (parameters and buffers,
which stay), ``host``/``disk`` (tiers), ``native`` (extension loader), ``defaults`` (engine-wide
defaults facades write), ``versions`` (torch's in-place check, which hooks switch off), ``reaper``
(frees space off the main thread, Ctrl-C safe).
"""

from __future__ import annotations

from . import native
from .defaults import StorageDefaults, get_defaults, reset_defaults, set_defaults
from .errors import OffloadIOError
from .offload_session import OffloadStats
from .scopes import (
    BoundaryOffload,
    OffloadActivations,
    boundary_offload,
    no_offload,
    offload,
    recording,
    region_option_changes,
)

__all__ = [
    "BoundaryOffload", "OffloadActivations", "OffloadIOError", "OffloadStats", "StorageDefaults", "boundary_offload",
    "get_defaults", "native", "no_offload", "offload", "recording", "region_option_changes", "reset_defaults",
    "set_defaults",
]
