"""TRL: activation offloading as ``SFTTrainer`` does it (``SFTConfig(activation_offloading=True)`` calls
``trl.models.get_act_offloading_ctx_manager``), with gradient checkpointing, in a plain loop.

Written purely against the TRL and transformers APIs. On CPU, TRL 1.16's own manager fails when built
(``'NoneType' object has no attribute 'type'``); under `acshim run examples/trl_activation_offloading.py`
it runs on acshim's storage tier (``ACSHIM_OFFLOAD_STORAGE=disk`` sends the activations to disk) and
the checkpointing on acshim's engine. `--no-checkpointing` runs the same step with neither.
Last line: GRADS <sha256 of all gradients>.
"""

import contextlib
import hashlib
import sys

import torch
import transformers
from trl.models import get_act_offloading_ctx_manager


def main() -> None:
    checkpointing = "--no-checkpointing" not in sys.argv
    torch.manual_seed(0)
    config = transformers.LlamaConfig(num_hidden_layers=3, hidden_size=64, intermediate_size=128, num_attention_heads=4,
                                      num_key_value_heads=2, vocab_size=128, max_position_embeddings=64,
                                      attention_dropout=0.1)
    model = transformers.LlamaForCausalLM(config)
    model.train()
    model.config.use_cache = False
    offloading = contextlib.nullcontext()
    if checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        offloading = get_act_offloading_ctx_manager(model, use_pin_memory=False, min_offload_size=0)
    input_ids = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(1))
    torch.manual_seed(2)
    with offloading:
        loss = model(input_ids=input_ids, labels=input_ids).loss
    loss.backward()
    digest = hashlib.sha256()
    for _, parameter in model.named_parameters():
        if parameter.grad is not None:
            digest.update(parameter.grad.detach().float().contiguous().numpy().tobytes())
    print(f"loss {loss.item():.6f}")
    print(f"GRADS {digest.hexdigest()}")


if __name__ == "__main__":
    main()
