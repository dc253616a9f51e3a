"""Load what planning and the plan's choices use, before the budget's baseline is taken.

Planning and the choices use parts of torch and acshim that load on first use: torch's dispatch
modes import ``torch._dynamo`` (76 MB of resident memory here), selective checkpointing more of it
(10 MB), the disk tier its native extension (6 MB) and worker threads. That is code and interpreter
state, the size of a library and paid once per process, not activation memory, and it would
otherwise land inside the first planned step and count against its budget. ``warm_up`` runs each
piece once on a tiny layer when the session starts (before the script runs, so before any baseline
the script or the planner takes).
"""

from __future__ import annotations

import functools

import torch
from torch import nn

from .choices import SharedOffload, choice_options, expand_choices, is_offload
from .counting import SavedBytes
from .process import Guard, ProcessMemory
from .tracker import LiveBytes


@functools.cache
def _warmed(choices: tuple[str, ...]) -> bool:
    from ..region import run_region_now

    layer = nn.Linear(4, 4)
    inputs = torch.randn(2, 4, requires_grad=True)
    memory = ProcessMemory()
    with Guard(memory, memory.current()), LiveBytes(set(), timed=True):
        layer(inputs).sum().backward()
    with SavedBytes(set()):
        layer(inputs).sum()
    from torch._subclasses.fake_tensor import FakeTensorMode  # estimate.step_peak
    from torch.func import functional_call

    with FakeTensorMode() as mode:
        state = {name: mode.from_tensor(p).requires_grad_() for name, p in layer.named_parameters()}
        functional_call(layer, state, (mode.from_tensor(inputs),)).sum().backward()
    for choice in choices:
        base = choice.partition(":")[0]
        if base == "keep":
            continue
        if is_offload(choice):
            with SharedOffload(choice.partition(":")[2], 2):
                out = layer(inputs) * 2
        else:
            out = run_region_now(layer.forward, (inputs,), {}, choice_options(choice))
        out.sum().backward()
    import numpy  # noqa: F401  (the solver)

    return True


def warm_up(choices: tuple[str, ...] | list[str], storage: str | None = None) -> None:
    """Run planning's machinery and each of ``choices`` once on a tiny CPU layer (see the module
    docstring), offload through ``storage`` (default the disk tier, CPU's); each set of choices once
    per process."""
    _warmed(tuple(expand_choices(tuple(choices), (storage or "disk",))))
