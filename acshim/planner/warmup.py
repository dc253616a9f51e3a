"""Load what planning and the plan's choices use, before the budget's baseline is taken.

Planning and the choices use parts of torch and acshim that load on first use: torch's dispatch
modes import ``torch._dynamo`` (76 MB of resident memory here), selective checkpointing more of it
(10 MB), the disk tier its native extension (6 MB) and worker threads. That is code and interpreter
state, the size of a library and paid once per process, not activation memory, and it would
otherwise land inside the first planned step and count against its budget. ``warm_up`` runs each
piece once on a tiny layer when the session starts (before the script runs, so before any baseline
the script or the planner takes).

The same holds for the code of the operators a training step runs (their kernels in ``libtorch``,
forward and backward, and the optimizers' multi-tensor updates): the budget is checked by resident
memory, file-backed pages included (``process``), and the first use of each operator pages its code
in. Without this, README's train.py at ``--budget 0.5`` paged 5 MiB of code in while its first block
was measured alone, which stopped that measurement at the budget's lower bound; a plain run pays
those pages in its first step too. ``_page_in_kernels`` runs a small step of the usual layers once,
its random numbers drawn from a forked generator (the script's own stay as they were).
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

    _page_in_kernels()
    return True


def _page_in_kernels() -> None:
    """One small training step of the layers language models and MLPs are made of, on CPU, and one
    step of SGD and AdamW: their kernels' code resident before any baseline (module docstring)."""
    import torch.nn.functional as F

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        linear, norm, embedding = nn.Linear(64, 64), nn.LayerNorm(64), nn.Embedding(128, 64)
        tokens = torch.randint(0, 128, (4, 16))
        x = embedding(tokens)
        x = norm(F.dropout(F.gelu(linear(x)), 0.1, training=True)) + F.silu(linear(x))
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)
        q = x.view(4, 16, 4, 16).transpose(1, 2)
        x = F.scaled_dot_product_attention(q, q, q, is_causal=True).transpose(1, 2).reshape(4, 16, 64)
        logits = F.linear(x, embedding.weight).float()
        loss = F.cross_entropy(logits.view(-1, 128), tokens.view(-1)) + logits.log_softmax(-1).mean() \
            + x.square().mean() + F.mse_loss(x, x.detach() * 0.5)
        loss.backward()
        parameters = [*linear.parameters(), *norm.parameters(), *embedding.parameters()]
        for optimizer in (torch.optim.SGD(parameters, lr=0.1, momentum=0.9), torch.optim.AdamW(parameters)):
            optimizer.step()
            optimizer.zero_grad()


def warm_up(choices: tuple[str, ...] | list[str], storage: str | None = None) -> None:
    """Run planning's machinery and each of ``choices`` once on a tiny CPU layer (see the module
    docstring), offload through ``storage`` (default the disk tier, CPU's); each set of choices once
    per process."""
    _warmed(tuple(expand_choices(tuple(choices), (storage or "disk",))))
