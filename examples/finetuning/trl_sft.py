"""A TRL-style SFT script (the structure of TRL's trl/scripts/sft.py: ``TrlParser`` over
``ScriptArguments, SFTConfig, ModelConfig``, ``SFTTrainer`` given the model's path and
``get_peft_config``), reading a local dataset folder. Run it plain, or unchanged under
``acshim run --budget 0.5``:

    python trl_sft.py --model_name_or_path model --dataset_name data --use_peft --lora_r 8 \\
        --max_steps 2 --per_device_train_batch_size 2 --output_dir out --report_to none
"""

import argparse


def main(script_args, training_args, model_args):
    import os

    from datasets import load_dataset
    from trl import SFTTrainer, get_peft_config

    training_args.model_init_kwargs = dict(dtype=model_args.dtype, attn_implementation=model_args.attn_implementation)
    files = {split: os.path.join(script_args.dataset_name, f"{split}.jsonl") for split in ("train", "test")}
    dataset = load_dataset("json", data_files=files)

    trainer = SFTTrainer(
        model=model_args.model_name_or_path,
        args=training_args,
        train_dataset=dataset[script_args.dataset_train_split],
        eval_dataset=dataset[script_args.dataset_test_split] if training_args.eval_strategy != "no" else None,
        peft_config=get_peft_config(model_args),
    )
    trainer.train()
    trainer.accelerator.print("Training completed.")
    trainer.save_model(training_args.output_dir)


def make_parser(prog: str | None = None) -> argparse.ArgumentParser:
    from trl import ModelConfig, ScriptArguments, SFTConfig, TrlParser

    return TrlParser((ScriptArguments, SFTConfig, ModelConfig), prog=prog)


if __name__ == "__main__":
    parser = make_parser()
    script_args, training_args, model_args = parser.parse_args_and_config(fail_with_unknown_args=False)
    main(script_args, training_args, model_args)
