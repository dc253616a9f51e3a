"""The engine's region: run a callable so that its activations are recomputed in backward.

Non-reentrant regions stand on ``torch.utils.checkpoint.checkpoint(use_reentrant=False)``; the
callable is wrapped so the region also restores tracker RNG streams, keeps the state its forward
changes as the forward saw it for the recompute and updated once (``acshim.region_buffers``), and
exposes ``is_checkpointing()`` / ``is_recomputing()``. Reentrant regions use a small
``autograd.Function`` of our own because torch's reentrant ``CheckpointFunction`` ignores tensors
nested in containers, drops non-tensor outputs' structure, gives parameters no gradient when no
input requires grad, runs the forward under ``no_grad`` (other kernels) and is invisible to
``.grad()`` for a closure's weights; ours handles all of them (flattening with
``acshim.structures``; the forward's leaves with ``acshim.region_graph`` and
``acshim.region_aliases``).
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import types
from collections.abc import Callable
from typing import Any

import torch
import torch.utils.checkpoint as torch_checkpoint

from . import (
    compiled,
    region_aliases,
    region_buffers,
    region_escapes,
    region_graph,
    region_reads,
    region_state,
    rng,
    selective,
    structures,
)
from .options import DEFAULT_OPTIONS, RegionOptions
from .region_call import REGION_STATE, RegionCall, RegionStats, notify
from .region_modules import region_modules
from .state import disable_checkpointing, enable_checkpointing, enable_recomputing, state

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


STATS: RegionStats = REGION_STATE.stats
"""Process-wide region counts (``acshim.region_call.RegionStats``); the same object as
``REGION_STATE.stats``."""

ROUTERS: list[Any] = REGION_STATE.routers
"""The router stack (``acshim.region_call.RegionState.routers``); the same list as
``REGION_STATE.routers``: every region call goes to ``ROUTERS[-1].route(...)`` when one is set."""


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
        return compiled.run_traced(function, args, kwargs, options, eager=run_region)
    scope = options.saved_tensors_scope() if options.saved_tensors_scope else contextlib.nullcontext()
    with scope:
        if options.reentrant:
            return _run_reentrant(function, args, kwargs, options)
        return _run_non_reentrant(function, args, kwargs, options)


# --------------------------------------------------------------------------------------------------
# non-reentrant: torch.utils.checkpoint does the recompute; RegionCall (acshim.region_call) adds
# what it lacks



_CHECKPOINT_GENERATOR_CODE = getattr(getattr(torch_checkpoint, "_checkpoint_without_reentrant_generator", None),
                                     "__code__", None)


def _close_abandoned_checkpoints(error: BaseException) -> None:
    """Torch before 2.13 (2.11, seen on a GPU machine) leaves a non-reentrant checkpoint whose function
    raised with its forward context (a selective-checkpoint dispatch mode) and its saved-tensor hooks
    entered: their generator is suspended in a frame the traceback keeps alive, so the next plain
    forward ran under them. Close it as the exception leaves, as torch 2.13 does with ``gen.throw``
    (a generator that torch already finished is left alone). The planner's stopped measurements
    (``OverBudget`` raised inside forward) and any user error go through here; the error path only."""
    if _CHECKPOINT_GENERATOR_CODE is None:
        return
    traceback = error.__traceback__
    while traceback is not None:
        for value in list(traceback.tb_frame.f_locals.values()):
            if (isinstance(value, types.GeneratorType) and value.gi_code is _CHECKPOINT_GENERATOR_CODE
                    and value.gi_frame is not None and not value.gi_running):
                value.close()
        traceback = traceback.tb_next


def _run_non_reentrant(
    function: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any], options: RegionOptions
) -> Any:
    extra: dict[str, Any] = {}
    early_stop_context: contextlib.AbstractContextManager[Any] = contextlib.nullcontext()
    if TORCH_HAS_EARLY_STOP:
        extra["early_stop"] = options.early_stop
    elif not options.early_stop:
        early_stop_context = torch_checkpoint.set_checkpoint_early_stop(False)
    try:
        with early_stop_context:
            return TORCH_CHECKPOINT(
                RegionCall(function, options),
                *args,
                use_reentrant=False,
                preserve_rng_state=options.preserve_rng_state,
                context_fn=selective.honour_offload(options.context_fn) or torch_checkpoint.noop_context_fn,
                determinism_check=options.determinism_check,
                debug=options.debug,
                **extra,
                **kwargs,
            )
    except BaseException as error:
        _close_abandoned_checkpoints(error)
        raise


# --------------------------------------------------------------------------------------------------
# reentrant: the forward runs first, as without checkpointing (grad enabled, nothing saved); our
# autograd.Function then connects the outputs to everything they depend on and recomputes in its
# backward


class ReentrantSpec:
    """One reentrant region call: what its Function needs besides the saved input tensors."""

    __slots__ = ("function", "options", "leaves", "rebuild_inputs", "positions", "output_positions",
                 "outputs", "changed_inputs", "buffer_changes", "parameter_groups", "plain_leaves",
                 "device_type", "cpu_rng_state", "devices", "device_states", "tracker_states", "autocast",
                 "reads", "escape_positions")

    def __init__(self, function: Callable[..., Any], options: RegionOptions, leaves: list[Any],
                 rebuild_inputs: structures.Rebuild, positions: list[int]) -> None:
        self.function = function
        self.options = options
        self.leaves = leaves
        self.rebuild_inputs = rebuild_inputs
        self.positions = positions
        self.output_positions: list[int] = []
        """Where the outputs that require grad (the Function's outputs) sit among the output leaves."""
        self.outputs: list[torch.Tensor] = []
        self.changed_inputs: list[tuple[int, int]] = []
        """(input index, version before the forward) of inputs the forward changed in place."""
        self.buffer_changes: list[region_buffers.Change] | None = None
        self.parameter_groups: list[tuple[region_aliases.Slots, int]] = []
        """Per parameter input: its places and its number of uses (how often it is passed)."""
        self.plain_leaves: list[tuple[torch.Tensor, int]] = []
        """Leaves passed after those parameters, aliased per use in torch calls: a closure's
        tensors, and parameters the forward used more than once; with their uses."""
        self.cpu_rng_state: torch.Tensor | None = None
        self.devices: list[int] = []
        self.device_states: list[torch.Tensor] = []
        self.tracker_states: list[Any] = []
        self.reads: region_reads.Reads | None = None
        self.escape_positions: list[region_escapes.Key] = []
        """Which module outputs escaped the forward (``region_escapes``): the Function's outputs
        after ``output_positions``."""

    def call(self, tensors: tuple[torch.Tensor, ...]) -> Any:
        leaves = list(self.leaves)
        for position, tensor in zip(self.positions, tensors):
            leaves[position] = tensor
        args, kwargs = self.rebuild_inputs(leaves)
        return self.function(*args, **kwargs)

    def capture(self, tensors: tuple[torch.Tensor, ...]) -> None:
        """RNG (CPU, device, tracker streams) and autocast state as the forward starts."""
        self.device_type = _device_type_of(tensors)
        if self.options.preserve_rng_state:
            self.cpu_rng_state = torch.get_rng_state()
            if self.device_type != "cpu" and torch_checkpoint._get_device_module(self.device_type)._initialized:
                self.devices, self.device_states = torch_checkpoint.get_device_states(*tensors)
            self.tracker_states = rng.capture_tracker_states()
        self.autocast = _autocast_contexts(self.device_type)

    def run_forward(self, tensors: tuple[torch.Tensor, ...], modules: list[torch.nn.Module],
                    referenced: dict[int, torch.Tensor]
                    ) -> tuple[Any, int, list[torch.nn.Module], region_escapes.ModuleOutputs]:
        """The forward as without checkpointing (grad enabled: the same kernels), keeping no saved
        tensor. Regions nested in it are plain calls (they become regions in the recompute).
        Returns the output, the first node number of its graph, the modules it ran and the
        tensors its modules returned (``acshim.region_escapes``)."""
        STATS.forward(self.function)
        notify(self.options.observer, "forward_start", self.function)
        versions = _versions(tensors)
        with region_buffers.watching(modules) as buffers, enable_checkpointing(), disable_checkpointing(), \
                region_graph.saving_nothing(), region_escapes.watching() as noted:
            since = region_graph.next_node_number()
            output = self.call(tensors)
        self.buffer_changes = buffers.changes()
        self.reads = region_reads.record(modules or buffers.modules(), self.buffer_changes, referenced.values())
        self.changed_inputs = [(i, v) for i, (t, v) in enumerate(zip(tensors, versions))
                               if v >= 0 and t._version != v]
        notify(self.options.observer, "forward_end", self.function)
        return output, since, modules or buffers.modules(), noted

    def connect(self, outputs: list[torch.Tensor], since: int, tensors: tuple[torch.Tensor, ...],
                modules: list[torch.nn.Module], referenced: dict[int, torch.Tensor]) -> tuple[torch.Tensor, ...]:
        """The Function's inputs: the input tensors, then every leaf the outputs depend on (the
        parameters of the region's modules, then other leaves such as a closure's tensors) once per
        use. Their gradients leave backward as the Function's, accumulated once by autograd where
        data-parallel wrappers see them (DDP's unused-parameter search finds them in the graph; its
        hooks fire once), and ``.grad()``/``inputs=`` reach the region and get torch's reentrant
        error instead of a silently missing gradient.

        A parameter found only in the graph (neither in the region's modules nor referenced by its
        callable) is left to the inner backward: some other code manages it, like FSDP2's unsharded
        parameters, which its module hooks put in place for each forward and whose gradients it
        expects by the end of the module's backward."""
        passed = {id(t) for t in tensors}
        found = [entry for key, entry in region_graph.leaf_uses(outputs, since).items() if key not in passed]
        if not all(region_aliases.aliasable(leaf) for leaf, _ in found):
            # A framework-managed parameter (ZeRO-3, FSDP1 flat parameters: their data and shape
            # change through module hooks): the region keeps torch's inner path, every leaf's
            # gradient accumulates in the inner backward.
            return tensors
        slots = region_aliases.parameter_slots(modules) if found and modules else {}
        parameters: list[torch.Tensor] = []
        plain: list[torch.Tensor] = []
        for leaf, uses in found:
            places = slots.get(id(leaf))
            if places is not None and uses == 1:
                self.parameter_groups.append((places, uses))
                parameters.append(leaf)
            elif places is None and isinstance(leaf, torch.nn.Parameter) and id(leaf) not in referenced:
                continue
            else:
                # used several times (a module called twice, spectral norm's weight): one alias per
                # use, not per read, so that each use's gradient is added as one backward adds it
                self.plain_leaves.append((leaf, uses))
                plain += [leaf] * uses
        return (*tensors, *parameters, *plain)

    def check_inputs_unchanged(self, saved: tuple[torch.Tensor, ...]) -> None:
        """torch's in-place error when the forward changed an input: the recompute would start
        from the changed values (torch's reentrant checkpoint recomputes from them silently)."""
        for index, expected in self.changed_inputs:
            from .storage.versions import modified_error

            raise modified_error(saved[index], expected)


def _versions(tensors: tuple[torch.Tensor, ...]) -> list[int]:
    return [-1 if t.is_inference() else t._version for t in tensors]


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
    def forward(ctx: Any, spec: ReentrantSpec, dummy: torch.Tensor | None, *inputs: torch.Tensor) -> Any:
        ctx.spec = spec
        ctx.set_materialize_grads(False)  # an output with no gradient adds nothing (not zeros) inside
        ctx.save_for_backward(*inputs[:len(spec.positions)])  # the rest: parameters and leaves, not saved
        outputs, spec.outputs = spec.outputs, []  # the spec must not keep outputs alive
        return tuple(outputs)

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor | None) -> tuple[torch.Tensor | None, ...]:
        spec: ReentrantSpec = ctx.spec
        options = spec.options
        if not torch.autograd._is_checkpoint_valid():
            raise RuntimeError(options.grad_error_message or REENTRANT_GRAD_ERROR)
        saved = ctx.saved_tensors
        spec.check_inputs_unchanged(saved)
        region_reads.check(spec.reads)
        inputs = tuple(t.detach().requires_grad_(t.requires_grad) for t in saved)
        # The aliases stay in place through the inner backward: a non-reentrant region nested in
        # this one recomputes there and must read them too.
        with region_aliases.aliases_per_access(spec.parameter_groups) as records, \
                region_aliases.aliases_per_use(spec.plain_leaves) as plain_records:
            with contextlib.ExitStack() as stack:
                stack.enter_context(torch.random.fork_rng(
                    devices=spec.devices, enabled=options.preserve_rng_state, device_type=spec.device_type))
                if options.preserve_rng_state:
                    torch.set_rng_state(spec.cpu_rng_state)
                    if spec.devices:
                        torch_checkpoint.set_device_states(spec.devices, spec.device_states,
                                                           device_type=spec.device_type)
                    stack.enter_context(rng.restored_tracker_states(spec.tracker_states))
                for autocast_kwargs in spec.autocast:
                    stack.enter_context(torch.autocast(**autocast_kwargs))
                stack.enter_context(torch.enable_grad())
                stack.enter_context(enable_recomputing())
                stack.enter_context(region_buffers.as_the_forward_saw_them(spec.buffer_changes))
                STATS.recompute(spec.function)
                notify(options.observer, "recompute_start", spec.function)
                count = len(spec.output_positions)
                wanted = {p for p, g in zip(spec.escape_positions, grads[count:]) if g is not None}
                if wanted:
                    noted = stack.enter_context(region_escapes.watching(wanted))
                output = spec.call(inputs)
            notify(options.observer, "recompute_end", spec.function)

            leaves, _ = structures.flatten(output)
            pairs = [(leaves[i], g) for i, g in zip(spec.output_positions, grads)
                     if g is not None and leaves[i].requires_grad]
            if wanted:
                pairs += _escaped_pairs(noted, spec.escape_positions, grads[count:])
                del noted
            if pairs:
                torch.autograd.backward([o for o, _ in pairs], [g for _, g in pairs])
            notify(options.observer, "backward_end", spec.function)
        # ctx.spec stays: a second backward (retain_graph=True) recomputes again, as torch's does.
        input_grads = tuple(t.grad if t.requires_grad else None for t in inputs)
        return (None, None, *input_grads,
                *region_aliases.gradients(records, [uses for _, uses in spec.parameter_groups]),
                *region_aliases.gradients(plain_records, [uses for _, uses in spec.plain_leaves]))


def _escaped_pairs(noted: region_escapes.ModuleOutputs, positions: list[region_escapes.Key],
                   grads: tuple[torch.Tensor | None, ...]) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The recompute's counterparts of the tensors that escaped the forward, with their gradients."""
    pairs = []
    for position, grad in zip(positions, grads):
        if grad is None:
            continue
        tensor = noted.at(position)
        if tensor is None or not tensor.requires_grad or tensor.shape != grad.shape:
            raise RuntimeError(
                "acshim: a tensor made inside a reentrant region and kept outside it (by a module hook) "
                "needs a gradient, but the region's recompute did not make it again the same way: its "
                "modules returned other tensors than in the forward. Use use_reentrant=False.")
        pairs.append((tensor, grad))
    return pairs


def _run_reentrant(
    function: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any], options: RegionOptions
) -> Any:
    if torch._C._functorch.peek_interpreter_stack() is not None:
        # Under a functorch transform (torch.func.grad, vmap, jvp over the region) the region's
        # autograd.Function cannot run exactly, and torch's reentrant checkpoint, an
        # autograd.Function too, raises functorch's error: hand the call to it, so the error (or,
        # in a torch that supports it, the behaviour) is torch's own.
        bound = functools.partial(function, **kwargs) if kwargs else function
        return torch_checkpoint.CheckpointFunction.apply(bound, options.preserve_rng_state, *args)
    leaves, rebuild = structures.flatten((args, kwargs))
    positions = structures.tensor_positions(leaves)
    tensors = tuple(leaves[i] for i in positions)
    # The spec keeps only non-tensor leaves: input tensors live in ctx.save_for_backward, where a
    # storage tier's saved_tensors_hooks can move them.
    opaque = [None if isinstance(leaf, torch.Tensor) else leaf for leaf in leaves]
    spec = ReentrantSpec(function, options, opaque, rebuild, positions)
    spec.capture(tensors)
    referenced: dict[int, torch.Tensor] = {}
    output, since, modules, noted = spec.run_forward(
        tensors, region_modules(function, args, kwargs, referenced), referenced)
    out_leaves, rebuild_output = structures.flatten(output)
    del output
    spec.output_positions = [i for i in structures.tensor_positions(out_leaves) if out_leaves[i].requires_grad]
    if not spec.output_positions:
        # No output needs a gradient (a frozen region with no trainable input or closure tensor,
        # fairscale PR #787): nothing is kept for backward and nothing recomputed.
        return rebuild_output(out_leaves)
    outputs = [out_leaves[i] for i in spec.output_positions]
    escaped = noted.escaped(outputs, since)
    del noted
    spec.escape_positions = [position for position, _ in escaped]
    outputs += [tensor for _, tensor in escaped]
    del escaped
    inputs = spec.connect(outputs, since, tensors, modules, referenced)
    # The Function's outputs. A tensor the forward made (no view) is rewired to the Function in
    # place, so every reference to it (a hook that kept it) follows; any other gets a fresh alias:
    # a tensor that existed before the call (a module constant, an input) would otherwise be
    # rewired to this node in place and recurse into it during backward.
    spec.outputs = [o if region_escapes.made_inside(o, since) else o.detach() for o in outputs]
    del outputs
    # Torch's reentrant checkpoint gives parameters no gradient when no input requires grad; here
    # parameters are inputs. Only outputs that depend on nothing but a closure's non-leaf tensors
    # need an empty leaf that requires grad to keep the region in the graph, as FairScale does.
    dummy = None if any(t.requires_grad for t in inputs) else torch.empty(0, requires_grad=True)
    results = _ReentrantRegion.apply(spec, dummy, *inputs)
    for position, tensor in zip(spec.output_positions, results):  # the escaped ones come after: rewired
        out_leaves[position] = tensor
    return rebuild_output(out_leaves)


def owning_module(function: Callable[..., Any]) -> torch.nn.Module | None:
    """The module ``function`` is, or is a bound method / partial of; None for other callables."""
    while isinstance(function, functools.partial):
        function = function.func
    owner = function if isinstance(function, torch.nn.Module) else getattr(function, "__self__", None)
    return owner if isinstance(owner, torch.nn.Module) else None


