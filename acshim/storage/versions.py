"""In-place changes to saved tensors, detected as torch detects them, with torch's own message.

Torch checks a saved tensor's version counter when backward unpacks it, except when
``saved_tensors_hooks`` are active ("we can't track versions through the hooks"). Every hook pair
of the storage tier therefore records the version at pack and compares at unpack, for tensors kept
in place and for moved ones (whose bytes may have been copied before the change, so only the
version counter tells). The message is torch's: its wording (which varies between releases) is
learnt once from torch itself, on a thread without hooks, the first time it is needed.

One approximation: with hooks torch no longer knows whether the tensor was an input or an output
of the node that saved it, nor do we; the message names the tensor's current ``grad_fn`` and
"output 0", which is what torch prints for a saved input (the common case: a tensor the user keeps
and changes). For a saved output changed in place with grad enabled torch names the saving node.
"""

from __future__ import annotations

import threading
import warnings

import torch

_PROBE_TYPE = "[torch.FloatTensor [1]]"
_FALLBACK = (
    "one of the variables needed for gradient computation has been modified by an inplace operation: ",
    {False: " Hint: enable anomaly detection to find the operation that failed to compute its gradient, with "
            "torch.autograd.set_detect_anomaly(True, check_nan=False).",
     True: " Hint: the backtrace further above shows the operation that failed to compute its gradient. The "
           "variable in question was changed in there or anywhere later. Good luck!"},
    True,
)
_wordings: dict[bool, tuple[str, str, bool]] = {}


def forward_op_name(name: str) -> str:
    """A node name as torch's ``Node::forward_op_name``: ``ExpBackward0`` -> ``Exp``,
    ``AddBackward1`` -> ``Add1``; names without a ``Backward<digits>`` ending stay as they are."""
    head, sep, digits = name.rpartition("Backward")
    if not sep or not (digits == "" or digits.isdigit()):
        return name
    return head if digits in ("", "0") else head + digits


def _probe(found: list[str]) -> None:
    x = torch.zeros(1, requires_grad=True)
    y = x.exp()
    with torch.no_grad():
        y.add_(1)
    try:
        y.backward()
    except RuntimeError as error:
        found.append(str(error))


def _wording(anomaly: bool) -> tuple[str, str, bool]:
    """(text before the tensor, hint after "instead.", whether node names are shortened)."""
    wording = _wordings.get(anomaly)
    if wording is not None:
        return wording
    found: list[str] = []
    with warnings.catch_warnings():  # anomaly mode warns about the probe's own failure
        warnings.simplefilter("ignore")
        thread = threading.Thread(target=_probe, args=(found,), daemon=True)  # no saved-tensor hooks there
        thread.start()
        thread.join()
    text = found[0] if found else ""
    start, end = text.find(_PROBE_TYPE), text.find("instead.")
    if start < 0 or end < 0:
        head, hints, short = _FALLBACK
        wording = (head, hints[anomaly], short)
    else:
        wording = (text[:start], text[end + len("instead."):], "output 0 of Exp," in text)
    _wordings[anomaly] = wording
    return wording


def modified_error(tensor: torch.Tensor, expected: int) -> RuntimeError:
    """Torch's error for a saved ``tensor`` found at another version than ``expected``."""
    head, hint, short = _wording(torch.is_anomaly_enabled())
    sizes = ", ".join(str(size) for size in tensor.shape)
    where = ""
    if tensor.grad_fn is not None:
        name = tensor.grad_fn.name()
        where = f", which is output 0 of {forward_op_name(name) if short else name},"
    return RuntimeError(f"{head}[{tensor.type()} [{sizes}]]{where} is at version {tensor._version}; "
                        f"expected version {expected} instead.{hint}")


def keep(tensor: torch.Tensor) -> tuple[torch.Tensor, int]:
    """Pack hook keeping ``tensor`` where it is, with its version (``unpack_kept`` checks it)."""
    return tensor, tensor._version


def unpack_kept(packed: tuple[torch.Tensor, int]) -> torch.Tensor:
    """Unpack hook of ``keep``: the tensor, or torch's error if it was changed in place since."""
    tensor, version = packed
    if tensor._version != version:
        raise modified_error(tensor, version)
    return tensor
