"""Hugging Face Trainer with `gradient_checkpointing=True` (one step, tiny GPT-2, data in memory).

Written purely against the transformers API. Under `acshim run examples/hf_trainer.py` the
checkpointing Trainer switches on is carried out by the acshim engine. `--no-checkpointing` runs
the same step without it. Last line: GRADS <sha256 of all gradients before the optimizer step>.
"""

import hashlib
import sys
import tempfile

import torch
import transformers


class GradDigest(transformers.TrainerCallback):
    def __init__(self, model: torch.nn.Module) -> None:
        self.model = model
        self.hexdigest = ""

    def on_pre_optimizer_step(self, args, state, control, **kwargs):
        digest = hashlib.sha256()
        for _, parameter in self.model.named_parameters():
            if parameter.grad is not None:
                digest.update(parameter.grad.detach().float().contiguous().numpy().tobytes())
        self.hexdigest = digest.hexdigest()


def main() -> None:
    checkpointing = "--no-checkpointing" not in sys.argv
    torch.manual_seed(0)
    config = transformers.GPT2Config(n_layer=3, n_embd=64, n_head=4, n_positions=64, vocab_size=128, bos_token_id=0, eos_token_id=1,
                                     resid_pdrop=0.1, embd_pdrop=0.1, attn_pdrop=0.1)
    model = transformers.GPT2LMHeadModel(config)
    ids = torch.randint(0, 128, (4, 16), generator=torch.Generator().manual_seed(1))
    data = [{"input_ids": row, "labels": row} for row in ids]
    with tempfile.TemporaryDirectory() as output_dir:
        args = transformers.TrainingArguments(
            output_dir=output_dir, per_device_train_batch_size=4, max_steps=1, report_to=[], save_strategy="no",
            use_cpu=True, seed=0, disable_tqdm=True, gradient_checkpointing=checkpointing,
            gradient_checkpointing_kwargs={"use_reentrant": False} if checkpointing else None)
        digest = GradDigest(model)
        trainer = transformers.Trainer(model=model, args=args, train_dataset=data, callbacks=[digest])
        trainer.train()
    print(f"GRADS {digest.hexdigest}")


if __name__ == "__main__":
    main()
