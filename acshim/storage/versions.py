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
from contextlib import nullcontext

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


def modified_error(tensor: torch.Tensor, expected: int, shape: tuple[int, ...] | None = None,
                   grad_fn_name: str | None = None) -> RuntimeError:
    """Torch's error for a saved ``tensor`` found at another version than ``expected``. ``tensor``
    may be a ``version_probe`` of a tensor that is gone: ``shape`` and ``grad_fn_name`` (as saved)
    then stand for what torch would print of the tensor it kept."""
    head, hint, short = _wording(torch.is_anomaly_enabled())
    sizes = ", ".join(str(size) for size in (tensor.shape if shape is None else shape))
    where = ""
    if grad_fn_name is None and tensor.grad_fn is not None:
        grad_fn_name = tensor.grad_fn.name()
    if grad_fn_name is not None:
        where = f", which is output 0 of {forward_op_name(grad_fn_name) if short else grad_fn_name},"
    return RuntimeError(f"{head}[{tensor.type()} [{sizes}]]{where} is at version {tensor._version}; "
                        f"expected version {expected} instead.{hint}")


_set_version = getattr(torch._C._autograd, "_unsafe_set_version_counter", None)


def version_probe(tensor: torch.Tensor) -> torch.Tensor | None:
    """A tensor that shares ``tensor``'s version counter but none of its memory (an empty storage).

    A moved tensor's bytes leave, and the user may drop the tensor itself after changing it in place
    (``h.mul_(2); del h``): a weak reference then cannot tell that the bytes a background copy wrote
    are not those autograd saved. The probe outlives the tensor, costs no memory, and sees every
    in-place change of the tensor, its views and its base, so unpack can give torch's error. None
    for inference tensors (no version counter) and torches that cannot make one."""
    if _set_version is None or tensor.is_inference():
        return None
    version = tensor._version
    # Inside a torch dispatch mode (selective checkpointing caches op outputs from one) detach runs
    # below ADInplaceOrView and would not share the counter; switch that key back on, as torch's
    # own _detach_helper does.
    # A plain tensor's probe is made below the Python dispatch modes: set_ touches no byte, but a
    # mode would see it write the tensor's memory (the CUDA sanitizer reported it as a race with the
    # copy out on an H100); a subclass keeps its own dispatch.
    hidden = torch._C._DisableTorchDispatch() if type(tensor) in (torch.Tensor, torch.nn.Parameter) else nullcontext()
    with hidden, torch._C._SetExcludeDispatchKeyGuard(torch._C.DispatchKey.ADInplaceOrView, False):
        probe = tensor.detach()  # shares the version counter (and, until set_, the storage)
        try:
            probe.set_()  # an empty storage of the same dtype and device
        except RuntimeError:  # a torch that forbids set_ on a detached tensor
            return None
    _set_version((probe,), (version + 1,))
    shared = tensor._version == version + 1
    _set_version((probe,), (version,))  # the counter is the tensor's own: leave it as it was
    if not shared:
        _set_version((tensor,), (version,))
        return None
    return probe


def keep(tensor: torch.Tensor) -> tuple[torch.Tensor, int]:
    """Pack hook keeping ``tensor`` where it is, with its version (``unpack_kept`` checks it)."""
    return tensor, tensor._version


def unpack_kept(packed: tuple[torch.Tensor, int]) -> torch.Tensor:
    """Unpack hook of ``keep``: the tensor, or torch's error if it was changed in place since."""
    tensor, version = packed
    if tensor._version != version:
        raise modified_error(tensor, version)
    return tensor
