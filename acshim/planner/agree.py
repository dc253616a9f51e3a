"""Several ranks, one plan: make every rank's profile and measurements the same before solving.

Each rank of a data-parallel job profiles its own replica (the same model on its own batch), so
timings and, with uneven batches, bytes differ a little between ranks. The solver is deterministic,
so when every rank solves the same numbers every rank gets the same plan: each measured number is
replaced by its maximum over the ranks (the slowest rank sets the step time, the largest peak must
fit), with one ``all_reduce`` on the model's device (CPU tensors for gloo, CUDA ones for NCCL).
A verification's measured ``(held, peak)`` is agreed the same way, so every rank takes the same
re-solve decision and runs the same number of steps while planning.
"""

from __future__ import annotations

import hashlib
from typing import Any

import torch
import torch.distributed as dist

from .profile import Profile


class RanksDisagree(ValueError):
    """The ranks' steps ran different regions (different models or control flow): no common plan."""


def _max(values: list[float], device: torch.device) -> list[float]:
    tensor = torch.tensor(values, dtype=torch.float64, device=device)
    dist.all_reduce(tensor, op=dist.ReduceOp.MAX)
    return tensor.tolist()


def _layout(profile: Profile) -> str:
    """What must be equal on every rank for the numbers to line up: blocks, choices, model."""
    return "|".join([profile.signature, ",".join(profile.choices), ",".join(profile.outside),
                     *(f"{b.name}:{','.join(sorted(b.held))}:{','.join(sorted(b.window))}:{','.join(sorted(b.forward))}"
                       for b in profile.blocks)])


def agree_profile(profile: Profile, device: torch.device) -> Profile:
    """``profile`` with every number replaced by its maximum over the ranks (in place, returned).
    Raises ``RanksDisagree`` when the ranks profiled different regions."""
    digest = int.from_bytes(hashlib.sha256(_layout(profile).encode()).digest()[:6], "big")
    low, high = _max([-float(digest), float(digest)], device)
    if -low != high:
        raise RanksDisagree("the ranks' first steps ran different checkpointed regions (a different model, "
                            "or control flow that depends on the rank), so they cannot share one plan")
    fields: list[tuple[Any, str]] = []
    for block in profile.blocks:
        for table in (block.held, block.transient, block.seconds, block.window, block.forward):
            fields += [(table, key) for key in sorted(table)]
        fields.append((block, "saved"))
    fields += [(None, name) for name in ("other_held", "other_transient", "other_seconds", "other_saved",
                                         "unchecked_floor")]
    fields += [(None, "other_back")] if profile.other_back is not None else []
    fields += [(profile.outside[choice], key) for choice in profile.outside for key in sorted(profile.outside[choice])]
    fields += [(profile.recompute_step, key) for key in sorted(profile.recompute_step)]
    values = [float(_get(profile, table, key)) for table, key in fields]
    agreed = _max(values, device)
    for (table, key), value in zip(fields, agreed, strict=True):
        before = _get(profile, table, key)
        value = int(value) if isinstance(before, int) else value
        if table is None or not isinstance(table, dict):
            setattr(table if table is not None else profile, key, value)
        else:
            table[key] = value
    return profile


def _get(profile: Profile, table: Any, key: str) -> Any:
    if table is None:
        return getattr(profile, key)
    return table[key] if isinstance(table, dict) else getattr(table, key)


def agree_bytes(value: int, device: torch.device) -> int:
    """The largest ``value`` any rank has (what a process holds besides the plan's activations)."""
    return int(_max([float(value)], device)[0])


def agree_every_rank(flags: list[bool], device: torch.device) -> list[bool]:
    """Each of ``flags`` true only where it is true on every rank (a choice every rank measured)."""
    return [value < 0 for value in _max([-1.0 if flag else 0.0 for flag in flags], device)]


def agree_measurement(verified: Any, device: torch.device) -> Any:
    """A verification (``profiler.Verification``) with the largest held and peak bytes any rank
    measured for the same candidate plan, stopped if any rank's guard stopped it (in place)."""
    agreed = _max([float(verified.held), float(verified.peak), float(verified.process_peak or 0),
                   float(verified.stopped), float(verified.live_at_stop), float(verified.seconds)], device)
    verified.held, verified.peak = int(agreed[0]), int(agreed[1])
    verified.process_peak = int(agreed[2]) if verified.process_peak is not None else None
    verified.stopped, verified.live_at_stop, verified.seconds = agreed[3] > 0, int(agreed[4]), agreed[5]
    return verified
