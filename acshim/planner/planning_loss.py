"""The loss a planning step uses when the script's own cannot be called from the planner: the model's
own, or a language model's next-token cross-entropy (what the script's loss holds), else a sum."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

SCRIPT_LOSS_OUTPUTS = 2
"""Output-sized tensors a script's own loss on a plain tensor output is charged before it is measured:
a temporary of the output's size and its gradient (README's ``model(x).square().mean()`` held two
beyond the planner's sum: 4.0 MiB on its 2 MiB output at 1024 rows, measured)."""


def script_loss_allowance(output: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> int:
    """Bytes charged for the script's own loss until the planning step measures it
    (``script_loss``): 0 where ``planning_loss`` is the script's own or mimics it (a Hugging Face
    ``loss``, a language model's logits), else ``SCRIPT_LOSS_OUTPUTS`` times the output that the
    planner's plain sum reduces."""
    from .. import structures

    if _has_own_loss(output, args, kwargs):
        return 0
    tensor = next((leaf for leaf in structures.flatten(output)[0]
                   if isinstance(leaf, torch.Tensor) and leaf.is_floating_point()), None)
    if tensor is None or not tensor.requires_grad:
        return 0
    return SCRIPT_LOSS_OUTPUTS * tensor.numel() * tensor.element_size()


def _has_own_loss(output: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
    return isinstance(getattr(output, "loss", None), torch.Tensor) or _lm_logits(output, args, kwargs) is not None


def _lm_logits(output: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[torch.Tensor, torch.Tensor] | None:
    """A language model's ``logits`` and the call's ``input_ids`` (logits of their shape plus a
    vocabulary, ids integral), where the output has no loss of its own."""
    loss = getattr(output, "loss", None)
    logits = getattr(output, "logits", None)
    ids = kwargs.get("input_ids", args[0] if args else None)
    if (not isinstance(loss, torch.Tensor) and isinstance(logits, torch.Tensor) and isinstance(ids, torch.Tensor)
            and logits.dim() == 3 and tuple(logits.shape[:2]) == tuple(ids.shape) and not ids.is_floating_point()
            and logits.requires_grad):
        return logits, ids
    return None


def planning_loss(output: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> torch.Tensor:
    """The loss a planning step of an unchanged script uses: the model's own (``output.loss``, a Hugging
    Face model given labels), else, for a language model's output (``logits`` of the call's
    ``input_ids``' shape plus a vocabulary) the next-token cross-entropy a script computes from them
    (as Hugging Face's loss does: labels shifted, logits viewed), so the plan counts what the
    script's own loss holds; else ``acshim.measure.default_loss``."""
    from ..measure import default_loss

    found = _lm_logits(output, args, kwargs)
    if found is not None:
        logits, ids = found
        labels = F.pad(ids, (0, 1), value=-100)[:, 1:].reshape(-1)
        return F.cross_entropy(logits.float().view(-1, logits.shape[-1]), labels, ignore_index=-100)
    return default_loss(output)
