"""``acshim.head``: the LM head and its cross-entropy in chunks give torch's gradients bitwise and
hold less (``tests/hf`` and ``tests/cli`` run it on whole models and scripts)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import CheckpointError

import acshim.head as head
from acshim.head import chunks, installing, projection
from acshim.planner.tracker import LiveBytes, excluded_keys, grad_keys

VOCAB, WIDTH = 3000, 32
SMALL_CHUNKS = 16 * VOCAB * 4  # 16 rows per chunk: several chunks on the batches below


class TinyLM(nn.Module):
    """An embedding, a norm and an untied linear head; ``loss_in_forward`` as Hugging Face models do."""

    def __init__(self, bias: bool = False) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, WIDTH)
        self.norm = nn.LayerNorm(WIDTH)
        self.lm_head = nn.Linear(WIDTH, VOCAB, bias=bias)

    def get_output_embeddings(self) -> nn.Module:
        return self.lm_head

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.norm(self.embed(ids)))


def _model(seed: int = 0, bias: bool = False, frozen_head: bool = False) -> TinyLM:
    torch.manual_seed(seed)
    model = TinyLM(bias)
    if frozen_head:
        model.lm_head.requires_grad_(False)
    return model


def _ids(batch: int = 3, seq: int = 37, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, VOCAB, (batch, seq), generator=torch.Generator().manual_seed(seed))


LOSSES = {
    # Hugging Face's ForCausalLMLoss: labels padded and shifted, logits viewed (no copy)
    "hf": lambda logits, ids: F.cross_entropy(logits.float().view(-1, VOCAB),
                                              F.pad(ids, (0, 1), value=-100)[:, 1:].reshape(-1), ignore_index=-100),
    # a script shifting the logits: a slice, copied by reshape
    "shifted": lambda logits, ids: F.cross_entropy(logits[:, :-1].reshape(-1, VOCAB), ids[:, 1:].reshape(-1)),
    "contiguous-sum": lambda logits, ids: F.cross_entropy(logits[:, 1:, :].contiguous().view(-1, VOCAB),
                                                          ids[:, :-1].reshape(-1), reduction="sum"),
    "module-none": lambda logits, ids: nn.CrossEntropyLoss(reduction="none")(
        logits.flatten(0, 1), ids.flatten()).square().mean(),
    "ignore-zero": lambda logits, ids: F.cross_entropy(logits.view(-1, VOCAB), ids.view(-1), ignore_index=0),
}


def _step(model: nn.Module, ids: torch.Tensor, loss_fn) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    model.zero_grad(set_to_none=True)
    loss = loss_fn(model(ids), ids)
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("loss", sorted(LOSSES))
@pytest.mark.parametrize("mode", head.MODES)
@pytest.mark.parametrize("frozen_head", [False, True])
def test_chunked_head_and_loss_give_torch_gradients_bitwise(loss: str, mode: str, frozen_head: bool) -> None:
    """Loss value and every gradient bitwise equal to plain ``F.cross_entropy`` over the whole logits:
    views, slices, copies, casts, reductions, ``nn.CrossEntropyLoss``, ``ignore_index=0``, a trainable
    head (exact mode) and a frozen one (LoRA-like), several chunks with a remainder."""
    ids = _ids()
    ids[0, 5] = 0
    reference_loss, reference = _step(_model(frozen_head=frozen_head), ids, LOSSES[loss])
    model = _model(frozen_head=frozen_head)
    with head.chunked(model, mode, chunk_bytes=SMALL_CHUNKS) as done:
        assert done
        got_loss, got = _step(model, ids, LOSSES[loss])
    assert torch.equal(got_loss, reference_loss)
    assert set(got) == set(reference) and all(torch.equal(got[k], reference[k]) for k in got), \
        {k: (got[k] - reference[k]).abs().max().item() for k in got}
    assert "forward" not in model.lm_head.__dict__  # removed


def test_bias_and_other_uses_of_the_logits_stay_exact() -> None:
    """A head with bias, and a second differentiable use of the logits beside the loss (a z-loss):
    the gradients are summed where torch sums them (in the logits), so still bitwise."""
    def loss_fn(logits, ids):
        return LOSSES["hf"](logits, ids) + 1e-3 * torch.logsumexp(logits, -1).square().mean()

    ids = _ids()
    reference_loss, reference = _step(_model(bias=True), ids, loss_fn)
    for frozen in (False, True):
        model = _model(bias=True, frozen_head=frozen)
        reference_loss, reference = _step(_model(bias=True, frozen_head=frozen), ids, loss_fn)
        with head.chunked(model, "head", chunk_bytes=SMALL_CHUNKS):
            got_loss, got = _step(model, ids, loss_fn)
        assert torch.equal(got_loss, reference_loss)
        assert all(torch.equal(got[k], reference[k]) for k in reference)


def test_inexact_trainable_head_weight_gradient_bound() -> None:
    """``exact=False``: a trainable head's weight gradient is summed chunk by chunk; everything else
    stays bitwise and the weight gradient is within a few float32 ulps of torch's (measured bound:
    relative error below 1e-5 of the gradient's largest element)."""
    ids = _ids(batch=4, seq=64)
    _, reference = _step(_model(), ids, LOSSES["hf"])
    model = _model()
    with head.chunked(model, "head", chunk_bytes=SMALL_CHUNKS, exact=False):
        _, got = _step(model, ids, LOSSES["hf"])
    for name in reference:
        if name != "lm_head.weight":
            assert torch.equal(got[name], reference[name]), name
    error = (got["lm_head.weight"] - reference["lm_head.weight"]).abs().max()
    scale = reference["lm_head.weight"].abs().max()
    assert error / scale < 1e-5, (error, scale)


def _peak(model: nn.Module, ids: torch.Tensor, loss_fn) -> tuple[int, int]:
    tracker = LiveBytes(excluded_keys(model, ids))
    with tracker:
        loss = loss_fn(model(ids), ids)
        tracker.mark("forward")
        loss.backward()
        del loss
        tracker.mark("end")
    series = tracker.series(grad_keys(model))
    tracker.release()
    return series[tracker.marks["forward"] - 1], max(series)


def test_head_mode_holds_the_hidden_states_and_peaks_near_one_logits() -> None:
    """Held after forward: torch's loss keeps one logits-sized log-softmax; loss mode keeps the logits
    (the same size); head mode only the hidden states. Peak: torch about three logits (log-softmax and
    two gradients), head mode about one (the logits in forward) plus a few chunks."""
    ids = _ids(batch=4, seq=128)
    logits_bytes = ids.numel() * VOCAB * 4
    model = _model(frozen_head=True)
    held_plain, peak_plain = _peak(model, ids, LOSSES["hf"])
    with head.chunked(model, "loss", chunk_bytes=SMALL_CHUNKS):
        held_loss, peak_loss = _peak(model, ids, LOSSES["hf"])
    with head.chunked(model, "head", chunk_bytes=SMALL_CHUNKS):
        held_head, peak_head = _peak(model, ids, LOSSES["hf"])
    assert held_plain >= logits_bytes and peak_plain >= 2.9 * logits_bytes
    assert held_loss < held_plain + 1e5 and peak_loss < peak_plain - 0.9 * logits_bytes
    assert held_head < 0.05 * logits_bytes
    assert peak_head < 1.3 * logits_bytes


def test_logits_changed_before_backward_raise_checkpoint_error() -> None:
    """The head's weight changed in place between forward and backward (the recompute would differ):
    torch's own version check fires; a recompute that differs otherwise raises ``CheckpointError``."""
    model = _model(frozen_head=True)
    ids = _ids()
    with head.chunked(model, "head", chunk_bytes=SMALL_CHUNKS):
        loss = LOSSES["hf"](model(ids), ids)
        with torch.no_grad():
            model.lm_head.weight.mul_(2)
        with pytest.raises(RuntimeError, match="modified by an inplace operation"):
            loss.backward()
    rows = torch.zeros(4, VOCAB)
    entry = chunks.PendingLoss(torch.arange(4), torch.zeros(4, dtype=torch.int64), torch.ones(()), torch.tensor(4.0),
                          chunks.row_checksums(rows + 1), -100, "mean", torch.float32)
    with pytest.raises(CheckpointError, match="recomputed for backward differ"):
        projection.chunk_logits_grad(torch.zeros(4, WIDTH), torch.zeros(VOCAB, WIDTH), None, 0, 4, entry,
                                projection.inverse_rows(entry, 4))


def test_forms_it_does_not_chunk_run_as_torch() -> None:
    """Class weights, label smoothing, probability targets, 3-d inputs, no grad, a bad target: torch's
    own result or error, unchanged."""
    model = _model()
    ids = _ids()
    with head.chunked(model, "head"):
        logits = model(ids)
        plain = logits.detach().as_subclass(torch.Tensor)
        for kwargs in ({"label_smoothing": 0.1}, {"weight": torch.rand(VOCAB)}):
            got = F.cross_entropy(logits.view(-1, VOCAB), ids.view(-1), **kwargs)
            assert torch.equal(got, F.cross_entropy(plain.view(-1, VOCAB), ids.view(-1), **kwargs))
        got = F.cross_entropy(logits.transpose(1, 2), ids)
        assert torch.equal(got, F.cross_entropy(plain.transpose(1, 2), ids))
        bad = ids.view(-1).clone()
        bad[3] = VOCAB
        with pytest.raises(IndexError, match="out of bounds"):
            F.cross_entropy(logits.view(-1, VOCAB), bad)
        assert type(logits.softmax(-1)) is torch.Tensor  # other uses get plain tensors
    assert type(model(ids)) is torch.Tensor


def test_chunk_rows_never_below_sixteen_rows() -> None:
    assert head.chunk_rows(10, VOCAB, 4, 1) == [(0, 10)]
    assert head.chunk_rows(40, VOCAB, 4, 1) == [(0, 16), (16, 40)]
    assert head.chunk_rows(1024, 10, 4, 2**30) == [(s, s + 128) for s in range(0, 1024, 128)]  # an eighth
    chunks = head.chunk_rows(1000, VOCAB, 4, 64 * VOCAB * 4)
    assert chunks[0] == (0, 64) and chunks[-1][1] == 1000 and all(e - s >= 16 for s, e in chunks)


def test_install_refuses_bad_arguments_and_models_without_a_head() -> None:
    with pytest.raises(ValueError, match="mode must be one of"):
        head.install(_model(), "logits")
    with pytest.raises(ValueError, match="chunk_bytes"):
        head.install(_model(), chunk_bytes=0)
    assert not head.install(nn.Sequential(nn.Linear(2, 2)))


def test_an_install_leaves_with_its_model(monkeypatch: pytest.MonkeyPatch) -> None:
    """Installs are keyed by the model itself, held weakly: once a model is collected its record
    goes, and a new model that gets the collected one's ``id`` is not taken for installed (keyed
    by ``id(model)``, ``installed_mode`` said "loss" for it and the planner left its head
    unchunked). CPython reuses a freed address for the next object of its size, but not reliably
    under pytest, so ``acshim.head.installing``'s ``id`` gives every model the same number here."""
    import weakref

    monkeypatch.setattr(installing, "id", lambda obj: 12345, raising=False)
    model = _model()
    assert head.install(model, "loss") and head.installed_mode(model) == "loss"
    alive = weakref.ref(model)
    del model  # freed here: nothing else refers to it
    assert alive() is None and len(head.INSTALLS) == 0
    fresh = TinyLM()
    assert head.installed_mode(fresh) is None
    assert head.install(fresh, "head") and head.installed_mode(fresh) == "head"
    head.remove(fresh)
    assert head.installed_mode(fresh) is None and len(head.INSTALLS) == 0


def test_uninstall_takes_every_chunked_head_off() -> None:
    """A plan's chunked head is a change to the user's model: ``acshim.uninstall()`` undoes it with
    the patches, on every model that has one."""
    import acshim

    models = [_model(), _model()]
    acshim.install()
    try:
        assert head.install(models[0], "head") and head.install(models[1], "loss")
    finally:
        acshim.uninstall()
    assert all("forward" not in m.lm_head.__dict__ and head.installed_mode(m) is None for m in models)
    assert len(head.INSTALLS) == 0


def test_the_chunked_head_makes_every_tensor_on_the_logits_device() -> None:
    """The chunked head and loss run wherever the model does: each tensor they create names its
    device (on a GPU, row indices made on the CPU beside CUDA targets raised "Expected all tensors
    to be on the same device" in the backward of the head's projection; found on an H200 on
    2026-11-27). This machine has no GPU, so the rule is checked in the source: no tensor factory
    in ``acshim/head`` is called without ``device=``."""
    import ast
    from pathlib import Path

    factories = {"arange", "full", "zeros", "ones", "empty", "tensor", "rand", "randn", "randint", "eye", "as_tensor"}
    folder = Path(head.__file__).parent
    undeviced = []
    for path in sorted(folder.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in factories
                    and isinstance(node.func.value, ast.Name) and node.func.value.id == "torch"
                    and not any(keyword.arg == "device" for keyword in node.keywords)):
                undeviced.append(f"{path.name}:{node.lineno}: torch.{node.func.attr}")
    assert len(list(folder.rglob("*.py"))) >= 3 and not undeviced, undeviced


_ON_CUDA = pytest.param("cuda", marks=[pytest.mark.cuda, pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA device (pytest -m cuda on a GPU)")])


@pytest.mark.parametrize("device", ["cpu", _ON_CUDA])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
@pytest.mark.parametrize("shape,vocab", [((2, 64, 48), 3001), ((96, 48), 517), ((2, 3, 5, 48), 64), ((1, 1, 48), 8)])
def test_the_head_backward_without_its_forward_gives_autograds_gradients_bitwise(dtype, shape, vocab, device) -> None:
    """The trainable exact head's backward runs the two matmuls autograd runs for ``F.linear``
    (no logits-sized output computed again): bitwise equal to autograd on ``F.linear``, on the CPU
    and on CUDA (cuBLAS picks its kernels by the same shapes and strides); a bias or a
    non-contiguous input takes autograd's own path."""
    torch.manual_seed(0)
    hidden = torch.randn(*shape, dtype=dtype, device=device)
    weight = torch.randn(vocab, shape[-1], dtype=dtype, device=device)
    grad = torch.randn(*shape[:-1], vocab, dtype=dtype, device=device)
    for needs in [(True, True, False), (False, True, False), (True, False, False)]:
        fast = projection._linear_backward(hidden, weight, None, grad, needs)
        slow = projection._linear_backward_by_autograd(hidden, weight, None, grad, needs)
        for a, b in zip(fast, slow, strict=True):
            assert (a is None and b is None) or torch.equal(a, b)
    calls: list[int] = []
    original = projection._linear_backward_by_autograd
    try:
        projection._linear_backward_by_autograd = lambda *args: calls.append(1) or original(*args)
        bias = torch.randn(vocab, dtype=dtype, device=device)
        projection._linear_backward(hidden, weight, bias, grad, (True, True, True))
        strided = torch.randn(*shape[:-1], 2 * shape[-1], dtype=dtype, device=device)[..., ::2]  # not contiguous
        projection._linear_backward(strided, weight, None, grad, (True, True, False))
    finally:
        projection._linear_backward_by_autograd = original
    assert len(calls) == 2


def test_a_trainable_exact_head_peaks_near_one_logits_in_backward() -> None:
    """With the head trainable (exact), the backward holds the logits' gradient and the weight's,
    not a recomputed logits-sized output as well: about 1.3 logits at peak, where the path that
    ran ``F.linear`` again for its backward peaked above two (its forward output beside the
    gradient)."""
    ids = _ids(batch=4, seq=128)
    logits_bytes = ids.numel() * VOCAB * 4
    model = _model()
    with head.chunked(model, "head", chunk_bytes=SMALL_CHUNKS):
        _, peak_head = _peak(model, ids, LOSSES["hf"])
    original = projection._linear_backward
    try:
        projection._linear_backward = projection._linear_backward_by_autograd
        with head.chunked(model, "head", chunk_bytes=SMALL_CHUNKS):
            _, peak_autograd = _peak(model, ids, LOSSES["hf"])
    finally:
        projection._linear_backward = original
    assert peak_head < 1.5 * logits_bytes, peak_head / logits_bytes
    assert peak_autograd > peak_head + 0.8 * logits_bytes, (peak_autograd / logits_bytes, peak_head / logits_bytes)
