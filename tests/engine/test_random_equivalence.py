"""Randomized equivalence: random region configurations against the run without checkpointing.

Each case is drawn from a fixed seed: a small model of random blocks (MLP, dropout, BatchNorm in
train mode, nested/non-tensor inputs and outputs, keyword arguments, blocks nesting other blocks,
frozen blocks, spectral norm of either API, buffers a forward changes in place or reassigns or
counts with, an LSTM), a route into the engine (``acshim.checkpoint`` per region with reentrant or
non-reentrant mode, the same around a closure over the block, ``acshim.run_region``, or
``acshim.apply_checkpointing`` with a random policy), an input that may or may not require grad,
gradients by ``backward()``, ``autograd.grad`` or ``backward(inputs=...)``, maybe an offload tier
(host or disk) with a prefetch horizon, and maybe a block output changed in place after the
forward and dropped (autograd saved it: torch's in-place error, on every tier). Drawn on top, from
a second generator so that the cases above stay as they were (issue 28): the blocks' linear layers
applied row by row under ``torch.vmap``, their outputs kept by forward hooks and differentiated by
an extra loss (Hugging Face's router-logit recorder), every trainable weight changed in place after
the forward (an optimizer step before backward: torch's in-place error, or acshim's where only the
recompute would read a changed weight), and a first step stopped by Ctrl-C in backward (every
descriptor of the disk tier closed at once, the next step exact). One training step
must give bitwise the gradients (parameters and input), the loss and the buffers of the same model
run without checkpointing, or the error that run gives. Where acshim raises instead, torch's own
``torch.utils.checkpoint`` must raise the same error in the same configuration.

A failing case names its seed in the test id and prints its whole configuration; rerun one with
``pytest tests/engine/test_random_equivalence.py -k seed17``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import os
import random
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.utils.checkpoint as torch_checkpoint
from torch import nn

import acshim
import acshim.selective
import acshim.testing
from acshim.testing import assert_bitwise_equal, open_descriptors_in

WIDTH = 24  # a batch of 16 rows: 1536-byte activations, above the offload size floor
BATCH = 16
ACTIVATIONS = {"tanh": torch.tanh, "relu": torch.relu, "gelu": nn.functional.gelu, "sin": torch.sin}
KINDS = ("mlp", "dropout", "batchnorm", "inplace", "multi", "kwargs", "spectral", "stateful", "lstm", "nest")
VARIANTS = {"spectral": ("utils.spectral_norm", "parametrizations.spectral_norm"),
            "stateful": ("average", "reassigned", "counter")}
ROUTES = ("checkpoint", "run_region", "apply", "closure")
GRAD_MODES = ("backward", "autograd.grad", "backward(inputs=...)")


# ---------------------------------------------------------------------------------------------
# The configuration: plain data, drawn from a seed, printable.


@dataclass
class BlockSpec:
    kind: str
    act: str
    frozen: bool = False  # every parameter of the block has requires_grad=False
    region: bool = False  # checkpoint / run_region routes: this block is called as a region
    reentrant: bool = False  # ... in this mode
    kwargs_shift: str = "none"  # kwargs blocks: "none", "const" (the second model input) or "activation"
    kwargs_partial: bool = False  # kwargs blocks: bound with functools.partial, not passed as kwargs
    selective: bool = False  # non-reentrant regions: context_fn=acshim.selective.save_ops()
    twice: bool = False  # the same module is called twice in a row (shared weights, BatchNorm twice)
    variant: str = ""  # spectral / stateful blocks: which one (VARIANTS)
    vmapped: bool = False  # the block's linear layer runs row by row under torch.vmap
    children: list[BlockSpec] = field(default_factory=list)

    def describe(self, name: str, indent: int, route: str) -> list[str]:
        flags = [self.kind + (f"({self.variant})" if self.variant else ""), self.act]
        if self.frozen:
            flags.append("frozen")
        if self.region and route != "apply":  # the apply route's regions are the policy's
            flags.append("region(" + ("reentrant" if self.reentrant else "non-reentrant") + ")")
        if self.selective and route != "apply":
            flags.append("context_fn=save_ops()")
        if self.kind == "kwargs":
            flags.append(f"shift={self.kwargs_shift}" + (" via functools.partial" if self.kwargs_partial else ""))
        if self.twice:
            flags.append("called twice")
        if self.vmapped:
            flags.append("linear under torch.vmap")
        lines = [" " * indent + f"{name}: " + " ".join(flags)]
        for index, child in enumerate(self.children):
            lines += child.describe(f"{name}.inner.{index}", indent + 2, route)
        return lines


@dataclass
class Case:
    seed: int
    route: str
    blocks: list[BlockSpec]
    input_requires_grad: bool
    const_requires_grad: bool = False  # the second model input (used by multi, kwargs, nest blocks)
    grad_mode: str = "backward"  # or "autograd.grad" (every trainable leaf as inputs)
    offload: tuple[str, int, int] | None = None  # (storage, prefetch, min_bytes) around forward
    changed_after_forward: int | None = None  # this top-level call's output is changed in place and dropped
    policy: str = ""  # apply route: the policy's description
    policy_names: list[str] = field(default_factory=list)  # apply route: ByName patterns / classes
    apply_reentrant: bool = False
    apply_storage: tuple[str, int] | None = None  # apply route: boundary offload (storage, prefetch)
    recorded: bool = False  # forward hooks keep every linear output; an extra loss differentiates them
    weights_changed: bool = False  # every trainable weight changed in place between forward and backward
    interrupted: bool = False  # a first step's backward is stopped by KeyboardInterrupt from a hook

    def describe(self) -> str:
        lines = [f"seed {self.seed}: route={self.route}, x requires_grad={self.input_requires_grad}, "
                 f"const requires_grad={self.const_requires_grad}, gradients by {self.grad_mode}"]
        if self.changed_after_forward is not None:
            lines.append(f"after forward: output of top-level call {self.changed_after_forward} multiplied by 2 "
                         "in place under no_grad, then dropped")
        if self.recorded:
            lines.append("forward hooks keep every linear output; loss += 0.01 * mean square of each")
        if self.weights_changed:
            lines.append("after forward: every trainable weight += 0.01 in place under no_grad")
        if self.interrupted:
            lines.append("first a step whose backward KeyboardInterrupt stops halfway (caught), then the step")
        if self.offload:
            storage, prefetch, min_bytes = self.offload
            lines.append(f"forward under acshim.offload(storage={storage!r}, prefetch={prefetch}, "
                         f"min_bytes={min_bytes})")
        if self.route == "apply":
            storage = ""
            if self.apply_storage:
                storage = f", storage={self.apply_storage[0]!r}, prefetch={self.apply_storage[1]}"
            lines.append(f"acshim.apply_checkpointing(model, {self.policy}, "
                         f"reentrant={self.apply_reentrant}{storage})")
        for index, block in enumerate(self.blocks):
            lines += block.describe(f"blocks.{index}", 2, self.route)
        lines.append("  head: linear (trainable)")
        return "\n".join(lines)

    def short_id(self) -> str:
        parts = [f"seed{self.seed}", self.route]
        if self.route == "apply":
            parts.append(self.policy.split("(")[0] + ("-R" if self.apply_reentrant else "-NR"))
            if self.apply_storage:
                parts.append(f"{self.apply_storage[0]}{self.apply_storage[1]}")
        if self.offload:
            parts.append(f"offload-{self.offload[0]}{self.offload[1]}")
        return "-".join(parts)


def _all_blocks(blocks: list[BlockSpec], prefix: str = "blocks") -> list[tuple[str, BlockSpec]]:
    found = []
    for index, block in enumerate(blocks):
        name = f"{prefix}.{index}"
        found.append((name, block))
        found += _all_blocks(block.children, f"{name}.inner")
    return found


def draw_case(seed: int) -> Case:
    rng = random.Random(seed)
    route = ROUTES[seed % len(ROUTES)]

    def draw_block(depth: int) -> BlockSpec:
        kinds = KINDS if depth < 2 else KINDS[:-1]
        spec = BlockSpec(kind=rng.choice(kinds), act=rng.choice(list(ACTIVATIONS)))
        spec.frozen = rng.random() < 0.25
        spec.region = rng.random() < 0.7
        spec.reentrant = rng.random() < 0.5
        spec.selective = route in ("checkpoint", "closure") and spec.region and not spec.reentrant \
            and rng.random() < 0.3
        spec.variant = rng.choice(VARIANTS[spec.kind]) if spec.kind in VARIANTS else ""
        spec.twice = rng.random() < 0.15
        if spec.kind == "kwargs":
            spec.kwargs_shift = rng.choice(["none", "const", "activation"])
            # torch's reentrant checkpoint takes no kwargs: users bind them (never a non-leaf activation,
            # which reentrant checkpointing cannot differentiate through a closure)
            spec.kwargs_partial = spec.reentrant and spec.kwargs_shift != "activation" and rng.random() < 0.7
        if spec.kind == "nest":
            spec.children = [draw_block(depth + 1) for _ in range(rng.randint(1, 3))]
        return spec

    blocks = [draw_block(0) for _ in range(rng.randint(2, 5))]
    draw = rng.random()
    case = Case(seed=seed, route=route, blocks=blocks, input_requires_grad=rng.random() < 0.5,
                const_requires_grad=rng.random() < 0.25,
                grad_mode=GRAD_MODES[1] if draw < 0.12 else GRAD_MODES[2] if draw < 0.24 else GRAD_MODES[0])
    if rng.random() < 0.35:
        case.offload = (rng.choice(["host", "disk"]), rng.choice([0, 1, 2]), rng.choice([0, 1024]))
    if rng.random() < 0.2:
        calls = sum(2 if block.twice else 1 for block in blocks)
        case.changed_after_forward = rng.randrange(calls - 1)  # one the next call takes (and may save)
    if route == "apply":
        names = [name for name, _ in _all_blocks(blocks)]
        classes = sorted({spec.kind for _, spec in _all_blocks(blocks)})
        choice = rng.choice(["ByName", "ByClass", "Predicate", "EveryNth", "glob"])
        if choice == "ByName":
            case.policy_names = sorted(rng.sample(names, rng.randint(1, len(names))))
            case.policy = "ByName(" + ", ".join(repr(n) for n in case.policy_names) + ")"
        elif choice == "glob":
            case.policy_names = ["blocks.*"]
            case.policy = "ByName('blocks.*')"
        elif choice == "ByClass":
            case.policy_names = sorted(rng.sample(classes, rng.randint(1, len(classes))))
            case.policy = "ByClass(" + ", ".join(KIND_CLASSES[k].__name__ for k in case.policy_names) + ")"
        elif choice == "Predicate":
            case.policy = "Predicate(lambda name, module: module has trainable parameters)"
        else:
            case.policy = "EveryNth(2, of=ByClass(all block classes))"
        case.apply_reentrant = rng.random() < 0.5
        if rng.random() < 0.3:
            case.apply_storage = (rng.choice(["host", "disk"]), rng.choice([0, 1, 2]))
    _draw_round_three(case)
    return case


VMAPPED_KINDS = ("mlp", "dropout", "inplace", "multi", "kwargs")
"""Blocks whose linear layer may run under ``torch.vmap`` (one row per call)."""


def _draw_round_three(case: Case) -> None:
    """Issue 28's classes, from a generator of their own: the draws above stay as they were."""
    rng = random.Random(case.seed + 10_000)
    for _, spec in _all_blocks(case.blocks):
        spec.vmapped = spec.kind in VMAPPED_KINDS and rng.random() < 0.25
    case.recorded = rng.random() < 0.3
    case.weights_changed = rng.random() < 0.25
    case.interrupted = rng.random() < 0.15


# ---------------------------------------------------------------------------------------------
# The model: blocks route their calls through a Router, which is the only thing that differs
# between the plain run, acshim's run and torch's run.


class Router:
    def __init__(self, engine: str, route: str) -> None:
        self.engine = engine  # "plain", "acshim" or "torch"
        self.route = route
        self.torch_regions: dict[int, bool] = {}  # apply route, torch engine: id(module) -> reentrant
        self.outputs: list[torch.Tensor] = []  # each top-level call's output, this step

    def call(self, block: Block, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        spec = block.spec
        function: Any = block
        if spec.kwargs_partial and kwargs:
            function, kwargs = functools.partial(block, **kwargs), {}
        if self.engine == "plain" or (self.route == "apply" and self.engine == "acshim"):
            return function(*args, **kwargs)  # apply route: acshim's regions are the modules themselves
        if self.route == "apply":
            if id(block) not in self.torch_regions:
                return function(*args, **kwargs)
            reentrant, context_fn = self.torch_regions[id(block)], torch_checkpoint.noop_context_fn
        else:
            if not spec.region:
                return function(*args, **kwargs)
            reentrant = spec.reentrant
            context_fn = acshim.selective.save_ops() if spec.selective else torch_checkpoint.noop_context_fn
        if self.route == "closure":  # the region's callable: a closure over the block (its modules in a cell)
            function = _closure_over(function)
        if self.engine == "torch":
            return torch_checkpoint.checkpoint(function, *args, use_reentrant=reentrant, context_fn=context_fn,
                                               **kwargs)
        if self.route in ("checkpoint", "closure"):
            return acshim.checkpoint(function, *args, use_reentrant=reentrant, context_fn=context_fn, **kwargs)
        return acshim.run_region(function, args, kwargs, acshim.RegionOptions(reentrant=reentrant))


def _closure_over(call: Any) -> Any:
    def region(*args: Any, **kwargs: Any) -> Any:
        return call(*args, **kwargs)

    return region


class RowwiseLinear(nn.Linear):
    """``nn.Linear`` applied to one row at a time under ``torch.vmap``."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.vmap(super().forward)(x)


class Block(nn.Module):
    def __init__(self, spec: BlockSpec) -> None:
        super().__init__()
        self.spec = spec
        self.linear = (RowwiseLinear if spec.vmapped else nn.Linear)(WIDTH, WIDTH)

    def act(self, x: torch.Tensor) -> torch.Tensor:
        return ACTIVATIONS[self.spec.act](x)

    def invoke(self, router: Router, x: torch.Tensor, const: torch.Tensor) -> torch.Tensor:
        """Call this block (through the router) and turn its output back into one activation."""
        return router.call(self, (x,), {})


class MLP(Block):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.act(self.linear(x)) + x


class DropoutBlock(Block):
    def __init__(self, spec: BlockSpec) -> None:
        super().__init__(spec)
        self.dropout = nn.Dropout(0.3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dropout(self.act(self.linear(x)))


class BatchNormBlock(Block):
    def __init__(self, spec: BlockSpec) -> None:
        super().__init__(spec)
        self.norm = nn.BatchNorm1d(WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.act(self.norm(self.linear(x)))


class InplaceBlock(Block):
    """In-place operations on the region's own intermediates."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.linear(x)
        h.mul_(0.5).add_(1.0)
        h = self.act(h) * 2.0
        h[:, :3] = 0.0
        return h


class MultiBlock(Block):
    """Nested and non-tensor inputs, nested and non-tensor outputs."""

    def __init__(self, spec: BlockSpec) -> None:
        super().__init__(spec)
        self.side = nn.Linear(WIDTH, WIDTH)

    def forward(self, x: torch.Tensor, extra: dict[str, Any], tag: str) -> tuple[Any, ...]:
        hidden = self.act(self.linear(x) + extra["skip"])
        aux = self.side(hidden) * extra["gain"]
        return hidden, {"aux": aux, "count": 2, "tag": tag, "parts": (aux.tanh(), None)}, 7

    def invoke(self, router: Router, x: torch.Tensor, const: torch.Tensor) -> torch.Tensor:
        hidden, out, seven = router.call(self, (x, {"skip": const, "gain": 0.5}, "multi"), {})
        assert out["tag"] == "multi" and seven == 7 and out["parts"][1] is None
        return hidden + out["aux"] * out["count"] + out["parts"][0]


class KwargsBlock(Block):
    def forward(self, x: torch.Tensor, *, scale: float = 1.0, shift: torch.Tensor | None = None) -> torch.Tensor:
        y = self.act(self.linear(x)) * scale
        return y if shift is None else y + shift

    def invoke(self, router: Router, x: torch.Tensor, const: torch.Tensor) -> torch.Tensor:
        kwargs: dict[str, Any] = {"scale": 1.5}
        if self.spec.kwargs_shift == "const":
            kwargs["shift"] = const
        elif self.spec.kwargs_shift == "activation":
            kwargs["shift"] = x * 0.25
        return router.call(self, (x,), kwargs)


class NestBlock(Block):
    """Runs child blocks, each through the router: regions inside regions."""

    def __init__(self, spec: BlockSpec) -> None:
        super().__init__(spec)
        self.inner = nn.ModuleList(build_block(child) for child in spec.children)
        self.router: list[Router] = []  # set by the model; a list keeps it out of the module tree

    def forward(self, x: torch.Tensor, const: torch.Tensor) -> torch.Tensor:
        h = self.act(self.linear(x))
        for child in self.inner:
            for _ in range(2 if child.spec.twice else 1):
                h = child.invoke(self.router[0], h, const)
        return h + x

    def invoke(self, router: Router, x: torch.Tensor, const: torch.Tensor) -> torch.Tensor:
        return router.call(self, (x, const), {})


class SpectralBlock(Block):
    """Spectral norm: a power iteration updates ``u``/``v`` in every training forward."""

    def __init__(self, spec: BlockSpec) -> None:
        super().__init__(spec)
        norm = nn.utils.spectral_norm if spec.variant == "utils.spectral_norm" else \
            nn.utils.parametrizations.spectral_norm
        self.linear = norm(self.linear)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.act(self.linear(x)) + x


class StatefulBlock(Block):
    """A buffer the forward changes: a running average updated in place and used, a buffer
    reassigned, or an integer counter bumped in place that scales the output."""

    def __init__(self, spec: BlockSpec) -> None:
        super().__init__(spec)
        if spec.variant == "counter":
            self.register_buffer("state", torch.zeros((), dtype=torch.long))
        else:
            self.register_buffer("state", torch.ones(WIDTH) if spec.variant == "reassigned" else torch.zeros(WIDTH))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.spec.variant == "average":
            h = self.linear(x)
            with torch.no_grad():
                self.state.mul_(0.5).add_(h.mean(0), alpha=0.5)
            return self.act(h - self.state)
        if self.spec.variant == "reassigned":
            self.state = self.state * 0.75 + x.detach().abs().mean(0) * 0.25
            return self.act(self.linear(x * self.state))
        self.state += 1
        return self.act(self.linear(x)) * (1.0 + 0.25 * self.state)


class LSTMBlock(Block):
    """CPU LSTM takes another kernel under no_grad than with grad."""

    def __init__(self, spec: BlockSpec) -> None:
        super().__init__(spec)
        self.lstm = nn.LSTM(WIDTH, WIDTH, batch_first=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lstm(self.linear(x).unsqueeze(0))[0].squeeze(0) + x


KIND_CLASSES: dict[str, type[Block]] = {"mlp": MLP, "dropout": DropoutBlock, "batchnorm": BatchNormBlock,
                                        "inplace": InplaceBlock, "multi": MultiBlock, "kwargs": KwargsBlock,
                                        "spectral": SpectralBlock, "stateful": StatefulBlock, "lstm": LSTMBlock,
                                        "nest": NestBlock}


def build_block(spec: BlockSpec) -> Block:
    block = KIND_CLASSES[spec.kind](spec)
    if spec.frozen:
        block.requires_grad_(False)
    return block


class RandomNet(nn.Module):
    def __init__(self, case: Case, router: Router) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(build_block(spec) for spec in case.blocks)
        self.head = nn.Linear(WIDTH, 3)
        self.router = router
        for module in self.modules():
            if isinstance(module, NestBlock):
                module.router.append(router)

    def forward(self, x: torch.Tensor, const: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            for _ in range(2 if block.spec.twice else 1):
                x = block.invoke(self.router, x, const)
                self.router.outputs.append(x)
        return self.head(x)


# ---------------------------------------------------------------------------------------------
# One training step, three ways.


def _policy(case: Case) -> acshim.Policy:
    if case.policy.startswith("ByName"):
        return acshim.ByName(*case.policy_names)
    if case.policy.startswith("ByClass"):
        return acshim.ByClass(*(KIND_CLASSES[k] for k in case.policy_names))
    if case.policy.startswith("Predicate"):
        return acshim.Predicate(lambda name, module: isinstance(module, Block)
                                and any(p.requires_grad for p in module.parameters()))
    return acshim.EveryNth(2, of=acshim.ByClass(*KIND_CLASSES.values()))


def run_step(case: Case, engine: str, directory: Path) -> dict[str, torch.Tensor]:
    """Build the case's model (same weights every time), run one forward/backward, return every
    gradient (parameters and input), the loss and every buffer."""
    router = Router(engine, case.route)
    torch.manual_seed(case.seed)
    model = RandomNet(case, router)
    x = torch.randn(BATCH, WIDTH, requires_grad=case.input_requires_grad)
    const = torch.randn(BATCH, WIDTH, requires_grad=case.const_requires_grad)
    if engine == "torch" and case.route == "apply":  # torch's checkpoint on the modules acshim would pick
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            names = acshim.apply_checkpointing(model, _policy(case))
        acshim.remove_checkpointing(model)
        modules = dict(model.named_modules())
        router.torch_regions = {id(modules[name]): case.apply_reentrant for name in names}
    if engine == "acshim" and case.route == "apply":
        storage = {}
        if case.apply_storage:
            storage = {"storage": case.apply_storage[0], "prefetch": case.apply_storage[1],
                       "directory": str(directory)}
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # a policy that selects nothing warns; still a valid case
            acshim.apply_checkpointing(model, _policy(case), reentrant=case.apply_reentrant, **storage)
    scope: contextlib.AbstractContextManager[Any] = contextlib.nullcontext()
    if engine == "acshim" and case.offload:
        storage_name, prefetch, min_bytes = case.offload
        scope = acshim.offload(storage=storage_name, prefetch=prefetch, min_bytes=min_bytes,
                               directory=str(directory))
    model.train()
    recorded = _record_linear_outputs(model) if case.recorded else None
    if case.interrupted:
        _interrupted_step(case, model, router, x, const, scope, directory, engine)
    torch.manual_seed(case.seed + 1000)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch's reentrant checkpoint warns when no input needs grad
        with scope, recorded or contextlib.nullcontext():
            out = model(x, const)
        if case.changed_after_forward is not None:
            with torch.no_grad():
                router.outputs[case.changed_after_forward].mul_(2.0)
        router.outputs.clear()  # the changed tensor lives on only where autograd or a region saved it
        loss = (out * torch.linspace(-1.0, 1.0, out.shape[-1])).square().mean()
        if recorded is not None:
            loss = loss + 0.01 * sum((kept.square().mean() for kept in recorded.kept), torch.zeros(()))
            recorded.kept.clear()
        if case.weights_changed:
            with torch.no_grad():
                for param in model.blocks.parameters():
                    if param.requires_grad:
                        param.add_(0.01)
        leaves = {name: param for name, param in model.named_parameters() if param.requires_grad}
        leaves.update({name: tensor for name, tensor in (("input", x), ("const", const)) if tensor.requires_grad})
        if case.grad_mode == "backward":
            loss.backward()
            grads = {name: leaf.grad for name, leaf in leaves.items()}
        elif case.grad_mode == "backward(inputs=...)":
            loss.backward(inputs=list(leaves.values()))
            grads = {name: leaf.grad for name, leaf in leaves.items()}
        else:
            values = torch.autograd.grad(loss, list(leaves.values()), allow_unused=True)
            grads = dict(zip(leaves, values))
    state = {"loss": loss.detach().clone()}
    for name, grad in grads.items():
        if grad is not None:
            state[f"grad:{name}"] = grad.clone()
    for name, buffer in model.named_buffers():
        state[f"buffer:{name}"] = buffer.clone()
    return state


class _Recorder:
    """Forward hooks on every block's linear layer keep its outputs while the forward runs (as Hugging
    Face's output recorder keeps router logits); a recompute in backward adds nothing."""

    def __init__(self, model: nn.Module) -> None:
        self.kept: list[torch.Tensor] = []
        self.on = False
        for module in model.blocks.modules():
            if isinstance(module, Block):
                module.linear.register_forward_hook(self._hook)

    def _hook(self, module: nn.Module, args: Any, output: torch.Tensor) -> None:
        if self.on and output.requires_grad:
            self.kept.append(output)

    def __enter__(self) -> None:
        self.on = True

    def __exit__(self, *exc: Any) -> None:
        self.on = False


def _record_linear_outputs(model: nn.Module) -> _Recorder:
    return _Recorder(model)


def _interrupted_step(case: Case, model: nn.Module, router: Router, x: torch.Tensor, const: torch.Tensor,
                      scope: Any, directory: Path, engine: str) -> None:
    """A step whose backward KeyboardInterrupt stops halfway, caught as a script would, its graph still
    held: the disk tier must hold no descriptor then; gradients and recorded outputs are reset."""
    torch.manual_seed(case.seed + 500)
    before = set(open_descriptors_in(directory))  # an earlier case's graph may still be collected
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with scope:
            out = model(x, const)
        hooked = [t for t in router.outputs if t.requires_grad]
        router.outputs.clear()
        if not hooked:
            return
        target = hooked[len(hooked) // 2]
        target.register_hook(lambda grad: (_ for _ in ()).throw(KeyboardInterrupt()))
        loss = (out * torch.linspace(-1.0, 1.0, out.shape[-1])).square().mean()
        try:
            loss.backward()
        except KeyboardInterrupt:
            pass
        else:
            raise AssertionError("the interrupt never fired")
        if engine == "acshim":
            left = set(open_descriptors_in(directory)) - before
            assert not left, f"descriptors left open after an interrupted backward:\n{case.describe()}"
        del loss, out, target, hooked
    model.zero_grad(set_to_none=True)
    x.grad = const.grad = None


REENTRANT_GRAD_ERROR = "When use_reentrant=True, torch.utils.checkpoint is incompatible with .grad()"


def has_reentrant(case: Case) -> bool:
    if case.route == "apply":
        return case.apply_reentrant
    return any(spec.region and spec.reentrant for _, spec in _all_blocks(case.blocks))


def torch_failure(case: Case, expected: dict[str, torch.Tensor], directory: Path) -> Exception | None:
    """What ``torch.utils.checkpoint`` raises in the case's configuration, or None. Where torch's run
    silently loses gradients (its reentrant regions drop out of the graph when no input needs grad;
    acshim keeps them in), the configuration is run again with the input requiring grad, so torch's
    regions are differentiated as acshim's are."""
    try:
        torch_state = run_step(case, "torch", directory)
    except Exception as error:
        return error
    if set(expected) - set(torch_state) and not case.input_requires_grad:
        try:
            run_step(dataclasses.replace(case, input_requires_grad=True), "torch", directory)
        except Exception as error:
            return error
    return None


def _error_text(error: BaseException) -> str:
    return f"{type(error).__name__}: {error}"


SEEDS = list(range(48))
# Cases that hit a known defect owned elsewhere: seed -> reason (xfail strict).
KNOWN: dict[int, str] = {}


def _params() -> list[Any]:
    params = []
    for seed in SEEDS:
        case = draw_case(seed)
        marks = [pytest.mark.xfail(strict=True, reason=KNOWN[seed])] if seed in KNOWN else []
        params.append(pytest.param(case, id=case.short_id(), marks=marks))
    return params


IN_PLACE_ERROR = "one of the variables needed for gradient computation has been modified by an inplace operation"
RECOMPUTE_READ = "before backward recomputed that region"


@pytest.mark.parametrize("case", _params())
def test_random_configuration_matches_the_run_without_checkpointing(case: Case, tmp_path: Path) -> None:
    try:
        expected = run_step(case, "plain", tmp_path)
    except RuntimeError as plain_error:  # a saved tensor changed after the forward: so must acshim fail
        assert (case.changed_after_forward is not None or case.weights_changed) and str(plain_error).startswith(
            IN_PLACE_ERROR), plain_error
        with pytest.raises(Exception) as raised:
            run_step(case, "acshim", tmp_path)
        reentrant_grad = case.grad_mode != "backward" and has_reentrant(case)  # either torch error comes first
        if not isinstance(raised.value, RuntimeError) or not (str(raised.value).startswith(IN_PLACE_ERROR) or (
                reentrant_grad and str(raised.value).startswith(REENTRANT_GRAD_ERROR))):
            torch_error = torch_failure(case, {}, tmp_path)  # torch's checkpoint refuses the configuration first
            assert torch_error is not None and type(raised.value) is type(torch_error) and str(
                raised.value).startswith(str(torch_error)), (
                f"acshim: {_error_text(raised.value)}\nplain: {_error_text(plain_error)}\n{case.describe()}")
        return
    try:
        actual = run_step(case, "acshim", tmp_path)
    except Exception as error:  # acshim may only fail where torch fails, with torch's error
        if str(error).startswith(REENTRANT_GRAD_ERROR) and case.grad_mode != "backward" and has_reentrant(case):
            return  # torch's own error for .grad() / inputs= through a reentrant region
        if case.weights_changed and str(error).startswith(IN_PLACE_ERROR) and RECOMPUTE_READ in str(error):
            return  # a recompute would read a changed weight that the plain run did not save: refused
        torch_error = torch_failure(case, expected, tmp_path)
        if torch_error is None:
            raise AssertionError(f"acshim raised where torch.utils.checkpoint works:\n{case.describe()}") from error
        # the same exception type, acshim's message torch's (maybe with advice appended)
        assert type(error) is type(torch_error) and str(error).startswith(str(torch_error)), (
            f"acshim's error differs from torch's:\n{case.describe()}\n"
            f"acshim: {_error_text(error)}\ntorch: {_error_text(torch_error)}")
        return
    try:
        assert_equivalent(case, expected, actual)
    except AssertionError as failure:
        raise AssertionError(f"{failure}\n\nconfiguration:\n{case.describe()}") from None


def split_sum_keys(case: Case, keys: set[str]) -> set[str]:
    """Gradients a reentrant region sums in another grouping than one backward does, so they are
    equal up to rounding only (torch's reentrant checkpoint gives the very same values as acshim's).

    An input tensor used several times inside a reentrant region gets the sum of those uses from
    the region's own backward, which autograd then adds to the gradient of its other uses: a use
    outside and two inside are added (g3 + g2) + g1 by one backward, g3 + (g2 + g1) here. Parameters
    do not differ (one alias per access, ``acshim.region_aliases``). Here: the second input
    ``const``, used by many blocks, when the case has a reentrant region."""
    regions = [spec for _, spec in _all_blocks(case.blocks) if spec.region]
    if not (case.apply_reentrant if case.route == "apply" else any(spec.reentrant for spec in regions)):
        return set()
    return {key for key in keys if key == "grad:const"}


def assert_equivalent(case: Case, expected: dict[str, torch.Tensor], actual: dict[str, torch.Tensor]) -> None:
    """Bitwise equal step states, except the sums ``split_sum_keys`` explains: equal to rounding."""
    assert set(expected) == set(actual), f"missing or extra: {sorted(set(expected) ^ set(actual))}"
    loose = split_sum_keys(case, set(expected))
    assert_bitwise_equal({k: v for k, v in expected.items() if k not in loose},
                         {k: v for k, v in actual.items() if k not in loose})
    for key in sorted(loose):
        torch.testing.assert_close(actual[key], expected[key], rtol=1e-5, atol=1e-7,
                                   msg=lambda text, key=key: f"{key} (a sum split by a reentrant region): {text}")


@pytest.mark.parametrize("context_fn", ["save_ops", "save_ops_every_other_mm"])
def test_batchnorm_in_a_selective_region_matches_the_plain_run(context_fn: str) -> None:
    """Found by seed 15: the recompute's BatchNorm statistics snapshot (a clone) ran inside the
    selective recompute mode, which rejects operators the forward did not run."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 6), nn.BatchNorm1d(6), nn.Tanh(), nn.Linear(6, 2))
    x = torch.randn(8, 6, requires_grad=True)
    state = {name: value.clone() for name, value in model.state_dict().items()}
    expected = acshim.testing.train_step(model, x)
    model.load_state_dict(state)
    model.zero_grad(set_to_none=True)
    select = acshim.selective.save_ops(**({"recompute_every_other": ["aten.mm.default"]}
                                           if context_fn.endswith("mm") else {}))

    class Region(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return acshim.checkpoint(model, x, context_fn=select)

    actual = acshim.testing.train_step(Region(), x)
    actual.update({f"grad:{n}": p.grad for n, p in model.named_parameters()})
    actual.update({f"buffer:{n}": b for n, b in model.named_buffers()})
    assert_bitwise_equal(expected, actual)


def test_shared_weights_are_summed_as_one_backward_sums_them_input_sums_as_torch_reentrant() -> None:
    """Why ``split_sum_keys`` names only ``const``: a weight used four times, twice inside each of
    two reentrant regions, gets bitwise the plain run's gradient (torch's reentrant checkpoint adds
    per region); an input used twice in a reentrant region and once more after it is summed per
    region, as torch's reentrant checkpoint does, within the re-association bound of the plain sum."""
    torch.manual_seed(0)
    linear = nn.Linear(8, 8)
    x = torch.randn(4, 8, requires_grad=True)

    def inner(h: torch.Tensor) -> torch.Tensor:
        return linear(linear(h).tanh()).tanh()

    def weight_grad(region: Any) -> torch.Tensor:
        linear.zero_grad(set_to_none=True)
        region(inner, region(inner, x)).square().sum().backward()
        return linear.weight.grad.clone()

    plain = weight_grad(lambda fn, h: fn(h))
    assert torch.equal(weight_grad(lambda fn, h: acshim.checkpoint(fn, h, use_reentrant=True)), plain)
    assert torch.equal(weight_grad(lambda fn, h: acshim.checkpoint(fn, h, use_reentrant=False)), plain)
    assert not torch.equal(weight_grad(lambda fn, h: torch_checkpoint.checkpoint(fn, h, use_reentrant=True)), plain)

    c = torch.randn(4, 8, requires_grad=True)

    def uses(h: torch.Tensor, c1: torch.Tensor, c2: torch.Tensor) -> torch.Tensor:
        return linear((h * c1).tanh() + c2.sin())

    def const_grad(region: Any) -> torch.Tensor:
        c.grad = None
        (region(uses, x, c, c) * c.cos()).square().sum().backward()
        return c.grad.clone()

    plain_c = const_grad(lambda fn, *a: fn(*a))
    acshim_c = const_grad(lambda fn, *a: acshim.checkpoint(fn, *a, use_reentrant=True))
    assert torch.equal(acshim_c, const_grad(lambda fn, *a: torch_checkpoint.checkpoint(fn, *a, use_reentrant=True)))
    assert torch.equal(const_grad(lambda fn, *a: acshim.checkpoint(fn, *a, use_reentrant=False)), plain_c)
    # the three terms, apart: two sums of the same three float32 terms differ by at most 4 eps sum|term|
    parts = [p.detach().clone().requires_grad_() for p in (c, c, c)]
    terms = torch.autograd.grad((uses(x, parts[0], parts[1]) * parts[2].cos()).square().sum(), parts)
    bound = 4 * torch.finfo(torch.float32).eps * sum(t.abs() for t in terms)
    assert ((acshim_c - plain_c).abs() <= bound).all()
    case = Case(seed=0, route="checkpoint", input_requires_grad=True, const_requires_grad=True, blocks=[
        BlockSpec(kind="nest", act="tanh", region=True, reentrant=True, twice=True,
                  children=[BlockSpec(kind="mlp", act="tanh")]),
        BlockSpec(kind="mlp", act="tanh", region=True)])
    keys = {"grad:blocks.0.linear.weight", "grad:blocks.0.inner.0.linear.bias", "grad:const", "grad:input"}
    assert split_sum_keys(case, keys) == {"grad:const"}
    case.blocks[0].reentrant = False
    assert split_sum_keys(case, keys) == set()


def test_generator_covers_every_feature() -> None:
    """The fixed seeds exercise every route, block kind, mode, offload tier and horizon."""
    cases = [draw_case(seed) for seed in SEEDS]
    specs = [spec for case in cases for _, spec in _all_blocks(case.blocks)]
    assert {case.route for case in cases} == set(ROUTES)
    assert {spec.kind for spec in specs} == set(KINDS)
    assert {(spec.region, spec.reentrant) for spec in specs} == {(r, m) for r in (True, False) for m in (True, False)}
    assert any(spec.frozen for spec in specs) and {case.input_requires_grad for case in cases} == {True, False}
    assert {(c.offload[0], c.offload[1]) for c in cases if c.offload} == {
        (s, p) for s in ("host", "disk") for p in (0, 1, 2)}
    assert {c.apply_storage[0] for c in cases if c.apply_storage} == {"host", "disk"}
    assert {c.policy.split("(")[0] for c in cases if c.route == "apply"} >= {"ByName", "ByClass", "Predicate",
                                                                              "EveryNth"}
    assert {c.apply_reentrant for c in cases if c.route == "apply"} == {True, False}
    # nesting of regions: a region block whose children include a region
    assert any(spec.region and any(child.region for child in spec.children) for spec in specs)
    assert {spec.kwargs_shift for spec in specs if spec.kind == "kwargs"} == {"none", "const", "activation"}
    assert any(spec.kwargs_partial for spec in specs) and any(spec.selective for spec in specs)
    assert any(spec.twice for spec in specs) and any(case.const_requires_grad for case in cases)
    assert {case.grad_mode for case in cases} == set(GRAD_MODES)
    assert {(spec.kind, spec.variant) for spec in specs if spec.kind in VARIANTS} == {
        (kind, variant) for kind, variants in VARIANTS.items() for variant in variants}
    assert any(case.changed_after_forward is not None and case.offload for case in cases)
    assert any(case.route == "closure" and case.grad_mode != "backward" and has_reentrant(case) for case in cases)
    assert any(spec.kind == "lstm" and spec.region and spec.reentrant for spec in specs)
    # issue 28's classes: vmap inside reentrant and non-reentrant regions, recorded outputs under
    # reentrant regions, weights changed before backward, an interrupted backward on the disk tier
    assert {spec.reentrant for spec in specs if spec.vmapped and spec.region} == {True, False}
    assert any(case.recorded and has_reentrant(case) for case in cases)
    assert any(case.weights_changed and has_reentrant(case) for case in cases)
    assert any(case.weights_changed and not has_reentrant(case) for case in cases)
    assert any(case.interrupted and ((case.offload and case.offload[0] == "disk")
                                     or (case.apply_storage and case.apply_storage[0] == "disk")) for case in cases)


def test_a_wrong_gradient_is_caught() -> None:
    """The comparison can fail: a region whose recompute draws a different dropout mask."""
    case = Case(seed=0, route="checkpoint", input_requires_grad=True,
                blocks=[BlockSpec(kind="dropout", act="tanh", region=True, reentrant=False)])
    expected = run_step(case, "plain", Path("."))
    original = acshim.RegionOptions.__init__

    def no_rng(self: acshim.RegionOptions, *args: Any, **kwargs: Any) -> None:
        original(self, *args, **kwargs)
        object.__setattr__(self, "preserve_rng_state", False)  # a frozen dataclass

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(acshim.RegionOptions, "__init__", no_rng)
        actual = run_step(case, "acshim", Path("."))
    with pytest.raises(AssertionError):
        assert_bitwise_equal(expected, actual)


def test_failure_message_describes_the_case() -> None:
    text = draw_case(5).describe()
    assert text.startswith("seed 5: route=") and "blocks.0:" in text and "head" in text


def _disk_cases(count: int) -> list[Case]:
    found = []
    for seed in range(1000, 2000):  # seeds of their own: the fork cases are drawn, not picked
        case = draw_case(seed)
        if (case.offload and case.offload[0] == "disk" and case.changed_after_forward is None
                and not case.weights_changed and case.grad_mode == "backward"):
            found.append(case)
            if len(found) == count:
                break
    return found


_FORK_DRIVER = """
import multiprocessing, sys
from pathlib import Path
import torch
torch.set_num_threads(1)  # a parent that used intra-op threads cannot fork safely (OpenMP), torch or not
sys.path.insert(0, sys.argv[1])
import test_random_equivalence as T
cases, directory = T._disk_cases(4), Path(sys.argv[2])
failures = T._run_cases(cases[:2], directory)
context = multiprocessing.get_context("fork")
results = context.Queue()
child = context.Process(target=lambda: results.put(T._run_cases(cases[2:], directory)))
child.start()
try:
    failures += results.get(timeout=120)
except Exception:
    failures.append("the forked child did not finish within 120 s")
child.join(timeout=10)
if child.is_alive():
    child.kill()
print("FAILURES", failures)
"""


def _run_cases(cases: list[Case], directory: Path) -> list[str]:
    failures = []
    for case in cases:
        try:
            assert_equivalent(case, run_step(case, "plain", directory), run_step(case, "acshim", directory))
        except Exception as error:
            failures.append(f"{case.short_id()}: {_error_text(error)}")
    return failures


@pytest.mark.skipif(not hasattr(os, "fork"), reason="fork is POSIX")
def test_random_disk_offload_cases_match_in_a_child_forked_after_the_parent_offloaded(tmp_path: Path) -> None:
    """The fork class of issue 16 drawn at random: a parent trains drawn cases on the disk tier, then a
    forked child (torch.multiprocessing's fork pattern) trains other drawn cases on it: bitwise equal
    to the run without checkpointing, and the child finishes (it used to hang on the parent's I/O
    workers). A fresh process: the test process's intra-op threads would hang a forked child, torch
    or not."""
    import subprocess
    import sys

    assert len(_disk_cases(4)) == 4
    done = subprocess.run([sys.executable, "-c", _FORK_DRIVER, str(Path(__file__).parent), str(tmp_path)],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "FAILURES []" in done.stdout, done.stdout[-3000:] + done.stderr[-3000:]
