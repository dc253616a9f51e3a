"""A PEFT-style supervised fine-tuning script (the structure of PEFT's examples/sft/train.py: argument
dataclasses, ``create_and_prepare_model``, TRL's ``SFTTrainer`` with LoRA adapters on a frozen model,
gradient checkpointing with ``use_reentrant`` from the command line), written for TRL 1.x's
``SFTConfig`` and local data. Run it plain, or unchanged under ``acshim run --budget 0.5``."""

import os
import sys
from dataclasses import dataclass, field

from sft_utils import create_and_prepare_model, create_datasets
from transformers import HfArgumentParser, set_seed
from trl import SFTConfig, SFTTrainer


@dataclass
class ModelArguments:
    model_name_or_path: str = field(metadata={"help": "Path to the pretrained model"})
    lora_alpha: int = field(default=16)
    lora_dropout: float = field(default=0.1)
    lora_r: int = field(default=64)
    lora_target_modules: str = field(default="q_proj,k_proj,v_proj,o_proj,down_proj,up_proj,gate_proj")
    use_peft_lora: bool = field(default=False, metadata={"help": "Enables PEFT LoRA for training."})
    use_reentrant: bool = field(default=False, metadata={"help": "Gradient checkpointing parameter"})


@dataclass
class DataTrainingArguments:
    dataset_name: str = field(default="data", metadata={"help": "A folder of train.jsonl / test.jsonl"})
    splits: str = field(default="train,test")


def main(model_args, data_args, training_args):
    set_seed(training_args.seed)
    model, peft_config, tokenizer = create_and_prepare_model(model_args, data_args, training_args)

    model.config.use_cache = not training_args.gradient_checkpointing
    if training_args.gradient_checkpointing:
        training_args.gradient_checkpointing_kwargs = {"use_reentrant": model_args.use_reentrant}

    train_dataset, eval_dataset = create_datasets(tokenizer, data_args, training_args)
    trainer = SFTTrainer(model=model, processing_class=tokenizer, args=training_args, train_dataset=train_dataset,
                         eval_dataset=eval_dataset, peft_config=peft_config)
    if model_args.use_peft_lora:
        trainer.model.print_trainable_parameters()
    trainer.train()
    trainer.save_model()


if __name__ == "__main__":
    parser = HfArgumentParser((ModelArguments, DataTrainingArguments, SFTConfig))
    if len(sys.argv) == 2 and sys.argv[1].endswith(".json"):
        model_args, data_args, training_args = parser.parse_json_file(json_file=os.path.abspath(sys.argv[1]))
    else:
        model_args, data_args, training_args = parser.parse_args_into_dataclasses()
    main(model_args, data_args, training_args)
