"""What planning may change in a model, taken before and put back after.

Planning runs the model's blocks many times, so anything their forwards change would otherwise
be changed many times: parameter gradients, buffers (BatchNorm running statistics and its batch
counter), the CPU and device RNG states, train/eval mode, and plain Python state that modules keep
(a call counter ``self.calls += 1``, auxiliary losses appended to ``self.aux``, an attribute a
forward sets). Containers are restored in place, so references held elsewhere see the restored
contents; attributes a forward added are removed. Objects other than lists, dicts and sets are put
back by reference only (their own internal changes are not undone); state outside the model's
modules (globals, closures) is not seen.
"""

from __future__ import annotations

import copy
from typing import Any

import torch
from torch import nn

_OWN_STATE = frozenset(("_parameters", "_buffers", "_modules"))  # restored elsewhere, or never changed here
_CONTAINERS = (list, dict, set)


class ModelSnapshot:
    """Gradients, buffers, RNG states, mode and module attributes of ``model`` (see the module docstring)."""

    def __init__(self, model: nn.Module) -> None:
        self.model = model
        self.training = [(module, module.training) for module in model.modules()]
        self.grads = [(param, param.grad) for param in model.parameters()]
        self.buffers = [(module, name, buffer, buffer.detach().clone())
                        for module in model.modules() for name, buffer in module._buffers.items() if buffer is not None]
        self.attributes = [(module, {key: (value, copy.copy(value) if isinstance(value, _CONTAINERS) else None)
                                     for key, value in module.__dict__.items() if key not in _OWN_STATE})
                           for module in model.modules()]
        self.rng = torch.get_rng_state()
        self.device_rng = _device_rng_states()

    def restore(self) -> None:
        """Put everything back (the model's objects stay the same objects)."""
        for module, saved in self.attributes:
            for key in [key for key in module.__dict__ if key not in saved and key not in _OWN_STATE]:
                del module.__dict__[key]
            for key, (value, contents) in saved.items():
                if contents is not None:
                    _refill(value, contents)
                module.__dict__[key] = value
        with torch.no_grad():
            for module, name, buffer, value in self.buffers:
                module._buffers[name] = buffer
                buffer.copy_(value)
        for param, grad in self.grads:
            param.grad = grad
        for module, training in self.training:
            module.training = training
        torch.set_rng_state(self.rng)
        for device, state in self.device_rng:
            torch.cuda.set_rng_state(state, device)


def _refill(container: Any, contents: Any) -> None:
    if isinstance(container, list):
        container[:] = contents
    else:
        container.clear()
        container.update(contents)


def _device_rng_states() -> list[tuple[int, torch.Tensor]]:
    if not torch.cuda.is_available() or not torch.cuda.is_initialized():
        return []
    return [(device, torch.cuda.get_rng_state(device)) for device in range(torch.cuda.device_count())]
