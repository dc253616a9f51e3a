"""Regions under torch.compile: every region kind, apply_checkpointing and each facade compile as
torch's non-reentrant checkpoint does, give the gradients of the eager run without checkpointing,
and the compiled graph keeps fewer activation bytes for backward than the same function compiled
without checkpointing.

Memory is measured as the bytes of the distinct storages the compiled autograd function saves for
backward (an outer ``saved_tensors_hooks`` sees AOTAutograd's ``save_for_backward``), parameters and
the input excluded. ``benchmarks/bench_compile.py`` cross-checks it with RSS in fresh processes.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import acshim
import acshim.facades.smdistributed.modelparallel.torch as smp
import acshim.facades.torch.distributed.algorithms._checkpoint.checkpoint_wrapper as torch_wrapper
from acshim import storage
from acshim.facades import deepspeed
from acshim.facades.fairscale.nn.checkpoint import checkpoint_wrapper as fairscale_wrapper
from acshim.selective import save_ops

WIDTH, HIDDEN, BATCH = 16, 64, 8


class Block(nn.Module):
    def __init__(self, dropout: float = 0.0) -> None:
        super().__init__()
        self.up, self.down, self.drop = nn.Linear(WIDTH, HIDDEN), nn.Linear(HIDDEN, WIDTH), nn.Dropout(dropout)

    def forward(self, x: torch.Tensor, scale: float = 1.0) -> torch.Tensor:
        return x + self.down(self.drop(nn.functional.gelu(self.up(x)))).tanh() * scale


class Recorder:
    """A backend that keeps the Dynamo graphs it is given and compiles them with ``backend``."""

    def __init__(self, backend: str) -> None:
        self.backend, self.graphs = backend, []

    def __call__(self, gm: torch.fx.GraphModule, example_inputs: list) -> object:
        self.graphs.append(gm)
        return torch._dynamo.lookup_backend(self.backend)(gm, example_inputs)

    def checkpoint_ops(self) -> int:
        hop = torch.ops.higher_order.tag_activation_checkpoint
        graphs = [sub for gm in self.graphs for sub in gm.modules() if isinstance(sub, torch.fx.GraphModule)]
        return sum(node.target is hop for graph in graphs for node in graph.graph.nodes)


def _tensors(output: object) -> list[torch.Tensor]:
    if isinstance(output, torch.Tensor):
        return [output]
    if isinstance(output, dict):
        output = list(output.values())
    return [t for item in output for t in _tensors(item)] if isinstance(output, (list, tuple)) else []


def _step(fn, model: nn.Module, x: torch.Tensor) -> tuple[list[torch.Tensor | None], int]:
    """Gradients of one seeded step, and the activation bytes saved for backward."""
    model.zero_grad(set_to_none=True)
    x.grad = None
    excluded = {p.untyped_storage().data_ptr() for p in model.parameters()} | {x.untyped_storage().data_ptr()}
    saved: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        st = t.untyped_storage()
        if st.data_ptr() not in excluded:
            saved[st.data_ptr()] = st.nbytes()
        return t

    torch.manual_seed(1)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn(x)
    sum(t.sum() for t in _tensors(out)).backward()
    return [x.grad, *(p.grad for p in model.parameters())], sum(saved.values())


def _check(fn, model: nn.Module, backend: str = "aot_eager", regions: int | None = None,
           reference_fn=None) -> Recorder:
    """Compiled ``fn`` gives the eager no-checkpointing gradients (of ``reference_fn`` if given)
    and holds less than ``fn`` compiled without checkpointing; ``regions``: checkpoint operators
    expected in the graph."""
    x = torch.randn(BATCH, WIDTH, requires_grad=True)
    with acshim.disable_checkpointing():
        reference, _ = _step(reference_fn or fn, model, x)
        torch._dynamo.reset()
        _, plain_bytes = _step(torch.compile(fn, backend=backend), model, x)
    torch._dynamo.reset()
    recorder = Recorder(backend)
    grads, held = _step(torch.compile(fn, backend=recorder), model, x)
    for got, want in zip(grads, reference):
        torch.testing.assert_close(got, want)
    assert held < plain_bytes, (held, plain_bytes)
    if regions is not None:
        assert len(recorder.graphs) == 1 and recorder.checkpoint_ops() == regions
    return recorder


def _blocks(n: int, dropout: float = 0.0) -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(*(Block(dropout) for _ in range(n)))


def _nested_output(block: nn.Module, x: torch.Tensor) -> torch.Tensor:
    def body(x):
        h = block(x)
        return {"h": h, "count": 3, "pair": (h * 2, None)}

    out = acshim.checkpoint(body, x)
    assert out["count"] == 3 and out["pair"][1] is None
    return out["h"] + out["pair"][0]


def _no_input_requires_grad(block: nn.Module, x: torch.Tensor) -> torch.Tensor:
    return x + acshim.checkpoint(block, x.detach() * 1, use_reentrant=True)


#: One region kind per stage; each stage is checkpointed by its own call (1 region each, except
#: nested_regions: 2). One compile covers them all (compiling is slow).
REGION_KINDS = {
    "non_reentrant": lambda b, x: acshim.checkpoint(b, x),
    "reentrant": lambda b, x: acshim.checkpoint(b, x, use_reentrant=True),
    "kwargs": lambda b, x: acshim.checkpoint(b, x, scale=0.5),
    "run_region_reentrant_kwargs": lambda b, x: acshim.run_region(b, (x,), {"scale": 2.0},
                                                                  acshim.RegionOptions(reentrant=True)),
    "nested_and_non_tensor_outputs": _nested_output,
    "nested_regions": lambda b, x: acshim.checkpoint(lambda h: acshim.checkpoint(b, h) * 2, x),
    "selective": lambda b, x: acshim.checkpoint(b, x, context_fn=save_ops()),
    "no_input_requires_grad": _no_input_requires_grad,
    "dropout_reentrant": lambda b, x: acshim.checkpoint(b, x, use_reentrant=True),
}


def test_every_region_kind_compiles() -> None:
    model = _blocks(len(REGION_KINDS))
    model[-1].drop.p = 0.5  # dropout: the compiled graph must draw the eager masks

    def fn(x):
        for block, stage in zip(model, REGION_KINDS.values()):
            x = stage(block, x)
        return x

    _check(fn, model, regions=len(REGION_KINDS) + 1)


def test_apply_checkpointing_compiles() -> None:
    model = _blocks(4)
    acshim.apply_checkpointing(model, acshim.ByName("0", "1"))
    acshim.apply_checkpointing(model[2:], Block, reentrant=True)
    _check(model, model, regions=4)


def test_facades_compile() -> None:
    model = _blocks(6)
    deepspeed.checkpointing.reset()
    fairscale_wrapper(model[2])
    impl = torch_wrapper.CheckpointImpl
    wrapped_non_reentrant = torch_wrapper.checkpoint_wrapper(model[3], checkpoint_impl=impl.NO_REENTRANT)
    with pytest.warns(FutureWarning):
        wrapped_reentrant = torch_wrapper.checkpoint_wrapper(model[4], checkpoint_impl=impl.REENTRANT)

    def fn(x):
        x = deepspeed.checkpointing.checkpoint(model[0], x)
        x = deepspeed.checkpointing.non_reentrant_checkpoint(model[1], x)
        x = model[2](x)
        x = wrapped_reentrant(wrapped_non_reentrant(x))
        return smp.checkpoint(model[5], x)

    _check(fn, model, regions=6)


def test_batchnorm_statistics_updated_once() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.BatchNorm1d(WIDTH))
    reference = nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.BatchNorm1d(WIDTH))
    reference.load_state_dict(model.state_dict())
    x = torch.randn(BATCH, WIDTH)
    reference(x).sum().backward()
    torch._dynamo.reset()
    torch.compile(lambda x: acshim.checkpoint(model, x, use_reentrant=True), backend="aot_eager")(x).sum().backward()
    assert int(model[1].num_batches_tracked) == 1
    torch.testing.assert_close(model[1].running_mean, reference[1].running_mean)
    torch.testing.assert_close(model[0].weight.grad, reference[0].weight.grad)


def test_storage_tier_region_runs_eagerly_around_a_graph_break() -> None:
    model = _blocks(2)
    scope = storage.boundary_offload(storage="host")
    acshim.apply_checkpointing(model, Block, saved_tensors_scope=scope)
    fn = lambda x: model(x.sin() * 2).cos()  # noqa: E731 - compiled code before and after the regions
    x = torch.randn(BATCH, WIDTH, requires_grad=True)
    with acshim.disable_checkpointing():
        reference, _ = _step(fn, model, x)
    torch._dynamo.reset()
    recorder = Recorder("aot_eager")
    grads, _ = _step(torch.compile(fn, backend=recorder), model, x)
    for got, want in zip(grads, reference):
        torch.testing.assert_close(got, want, rtol=0, atol=0)
    assert scope.stats.saved > 0  # the tier really saw the regions' inputs
    assert recorder.graphs and recorder.checkpoint_ops() == 0
    torch._dynamo.reset()
    with pytest.raises(torch._dynamo.exc.Unsupported, match="storage tier"):
        torch.compile(fn, backend="aot_eager", fullgraph=True)(x)


def test_tracker_streams_keep_their_dropout_masks() -> None:
    tracker = acshim.RNGStatesTracker()
    tracker.add("model-parallel-rng", 1234)
    model = _blocks(2, dropout=0.5)

    def body(x):
        with tracker.fork():
            return model(x)

    fn = lambda x: acshim.checkpoint(body, x).sin()  # noqa: E731
    x = torch.randn(BATCH, WIDTH, requires_grad=True)
    start = tracker.get_states()
    try:
        with acshim.disable_checkpointing():
            reference, _ = _step(fn, model, x)
        tracker.set_states(dict(start))
        torch._dynamo.reset()
        grads, _ = _step(torch.compile(fn, backend="aot_eager"), model, x)
        for got, want in zip(grads, reference):
            torch.testing.assert_close(got, want, rtol=0, atol=0)
    finally:
        tracker.reset()


def test_region_dynamo_cannot_trace_keeps_acshim_semantics() -> None:
    """A side effect in the body makes Dynamo run the checkpoint eagerly: the region is then still
    acshim's (flags set, recompute marked)."""
    model = _blocks(2, dropout=0.5)
    seen = []

    def body(x):
        seen.append((acshim.is_checkpointing(), acshim.is_recomputing()))
        return model(x)

    fn = lambda x: acshim.checkpoint(body, x).sin()  # noqa: E731
    x = torch.randn(BATCH, WIDTH, requires_grad=True)
    with acshim.disable_checkpointing():
        reference, _ = _step(fn, model, x)
    seen.clear()
    torch._dynamo.reset()
    grads, _ = _step(torch.compile(fn, backend="aot_eager"), model, x)
    assert seen == [(True, False), (False, True)]
    for got, want in zip(grads, reference):
        torch.testing.assert_close(got, want, rtol=0, atol=0)


def test_inductor_mixed_regions() -> None:
    model = _blocks(2)
    _check(lambda x: acshim.checkpoint(model[1], acshim.checkpoint(model[0], x, use_reentrant=True),
                                       context_fn=save_ops()), model, backend="inductor", regions=2)


def test_hugging_face_model_with_default_cache_compiles_without_graph_breaks() -> None:
    """GPT-2 in training with use_cache left on: the compiled regions drop the cache as eager ones
    do, without breaking the graph, and give the gradients of the run without a cache (a cache
    changes the key/value layout, so MKL may pick another kernel: the cache-on run is not the
    reference, as in tests/hf)."""
    pytest.importorskip("transformers")
    model = acshim.testing.hf_model("gpt2")
    model.train()
    acshim.apply_checkpointing(model)
    ids = torch.randint(0, 50, (2, 8))
    _check(lambda x: model(input_ids=ids).logits * x.sum(), model, regions=len(model.transformer.h),
           reference_fn=lambda x: model(input_ids=ids, use_cache=False).logits * x.sum())


def test_a_planned_model_compiles_within_its_budget_with_exact_gradients() -> None:
    """acshim.plan's choices (recompute, offload, keep) under torch.compile: gradients bitwise equal
    to eager without checkpointing, and the measured peak stays within the budget."""
    from acshim.planner import measure_step
    from acshim.testing import GPT, seeded, train_step

    def build():
        return seeded(lambda: GPT(layers=4, width=64, heads=4, seq=32, vocab=128))

    ids = torch.randint(0, 128, (2, 32), generator=torch.Generator().manual_seed(3))
    reference = train_step(build(), ids, seed=7)
    model = build()
    plan = acshim.plan(model, ids, budget=0.5, memory="tensors")  # the tracker's measure, compared below
    plan.apply(model)
    torch._dynamo.reset()
    compiled = torch.compile(model, backend="aot_eager")
    got = {key.replace("_orig_mod.", ""): value for key, value in train_step(compiled, ids, seed=7).items()}
    assert set(got) == set(reference) and all(torch.equal(got[k], reference[k]) for k in got)
    _, peak = measure_step(compiled, ids)
    assert peak <= plan.budget, (peak, plan.budget)
