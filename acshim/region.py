"""The engine's region: run a callable so that its activations are recomputed in backward.

Non-reentrant regions stand on ``torch.utils.checkpoint.checkpoint(use_reentrant=False)``; the
callable is wrapped so the region also restores tracker RNG streams, keeps BatchNorm statistics
updated once, and exposes ``is_checkpointing()`` / ``is_recomputing()``. Reentrant regions use a
small ``autograd.Function`` of our own because torch's reentrant ``CheckpointFunction`` ignores
tensors nested in containers, drops non-tensor outputs' structure and gives parameters no gradient
when no input requires grad; ours handles all three (flattening with ``acshim.structures``).
"""

from __future__ import annotations

import contextlib
import functools
import inspect
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.utils.checkpoint as torch_checkpoint
from torch.nn.modules.batchnorm import _BatchNorm

from . import compiled, region_state, rng, selective, structures
from .batchnorm import running_stats_frozen
from .options import DEFAULT_OPTIONS, RegionOptions
from .state import _flag, enable_checkpointing, enable_recomputing, state

TORCH_CHECKPOINT = torch_checkpoint.checkpoint
"""torch's own ``checkpoint``, bound at import: the engine always calls this one, so routing the
script's ``torch.utils.checkpoint.checkpoint`` calls to the engine (``acshim.patching.torch_route``)
cannot make the engine call itself."""
_TORCH_CHECKPOINT_PARAMS = inspect.signature(TORCH_CHECKPOINT).parameters
TORCH_HAS_EARLY_STOP = "early_stop" in _TORCH_CHECKPOINT_PARAMS

REENTRANT_GRAD_ERROR = (
    "When use_reentrant=True, torch.utils.checkpoint is incompatible with .grad() or passing an "
    "`inputs` parameter to .backward(). To resolve this error, you can either set "
    "use_reentrant=False, or call .backward() without passing the `inputs` argument."
)


@dataclass
class RegionStats:
    """Process-wide counts of region forwards and recomputes: evidence that a script really ran
    on the engine (``acshim run`` prints them at exit when ``ACSHIM_REPORT_REGIONS=1``)."""

    forwards: int = 0
    recomputes: int = 0
    recorder: Any = None
    """``acshim run --report``'s per-region recorder (``acshim.report``): ``call`` at each region
    call, ``forward`` / ``recompute`` as the engine runs them."""

    def forward(self, function: Callable[..., Any]) -> None:
        self.forwards += 1
        if self.recorder is not None:
            self.recorder.forward(function)

    def recompute(self, function: Callable[..., Any]) -> None:
        self.recomputes += 1
        if self.recorder is not None:
            self.recorder.recompute(function)

    def __str__(self) -> str:
        return f"acshim: {self.forwards} region forwards, {self.recomputes} recomputes"


STATS = RegionStats()

ROUTERS: list[Any] = []
"""At most one router (``acshim run --budget``'s plan session, ``acshim.planner.session``): every
region call goes to ``router.route(function, args, kwargs, options)``, which decides how the region
runs (keep, selective, recompute, offload) and calls ``run_region_now`` for the engine's part."""


def run_region(
    function: Callable[..., Any],
    args: tuple[Any, ...] = (),
    kwargs: dict[str, Any] | None = None,
    options: RegionOptions = DEFAULT_OPTIONS,
) -> Any:
    """Call ``function(*args, **kwargs)`` as one checkpointed region and return its output.

    Nothing inside the region is kept for backward except its inputs; backward recomputes it. With
    grad disabled, or inside ``disable_checkpointing()``, this is a plain call.
    """
    kwargs = kwargs or {}
    if state.is_checkpointing_disabled or not torch.is_grad_enabled():
        return function(*args, **kwargs)
    if STATS.recorder is not None and not compiled.is_compiling():  # the recorder's frame walk would break graphs
        STATS.recorder.call(function, args, kwargs, options)
    if ROUTERS and not compiled.is_compiling():
        return ROUTERS[-1].route(function, args, kwargs, options)
    return run_region_now(function, args, kwargs, options)


def run_region_now(function: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any],
                   options: RegionOptions) -> Any:
    """``run_region`` past the router (grad enabled, checkpointing not disabled)."""
    args, kwargs = region_state.region_inputs(function, args, kwargs)  # no cache written twice
    if compiled.is_compiling():
        return compiled.run_traced(function, args, kwargs, options)
    scope = options.saved_tensors_scope() if options.saved_tensors_scope else contextlib.nullcontext()
    with scope:
        if options.reentrant:
            return _run_reentrant(function, args, kwargs, options)
        return _run_non_reentrant(function, args, kwargs, options)


# --------------------------------------------------------------------------------------------------
# non-reentrant: torch.utils.checkpoint does the recompute; _RegionCall adds what it lacks


class _RegionCall:
    """The callable handed to torch's checkpoint: first call is the forward, later ones recompute."""

    def __init__(self, function: Callable[..., Any], options: RegionOptions) -> None:
        self.function = function
        self.options = options
        self.calls = 0
        self.tracker_states = rng.capture_tracker_states() if options.preserve_rng_state else []

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        self.calls += 1
        observer = self.options.observer
        if self.calls == 1:
            STATS.forward(self.function)
            _notify(observer, "forward_start", self.function)
            with enable_checkpointing():
                output = self.function(*args, **kwargs)
            _notify(observer, "forward_end", self.function)
            return output
        with contextlib.ExitStack() as stack:
            if self.tracker_states:
                stack.enter_context(rng.restored_tracker_states(self.tracker_states))
            stack.enter_context(_flag("is_checkpointing", False))
            stack.enter_context(enable_recomputing())
            stack.enter_context(_batchnorm_guard(self.function))
            STATS.recompute(self.function)
            _notify(observer, "recompute_start", self.function)
            # torch stops an early-stopped recompute with an exception: report the end regardless
            stack.callback(_notify, observer, "recompute_end", self.function)
            return self.function(*args, **kwargs)


def _run_non_reentrant(
    function: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any], options: RegionOptions
) -> Any:
    extra: dict[str, Any] = {}
    early_stop_context: contextlib.AbstractContextManager[Any] = contextlib.nullcontext()
    if TORCH_HAS_EARLY_STOP:
        extra["early_stop"] = options.early_stop
    elif not options.early_stop:
        early_stop_context = torch_checkpoint.set_checkpoint_early_stop(False)
    with early_stop_context:
        return TORCH_CHECKPOINT(
            _RegionCall(function, options),
            *args,
            use_reentrant=False,
            preserve_rng_state=options.preserve_rng_state,
            context_fn=selective.honour_offload(options.context_fn) or torch_checkpoint.noop_context_fn,
            determinism_check=options.determinism_check,
            debug=options.debug,
            **extra,
            **kwargs,
        )


# --------------------------------------------------------------------------------------------------
# reentrant: our own autograd.Function


class _ReentrantSpec:
    """What the Function needs besides the input tensors, and what the caller needs afterwards."""

    __slots__ = ("function", "options", "leaves", "rebuild_inputs", "positions", "rebuild_output",
                 "output_leaves", "output_positions", "probe", "parameter_slots")

    def __init__(self, function: Callable[..., Any], options: RegionOptions, leaves: list[Any],
                 rebuild_inputs: structures.Rebuild, positions: list[int]) -> None:
        self.function = function
        self.options = options
        self.leaves = leaves
        self.rebuild_inputs = rebuild_inputs
        self.positions = positions
        self.rebuild_output: structures.Rebuild | None = None
        self.output_leaves: list[Any] = []
        self.output_positions: list[int] = []
        self.probe = False
        """Run the forward with grad enabled (saving nothing) to learn whether any output depends
        on a tensor that requires grad; a region none of whose outputs does needs no backward."""
        self.parameter_slots: list[list[tuple[torch.nn.Module, str]]] = []
        """Where each trainable parameter handed to the Function lives (tied ones: several places)."""

    def call(self, tensors: tuple[torch.Tensor, ...]) -> Any:
        leaves = list(self.leaves)
        for position, tensor in zip(self.positions, tensors):
            leaves[position] = tensor
        args, kwargs = self.rebuild_inputs(leaves)
        return self.function(*args, **kwargs)


def _device_type_of(tensors: tuple[torch.Tensor, ...]) -> str:
    for tensor in tensors:
        if tensor.device.type not in ("cpu", "meta"):
            return tensor.device.type
    return rng.default_device_type()


def _autocast_contexts(device_type: str) -> list[dict[str, Any]]:
    contexts = []
    for kind in dict.fromkeys((device_type, "cpu")):
        contexts.append({
            "device_type": kind,
            "enabled": torch.is_autocast_enabled(kind),
            "dtype": torch.get_autocast_dtype(kind),
            "cache_enabled": torch.is_autocast_cache_enabled(),
        })
    return contexts


class _ReentrantRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, spec: _ReentrantSpec, dummy: torch.Tensor | None, *inputs: torch.Tensor) -> Any:
        options = spec.options
        tensors = inputs[:len(inputs) - len(spec.parameter_slots)]  # the rest: parameters, not saved
        ctx.spec = spec
        ctx.device_type = _device_type_of(tensors)
        if options.preserve_rng_state:
            ctx.cpu_rng_state = torch.get_rng_state()
            ctx.devices, ctx.device_states = [], []
            if ctx.device_type != "cpu" and torch_checkpoint._get_device_module(ctx.device_type)._initialized:
                ctx.devices, ctx.device_states = torch_checkpoint.get_device_states(*tensors)
            ctx.tracker_states = rng.capture_tracker_states()
        ctx.autocast = _autocast_contexts(ctx.device_type)

        STATS.forward(spec.function)
        _notify(options.observer, "forward_start", spec.function)
        with enable_checkpointing(), _probing(spec.probe):
            output = spec.call(tensors)
        _notify(options.observer, "forward_end", spec.function)

        leaves, spec.rebuild_output = structures.flatten(output)
        spec.output_positions = structures.tensor_positions(leaves)
        frozen = spec.probe and not any(leaves[i].requires_grad for i in spec.output_positions)
        # Proven frozen: no output reaches a tensor that requires grad, so backward would only
        # recompute for nothing. Keep no inputs and make every output non-differentiable.
        ctx.save_for_backward(*(() if frozen else tensors))
        # Return fresh aliases: a tensor that existed before the call (a module constant, an input)
        # would otherwise be rewired to this node in place and recurse into it during backward.
        for i in spec.output_positions:
            leaves[i] = leaves[i].detach()
        spec.output_leaves = leaves
        outputs = tuple(leaves[i] for i in spec.output_positions)
        ctx.mark_non_differentiable(*[t for t in outputs if frozen or not (t.is_floating_point() or t.is_complex())])
        return outputs if outputs else torch.empty(0)

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        spec: _ReentrantSpec = ctx.spec
        options = spec.options
        if not torch.autograd._is_checkpoint_valid():
            raise RuntimeError(options.grad_error_message or REENTRANT_GRAD_ERROR)
        saved = ctx.saved_tensors
        inputs = tuple(t.detach().requires_grad_(t.requires_grad) for t in saved)
        rng_devices = getattr(ctx, "devices", [])
        with contextlib.ExitStack() as stack:
            stack.enter_context(torch.random.fork_rng(
                devices=rng_devices, enabled=options.preserve_rng_state, device_type=ctx.device_type))
            if options.preserve_rng_state:
                torch.set_rng_state(ctx.cpu_rng_state)
                if rng_devices:
                    torch_checkpoint.set_device_states(rng_devices, ctx.device_states, device_type=ctx.device_type)
                stack.enter_context(rng.restored_tracker_states(ctx.tracker_states))
            for autocast_kwargs in ctx.autocast:
                stack.enter_context(torch.autocast(**autocast_kwargs))
            stack.enter_context(torch.enable_grad())
            stack.enter_context(enable_recomputing())
            stack.enter_context(_batchnorm_guard(spec.function))
            aliases = stack.enter_context(_parameter_aliases(spec.parameter_slots))
            STATS.recompute(spec.function)
            _notify(options.observer, "recompute_start", spec.function)
            output = spec.call(inputs)
        _notify(options.observer, "recompute_end", spec.function)

        leaves, _ = structures.flatten(output)
        outputs = [leaves[i] for i in structures.tensor_positions(leaves)]
        pairs = [(o, g) for o, g in zip(outputs, grads) if o.requires_grad and g is not None]
        if pairs:
            torch.autograd.backward([o for o, _ in pairs], [g for _, g in pairs])
        _notify(options.observer, "backward_end", spec.function)
        # ctx.spec stays: a second backward (retain_graph=True) recomputes again, as torch's does.
        input_grads = tuple(t.grad if t.requires_grad else None for t in inputs)
        return (None, None, *input_grads, *(alias.grad if alias is not None else None for alias in aliases))


def _run_reentrant(
    function: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any], options: RegionOptions
) -> Any:
    leaves, rebuild = structures.flatten((args, kwargs))
    positions = structures.tensor_positions(leaves)
    tensors = tuple(leaves[i] for i in positions)
    # The spec keeps only non-tensor leaves: input tensors live in ctx.save_for_backward, where a
    # storage tier's saved_tensors_hooks can move them.
    opaque = [None if isinstance(leaf, torch.Tensor) else leaf for leaf in leaves]
    spec = _ReentrantSpec(function, options, opaque, rebuild, positions)
    # Without an input that requires grad, autograd would never call backward and the region's
    # parameters would get no gradient (torch's reentrant defect); an empty leaf that requires grad
    # keeps the region in the graph, as FairScale does. A frozen module (fairscale PR #787: no
    # recompute for frozen regions) may still reach trainable tensors: a module passed as an
    # argument, weights that are views of a parent's flat parameter. So "frozen" is never assumed
    # from its parameters; the forward probes it (grad enabled, nothing saved) and only a region
    # whose outputs provably need no gradient skips backward.
    # The owning module's trainable parameters are inputs of the Function: their gradients leave
    # backward as the Function's gradients, accumulated once by autograd where data-parallel
    # wrappers see them (DDP's unused-parameter search finds them in the graph; its hooks fire once).
    parameters, spec.parameter_slots = _trainable_parameter_slots(_owning_module(function), tensors)
    dummy = None
    if not parameters and not any(t.requires_grad for t in tensors):
        dummy = torch.empty(0, requires_grad=True)
        spec.probe = not _may_have_trainable_parameters(function)
    results = _ReentrantRegion.apply(spec, dummy, *tensors, *parameters)
    out_leaves, spec.output_leaves = spec.output_leaves, []  # the ctx must not keep outputs alive
    if spec.output_positions:
        if isinstance(results, torch.Tensor):
            results = (results,)
        for position, tensor in zip(spec.output_positions, results):
            out_leaves[position] = tensor
    return spec.rebuild_output(out_leaves)


def _owning_module(function: Callable[..., Any]) -> torch.nn.Module | None:
    """The module ``function`` is, or is a bound method / partial of; None for other callables."""
    while isinstance(function, functools.partial):
        function = function.func
    owner = function if isinstance(function, torch.nn.Module) else getattr(function, "__self__", None)
    return owner if isinstance(owner, torch.nn.Module) else None


def _may_have_trainable_parameters(function: Callable[..., Any]) -> bool:
    """False when ``function`` is a module none of whose parameters requires grad (a candidate for
    the frozen probe); unknown callables are assumed to reach parameters."""
    owner = _owning_module(function)
    return owner is None or any(p.requires_grad for p in owner.parameters())


def _trainable_parameter_slots(
    owner: torch.nn.Module | None, inputs: tuple[torch.Tensor, ...]
) -> tuple[list[torch.Tensor], list[list[tuple[torch.nn.Module, str]]]]:
    """The trainable parameters of ``owner`` (not already region inputs) and, for each, the
    (submodule, name) places that hold it."""
    if owner is None:
        return [], []
    passed = {id(t) for t in inputs}
    index: dict[int, int] = {}
    parameters: list[torch.Tensor] = []
    slots: list[list[tuple[torch.nn.Module, str]]] = []
    for module in owner.modules():
        for name, parameter in module._parameters.items():
            if parameter is None or not parameter.requires_grad or id(parameter) in passed:
                continue
            if not _aliasable(parameter):
                return [], []  # a framework-managed parameter: the whole region keeps the inner path
            position = index.setdefault(id(parameter), len(parameters))
            if position == len(parameters):
                parameters.append(parameter)
                slots.append([])
            slots[position].append((module, name))
    return parameters, slots


def _aliasable(parameter: torch.Tensor) -> bool:
    """False for parameters whose framework swaps their data through module hooks (ZeRO-3's
    partitioned parameters, FSDP1's flat parameters): an alias in their place during the recompute
    would escape those hooks. Their gradients accumulate in the inner backward, as torch's
    reentrant checkpoint does."""
    return not (hasattr(parameter, "ds_id") or getattr(parameter, "_is_flat_param", False))


@contextlib.contextmanager
def _parameter_aliases(slots: list[list[tuple[torch.nn.Module, str]]]) -> Iterator[list[torch.Tensor | None]]:
    """For the recompute, put a detached alias (same storage, a leaf that requires grad) in each
    parameter's places, so the inner backward accumulates into the alias and the real parameter
    gets its gradient once, from the outer graph. Hand-written because torch.func.functional_call
    would call the module, which is the region itself."""
    aliases: list[torch.Tensor | None] = []
    previous: list[tuple[torch.nn.Module, str, Any]] = []
    try:
        for places in slots:
            current = [module._parameters.get(name) for module, name in places]
            if any(parameter is None for parameter in current):
                # A wrapper moved it since forward (FSDP1 with use_orig_params swaps parameters
                # for plain views in backward): it gets its gradient in the inner backward.
                aliases.append(None)
                continue
            alias = current[0].detach().requires_grad_(True)
            aliases.append(alias)
            for (module, name), parameter in zip(places, current):
                previous.append((module, name, parameter))
                module._parameters[name] = alias
        yield aliases
    finally:
        for module, name, parameter in reversed(previous):
            module._parameters[name] = parameter


def _discard_saved(_: torch.Tensor) -> None:
    return None


def _never_unpacked(_: None) -> torch.Tensor:
    raise RuntimeError("acshim: a frozen-region probe's graph was used in backward")  # unreachable


def _probing(enabled: bool) -> contextlib.AbstractContextManager[Any]:
    """Grad enabled, every saved tensor dropped: outputs tell whether they require grad while the
    probe holds no activation (its graph dies with the detached outputs)."""
    if not enabled:
        return contextlib.nullcontext()
    stack = contextlib.ExitStack()
    stack.enter_context(torch.enable_grad())
    stack.enter_context(torch.autograd.graph.saved_tensors_hooks(_discard_saved, _never_unpacked))
    return stack


def _batchnorm_guard(function: Callable[..., Any]) -> contextlib.AbstractContextManager[Any]:
    """The BatchNorm statistics guard for a recompute, skipped for a module known to hold no
    BatchNorm (the guard's global hook slows every module call of the recompute)."""
    owner = _owning_module(function)
    if owner is not None and not any(isinstance(m, _BatchNorm) for m in owner.modules()):
        return contextlib.nullcontext()
    return running_stats_frozen()


def _notify(observer: Any, event: str, region: Callable[..., Any]) -> None:
    if observer is not None:
        callback = getattr(observer, event, None)
        if callback is not None:
            callback(region)
