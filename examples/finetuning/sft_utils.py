"""Model and data helpers of the PEFT-shaped SFT script (the layout of PEFT's examples/sft/utils.py:
``create_and_prepare_model`` and ``create_datasets``), loading everything from local paths."""

import os

import torch
from datasets import DatasetDict, load_dataset
from peft import LoraConfig
from transformers import AutoModelForCausalLM, AutoTokenizer


def create_datasets(tokenizer, data_args, training_args, apply_chat_template=False):
    raw_datasets = DatasetDict()
    for split in data_args.splits.split(","):
        # a local folder of <split>.jsonl files (no hub access here)
        raw_datasets[split] = load_dataset("json", data_files=os.path.join(data_args.dataset_name, f"{split}.jsonl"),
                                           split="train")
    train_data, valid_data = raw_datasets["train"], raw_datasets["test"]
    print(f"Size of the train set: {len(train_data)}. Size of the validation set: {len(valid_data)}")
    return train_data, valid_data


def create_and_prepare_model(args, data_args, training_args):
    model = AutoModelForCausalLM.from_pretrained(args.model_name_or_path, attn_implementation="eager",
                                                 dtype=torch.float32)
    peft_config = None
    if args.use_peft_lora:
        peft_config = LoraConfig(lora_alpha=args.lora_alpha, lora_dropout=args.lora_dropout, r=args.lora_r, bias="none",
                                 task_type="CAUSAL_LM", target_modules=args.lora_target_modules.split(","))
    tokenizer = AutoTokenizer.from_pretrained(args.model_name_or_path)
    tokenizer.pad_token = tokenizer.eos_token
    return model, peft_config, tokenizer
