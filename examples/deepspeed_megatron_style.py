"""A Megatron-DeepSpeed style training step using DeepSpeed activation checkpointing.

Written purely against DeepSpeed's API. Run it with ``acshim run examples/deepspeed_megatron_style.py``:
``deepspeed`` then resolves to acshim's facade, or, where DeepSpeed is installed, to DeepSpeed with its
checkpointing entry points running on acshim (no ``deepspeed.init_distributed()`` needed).
``--no-checkpointing`` runs the same model and step without checkpointing; the printed gradient
digests must match.
"""

import argparse
import hashlib

import deepspeed
import torch
from torch import nn

DS_CONFIG = {
    "train_micro_batch_size_per_gpu": 2,
    "activation_checkpointing": {
        "partition_activations": True,
        "contiguous_memory_optimization": False,
        "cpu_checkpointing": False,
        "number_checkpoints": 2,
        "synchronize_checkpoint_boundary": False,
        "profile": False,
    },
}


class SingleRankMPU:
    """A model-parallel unit for one process (tensor-model-parallel world of 1)."""

    def get_tensor_model_parallel_rank(self):
        return 0

    def get_tensor_model_parallel_world_size(self):
        return 1

    def get_tensor_model_parallel_group(self):
        return None

    def get_data_parallel_rank(self):
        return 0

    def get_data_parallel_world_size(self):
        return 1


class ParallelTransformerLayer(nn.Module):
    def __init__(self, hidden: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.input_norm = nn.LayerNorm(hidden)
        self.qkv = nn.Linear(hidden, 3 * hidden)
        self.dense = nn.Linear(hidden, hidden)
        self.post_norm = nn.LayerNorm(hidden)
        self.mlp_in = nn.Linear(hidden, 4 * hidden)
        self.mlp_out = nn.Linear(4 * hidden, hidden)
        self.attention_dropout = nn.Dropout(0.1)
        self.hidden_dropout = nn.Dropout(0.1)

    def forward(self, hidden_states, attention_mask):
        batch, seq, width = hidden_states.shape
        q, k, v = self.qkv(self.input_norm(hidden_states)).chunk(3, dim=-1)
        q, k, v = (t.view(batch, seq, self.heads, -1).transpose(1, 2) for t in (q, k, v))
        scores = (q @ k.transpose(-1, -2)) / (q.shape[-1] ** 0.5)
        probs = torch.softmax(scores.masked_fill(attention_mask, -10000.0), dim=-1)
        with deepspeed.checkpointing.get_cuda_rng_tracker().fork():  # model-parallel region
            probs = self.attention_dropout(probs)
        context = (probs @ v).transpose(1, 2).reshape(batch, seq, width)
        hidden_states = hidden_states + self.hidden_dropout(self.dense(context))
        mlp = self.mlp_out(torch.nn.functional.gelu(self.mlp_in(self.post_norm(hidden_states))))
        return hidden_states + self.hidden_dropout(mlp)


class GPTModel(nn.Module):
    def __init__(self, vocab=64, hidden=32, heads=4, layers=4, checkpoint_layers=1, use_checkpointing=True):
        super().__init__()
        self.embedding = nn.Embedding(vocab, hidden)
        self.embedding_dropout = nn.Dropout(0.1)
        self.layers = nn.ModuleList(ParallelTransformerLayer(hidden, heads) for _ in range(layers))
        self.final_norm = nn.LayerNorm(hidden)
        self.head = nn.Linear(hidden, vocab)
        self.checkpoint_layers = checkpoint_layers
        self.use_checkpointing = use_checkpointing

    def _custom(self, start, end):
        def custom_forward(*inputs):
            hidden = inputs[0]
            for layer in self.layers[start:end]:
                hidden = layer(hidden, inputs[1])
            return hidden

        return custom_forward

    def forward(self, input_ids, attention_mask):
        hidden = self.embedding_dropout(self.embedding(input_ids))
        for start in range(0, len(self.layers), self.checkpoint_layers):
            custom = self._custom(start, start + self.checkpoint_layers)
            if self.use_checkpointing:
                hidden = deepspeed.checkpointing.checkpoint(custom, hidden, attention_mask)
            else:
                hidden = custom(hidden, attention_mask)
        return self.head(self.final_norm(hidden))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--no-checkpointing", action="store_true")
    args = parser.parse_args()
    use_checkpointing = not args.no_checkpointing

    mpu = SingleRankMPU()
    if use_checkpointing:
        deepspeed.checkpointing.configure(mpu, deepspeed_config=DS_CONFIG, num_checkpoints=4)
        assert deepspeed.checkpointing.is_configured()
    torch.manual_seed(0)
    model = GPTModel(use_checkpointing=use_checkpointing)
    deepspeed.checkpointing.model_parallel_cuda_manual_seed(1234)

    input_ids = torch.randint(0, 64, (2, 16))
    labels = torch.randint(0, 64, (2, 16))
    causal = torch.triu(torch.ones(16, 16, dtype=torch.bool), diagonal=1)
    logits = model(input_ids, causal)
    loss = nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1))
    loss.backward()

    digest = hashlib.sha256()
    for _, parameter in model.named_parameters():
        digest.update(parameter.grad.detach().to(torch.float32).contiguous().numpy().tobytes())
    print(f"loss {loss.item():.6f}")
    print(f"GRADS {digest.hexdigest()}")


if __name__ == "__main__":
    main()
