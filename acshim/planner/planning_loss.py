"""The loss a planning step uses when the script's own cannot be called from the planner: the model's
own, or a language model's next-token cross-entropy (what the script's loss holds), else a sum."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F


def planning_loss(output: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> torch.Tensor:
    """The loss a planning step of an unchanged script uses: the model's own (``output.loss``, a Hugging
    Face model given labels), else, for a language model's output (``logits`` of the call's
    ``input_ids``' shape plus a vocabulary) the next-token cross-entropy a script computes from them
    (as Hugging Face's loss does: labels shifted, logits viewed), so the plan counts what the
    script's own loss holds; else ``acshim.measure.default_loss``."""
    from ..measure import default_loss

    loss = getattr(output, "loss", None)
    logits = getattr(output, "logits", None)
    ids = kwargs.get("input_ids", args[0] if args else None)
    if (not isinstance(loss, torch.Tensor) and isinstance(logits, torch.Tensor) and isinstance(ids, torch.Tensor)
            and logits.dim() == 3 and tuple(logits.shape[:2]) == tuple(ids.shape) and not ids.is_floating_point()
            and logits.requires_grad):
        labels = F.pad(ids, (0, 1), value=-100)[:, 1:].reshape(-1)
        return F.cross_entropy(logits.float().view(-1, logits.shape[-1]), labels, ignore_index=-100)
    return default_loss(output)
