"""A SageMaker model parallelism v2 training script in the documented pattern, written only
against torch, transformers and ``torch.sagemaker``: ``dist.init_process_group``, ``tsm.init``,
``tsm.transform``, FSDP (FSDP1 with a transformer auto-wrap policy as SMP's docs show, or FSDP2
``fully_shard``), ``apply_activation_checkpointing`` on each GPT-2 block, optionally
``offload_wrapper`` on the root (``sm_activation_offloading``), then ``loss.backward()`` and
``tsm.grad_norm.clip_grad_norm_``. Each case trains two steps with checkpointing and two without on
the same ranks; every rank prints one ``RESULT {json}`` line: case -> "equal" or what differed.

usage: smp_v2_fsdp.py [--cases fsdp1/reentrant,fsdp2/non_reentrant,...]
"""

from __future__ import annotations

import argparse
import functools
import json

import torch
import torch.distributed as dist
import torch.sagemaker as tsm
import transformers
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
    CheckpointImpl,
    apply_activation_checkpointing,
    checkpoint_wrapper,
    offload_wrapper,
)
from transformers.models.gpt2.modeling_gpt2 import GPT2Block

CASES = ("fsdp1/reentrant", "fsdp1/non_reentrant", "fsdp2/non_reentrant", "fsdp2/reentrant+offload")


def build(engine: str, checkpoint: str | None) -> torch.nn.Module:
    torch.manual_seed(0)
    config = transformers.GPT2Config(n_layer=3, n_embd=32, n_head=4, n_positions=32, vocab_size=64,
                                     resid_pdrop=0.1, embd_pdrop=0.1, attn_pdrop=0.1, use_cache=False)
    model = tsm.transform(transformers.GPT2LMHeadModel(config))
    if engine == "fsdp1":
        from torch.distributed.fsdp import FullyShardedDataParallel
        from torch.distributed.fsdp.wrap import transformer_auto_wrap_policy

        model = FullyShardedDataParallel(
            model, auto_wrap_policy=functools.partial(transformer_auto_wrap_policy, transformer_layer_cls={GPT2Block}),
            device_id=torch.device("cpu"))
    if checkpoint is not None:
        impl = CheckpointImpl.REENTRANT if checkpoint.startswith("reentrant") else CheckpointImpl.NO_REENTRANT
        apply_activation_checkpointing(model, checkpoint_wrapper_fn=functools.partial(checkpoint_wrapper,
                                                                                        checkpoint_impl=impl),
                                       check_fn=lambda module: isinstance(module, GPT2Block))
    if engine == "fsdp2":  # torchtitan's order: checkpointing first, then sharding
        from torch.distributed.fsdp import fully_shard

        for module in model.modules():
            if isinstance(module, GPT2Block):
                fully_shard(module)
        fully_shard(model)
    if checkpoint is not None and checkpoint.endswith("+offload"):
        model = offload_wrapper(model)  # applied last, to the root, as SMP's docs say
    return model


def gradients(model: torch.nn.Module) -> list[torch.Tensor]:
    """This rank's shard of every gradient (equal shards on every rank mean equal gradients)."""
    result = []
    for parameter in model.parameters():
        grad = parameter.grad
        result.append(grad.to_local() if hasattr(grad, "to_local") else grad)
    return [g.clone() for g in result]


def train(model: torch.nn.Module) -> tuple[list[float], list[torch.Tensor]]:
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    losses = []
    for step in range(2):
        torch.manual_seed(10 * step + dist.get_rank())  # the data shard and dropout masks of this rank
        input_ids = torch.randint(0, 64, (2, 16))
        optimizer.zero_grad(set_to_none=True)
        loss = model(input_ids=input_ids, labels=input_ids)["loss"]
        loss.backward()
        tsm.grad_norm.clip_grad_norm_(model, 1.0)
        grads = gradients(model)
        optimizer.step()
        losses.append(loss.item())
    return losses, grads


def compare(case: str) -> str:
    engine, checkpoint = case.split("/")
    plain_losses, plain_grads = train(build(engine, None))
    losses, grads = train(build(engine, checkpoint))
    if losses != plain_losses:
        return f"losses differ: {losses} vs {plain_losses}"
    differing = sum(not torch.equal(a, b) for a, b in zip(grads, plain_grads))
    return "equal" if differing == 0 and len(grads) == len(plain_grads) else f"{differing} gradients differ"


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--cases", default=",".join(CASES))
    args = parser.parse_args()
    dist.init_process_group("gloo")
    tsm.init({"sm_activation_offloading": True, "activation_loading_horizon": 2})
    results = {case: compare(case) for case in args.cases.split(",")}
    print("RESULT " + json.dumps({"rank": dist.get_rank(), "tsm_rank": tsm.state.rank,
                                  "tsm_world_size": tsm.state.world_size, "results": results}), flush=True)
    dist.destroy_process_group()
    # the run without acshim waits for Gloo's worker threads at exit as acshim does (acshim/exit_settle.py:
    # torch 2.13 aborts a rank that finalizes while one drops its last work); imported after the results
    from acshim.exit_settle import settle_collective_threads

    settle_collective_threads()


if __name__ == "__main__":
    main()
