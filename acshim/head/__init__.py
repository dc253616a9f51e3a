"""The LM head and its cross-entropy in chunks of the sequence, with torch's own gradients.

One job a module: ``chunks`` (how rows are cut, the per-row kernels), ``loss`` (the chunked
cross-entropy and ``HeadLogits``), ``projection`` (the head's recompute in backward, and which rows a
loss's input is), ``installing`` (putting it on a model and taking it off).

What dominates a language model's training memory at a large vocabulary lies outside the blocks:
the logits (tokens x vocabulary) and what ``F.cross_entropy`` keeps of them for backward (its
log-softmax output), then the same sizes again in backward (the log-softmax's and the logits'
gradients). Fused and chunked cross-entropy kernels (Liger's, torchtune's chunked loss, Apple's
CCE, TRL's fused head) avoid that by working on a few tokens at a time. This module does the same
with torch's own kernels, so the gradients are those of ``F.cross_entropy`` bitwise:

- ``loss`` mode: the cross-entropy keeps its input (the logits) instead of its log-softmax output and
  recomputes the log-softmax chunk by chunk in backward, through ``torch.ops.aten.nll_loss_backward``
  and ``torch._log_softmax_backward_data``: the step holds one copy of the logits, not two or three.
- ``head`` mode: the output projection (``lm_head``) is run by ``HeadProjection``, which keeps only its input
  (the hidden states); a cross-entropy of its logits keeps nothing of them either, and the head's
  backward recomputes logits, log-softmax and gradients chunk by chunk. The logits still exist in
  forward (the model returns them), and are freed when the caller drops them.
- TRL's fused head (``SFTTrainer``'s ``fused_lm_head``) already works in tiles of tokens, 4096 by
  default, with several tile-sized temporaries on CPU: ``head`` mode runs its tiles at the chunk size.

Exactness. Every kernel used per chunk computes rows independently (log-softmax, its backward,
``nll_loss_backward`` given the whole batch's ``total_weight``), and the loss value comes from torch's
own ``nll_loss`` over the gathered per-token values, whose summation depends only on their number.
The head's matmuls per chunk give the rows of the whole matmul (measured on this BLAS for chunks of
16 rows or more; chunks are never smaller, and a batch at most one chunk runs whole): the forward's
logits are checked against their recompute (an integer checksum per row) and a mismatch raises
``CheckpointError``. A frozen head (LoRA, PEFT) gets bitwise gradients throughout. A trainable head's
weight gradient is a sum over tokens: by default (``exact=True``) the chunks fill one logits-sized
gradient and the head's backward runs whole, as torch's linear does (bitwise; still a third of the
memory); ``exact=False`` sums the chunks' products instead (the order of that sum differs from one
matmul's: a few float32 ulps; see ``tests/engine/test_head.py``).

A tensor the head returns is a ``HeadLogits`` (a ``torch.Tensor`` subclass): ``F.cross_entropy`` (or
``nn.CrossEntropyLoss``, or Hugging Face's loss) called on it, or on a view of it, comes here through
``__torch_function__``. Nothing global is patched; any other use of the logits gets plain tensors.

>>> with acshim.head.chunked(model):           # or acshim.head.install(model) / remove(model)
...     loss = model(input_ids=ids, labels=labels).loss
...     loss.backward()
>>> loss = acshim.head.cross_entropy(logits.view(-1, vocab), targets)   # the loss alone, loss mode
"""

from __future__ import annotations

from .chunks import DEFAULT_CHUNK_BYTES, MIN_ROWS, MODES, HeadConfig, chunk_rows, rows_per_chunk
from .installing import (
           INSTALLS,
           HeadForward,
           HeadInstalls,
           available,
           chunked,
           find_head,
           install,
           installed_mode,
           remove,
           remove_all,
)
from .loss import HeadLogits, cross_entropy

__all__ = ["DEFAULT_CHUNK_BYTES", "INSTALLS", "MIN_ROWS", "MODES", "HeadConfig", "HeadForward", "HeadInstalls",
           "HeadLogits", "available", "chunk_rows", "chunked", "cross_entropy", "find_head", "install",
           "installed_mode", "remove", "remove_all", "rows_per_chunk"]
