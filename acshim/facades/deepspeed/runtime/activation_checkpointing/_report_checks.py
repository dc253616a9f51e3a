"""What ``acshim run --report`` says about DeepSpeed settings that do nothing here, told to the
engine's ``acshim.diagnostics.DIAGNOSTICS`` (imported when a report starts; see ``Dialect.diagnostics``).

- an ``activation_checkpointing`` config block (given to ``configure`` or ``deepspeed.initialize``)
  when no ``deepspeed.checkpointing.checkpoint`` ran;
- ``cpu_checkpointing`` on when no DeepSpeed checkpoint ran (only that call reads it, as upstream).

``deepspeed.initialize`` is watched because the DeepSpeed engine never reads the block
(deepspeed/runtime/engine.py; only ``deepspeed.checkpointing.configure(deepspeed_config=...)`` does).
"""

from __future__ import annotations

import contextlib
import sys
import types
from collections.abc import Callable, Collection
from typing import Any

from acshim.diagnostics import DIAGNOSTICS

DIALECT = "deepspeed"
_FACADE = "acshim.facades.deepspeed.runtime.activation_checkpointing.checkpointing"
_UPSTREAM = "deepspeed.runtime.activation_checkpointing.checkpointing"


def unused_settings(ran: Collection[str]) -> list[str]:
    """Notes for the report (see the module docstring); ``ran``: dialects whose regions ran."""
    if DIALECT in ran:
        return []
    out = []
    blocks = getattr(sys.modules.get(_FACADE), "CONFIG_BLOCKS", [])
    if blocks:
        out.append(f"DeepSpeed config {blocks[-1]} has an activation_checkpointing block, but nothing called "
                   "deepspeed.checkpointing.checkpoint: the block does nothing (checkpoint the blocks with "
                   "deepspeed.checkpointing.checkpoint, or drop the block)")
    # the facade's global, or the real module's when upstream is kept and patched in place
    if any(getattr(sys.modules.get(name), "CPU_CHECKPOINT", False) is True for name in (_FACADE, _UPSTREAM)):
        others = ", ".join(sorted(ran)) or "none"
        out.append(f"cpu_checkpointing is on, but no DeepSpeed checkpoint ran (regions that ran: {others}); "
                   "only deepspeed.checkpointing.checkpoint reads it, as upstream")
    return out


def watch_initialize() -> Callable[[], None]:
    """Note the config given to ``deepspeed.initialize`` (now, or at DeepSpeed's first import);
    returns the undo, which puts the original ``initialize`` back. Observes, changes nothing."""
    import wrapt

    wrapped: dict[str, Any] = {}
    active = [True]

    def wrap(deepspeed: types.ModuleType) -> None:
        initialize = getattr(deepspeed, "initialize", None)
        if not active[0] or initialize is None or isinstance(initialize, wrapt.ObjectProxy):
            return
        wrapped["module"], wrapped["original"] = deepspeed, initialize
        deepspeed.initialize = wrapt.FunctionWrapper(initialize, _noting)

    wrapt.register_post_import_hook(wrap, "deepspeed")  # runs now if DeepSpeed is imported already

    def undo() -> None:
        active[0] = False  # the hook cannot be unregistered: it does nothing from now on
        module = wrapped.pop("module", None)
        if module is not None and isinstance(getattr(module, "initialize", None), wrapt.FunctionWrapper):
            module.initialize = wrapped.pop("original")

    return undo


def _noting(wrapped: Callable[..., Any], instance: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    with contextlib.suppress(Exception):  # a diagnostic must never break the script's initialize
        _note_initialize_config(args, kwargs)
    return wrapped(*args, **kwargs)


def _note_initialize_config(args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
    from . import checkpointing
    from .config import load_param_dict

    config = kwargs.get("config", kwargs.get("config_params"))
    cli_args = kwargs.get("args", args[0] if args else None)
    if config is None:
        config = getattr(cli_args, "deepspeed_config", None)
    if config is not None and "activation_checkpointing" in load_param_dict(config):
        label = config if isinstance(config, str) else "a dict"
        checkpointing.CONFIG_BLOCKS.append(f"{label} (given to deepspeed.initialize)")


DIAGNOSTICS.add_check(DIALECT, unused_settings)
DIAGNOSTICS.add_watcher(f"{DIALECT}.initialize", watch_initialize)
