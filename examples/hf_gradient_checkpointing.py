"""Hugging Face transformers: a plain training loop that turns on gradient checkpointing.

Written purely against the transformers API. Under `acshim run examples/hf_gradient_checkpointing.py`
the `gradient_checkpointing_enable` call is carried out by the acshim engine.
`--no-checkpointing` runs the same step without it. Last line: GRADS <sha256 of all gradients>.
"""

import hashlib
import sys

import torch
import transformers


def main() -> None:
    checkpointing = "--no-checkpointing" not in sys.argv
    torch.manual_seed(0)
    config = transformers.LlamaConfig(num_hidden_layers=3, hidden_size=64, intermediate_size=128, num_attention_heads=4,
                                      num_key_value_heads=2, vocab_size=128, max_position_embeddings=64,
                                      attention_dropout=0.1)
    model = transformers.LlamaForCausalLM(config)
    model.train()
    if checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": True})
    input_ids = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(1))
    torch.manual_seed(2)
    loss = model(input_ids=input_ids, labels=input_ids, use_cache=True).loss
    loss.backward()
    digest = hashlib.sha256()
    for _, parameter in model.named_parameters():
        if parameter.grad is not None:
            digest.update(parameter.grad.detach().float().contiguous().numpy().tobytes())
    print(f"loss {loss.item():.6f}")
    print(f"GRADS {digest.hexdigest()}")


if __name__ == "__main__":
    main()
