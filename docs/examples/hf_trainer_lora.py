"""A plain transformers ``Trainer`` + peft LoRA script, spot-safe by one line (see docs/runtime.md).

It fine-tunes the builtin tiny GPT-2 on the shipped prompt/response JSONL with the prompt masked
out of the loss. Everything but the last line is what a team's own script already has; the
spot contract is ``sys.exit(spot_train(trainer))`` in place of ``trainer.train()``. Run it as the
operator's training command, with the checkpoint URI on the command line or in
``$SPOTSCHED_CHECKPOINT_URI``::

    DeadlineSpotFineTuneOperator(..., checkpoint_uri="/data/ckpt/job1",
                                 command="python docs/examples/hf_trainer_lora.py --checkpoint-uri /data/ckpt/job1")

Exit codes: 0 done (adapter under URI/final/), 75 preempted after an emergency checkpoint (run
it again to resume), 1 failure, 2 bad arguments.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Any

import torch
from transformers import Trainer, TrainingArguments

from airflow_provider_spotsched.runtime.config import BUILTIN_MODEL, LoraSettings
from airflow_provider_spotsched.runtime.contract import EXIT_USAGE
from airflow_provider_spotsched.runtime.data import TEXT_DIR
from airflow_provider_spotsched.runtime.hf_callback import spot_train
from airflow_provider_spotsched.runtime.model import load_model_and_tokenizer, wrap_lora

IGNORE = -100  # label value the loss skips: the prompt's tokens and the padding


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--checkpoint-uri", default=os.environ.get("SPOTSCHED_CHECKPOINT_URI"),
                        help="checkpoints, progress.json and the final adapter (default $SPOTSCHED_CHECKPOINT_URI)")
    parser.add_argument("--data", default=str(TEXT_DIR / "sft.jsonl"), help="JSONL of {prompt, response}")
    parser.add_argument("--max-steps", type=int, default=60)
    parser.add_argument("--batch-size", type=int, default=8,
                        help="global batch: split over the processes torchrun starts, so any world size trains alike")
    parser.add_argument("--seq-len", type=int, default=64)
    parser.add_argument("--lr", type=float, default=2e-3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads")
    parser.add_argument("--bf16", action="store_true", help="bf16 mixed precision (a GPU that has it)")
    args = parser.parse_args()
    if not args.checkpoint_uri:
        parser.error("--checkpoint-uri (or $SPOTSCHED_CHECKPOINT_URI) is required")
    if args.batch_size % world_size():
        parser.error(f"--batch-size {args.batch_size} must be a multiple of the {world_size()} processes "
                     "(WORLD_SIZE) it is split over")
    return args


def world_size() -> int:
    """The processes torchrun started for this job (1 when run directly)."""
    return int(os.environ.get("WORLD_SIZE") or 1)


def load_pairs(path: str, tokenizer: Any, seq_len: int) -> list[dict[str, list[int]]]:
    """Tokenised prompt + response + EOS, labels only on the response (prompt masking)."""
    examples = []
    for number, line in enumerate(Path(path).read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as error:
            raise ValueError(f"{path}:{number}: not JSON ({error})") from None
        if not isinstance(record, dict) or not {"prompt", "response"} <= set(record):
            raise ValueError(f"{path}:{number}: need an object with prompt and response, got {line[:60]!r}")
        prompt = tokenizer(record["prompt"] + "\n", add_special_tokens=False)["input_ids"]
        response = tokenizer(record["response"], add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
        ids = (prompt + response)[:seq_len]
        labels = ([IGNORE] * len(prompt) + response)[:seq_len]
        examples.append({"input_ids": ids, "labels": labels})
    return examples


def collate(pad_id: int) -> Any:
    def pad(batch: list[dict[str, list[int]]]) -> dict[str, torch.Tensor]:
        width = max(len(example["input_ids"]) for example in batch)
        ids = [e["input_ids"] + [pad_id] * (width - len(e["input_ids"])) for e in batch]
        labels = [e["labels"] + [IGNORE] * (width - len(e["labels"])) for e in batch]
        mask = [[1] * len(e["input_ids"]) + [0] * (width - len(e["input_ids"])) for e in batch]
        return {"input_ids": torch.tensor(ids), "labels": torch.tensor(labels), "attention_mask": torch.tensor(mask)}
    return pad


def main() -> int:
    args = parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)  # the LoRA initialisation
    base, tokenizer = load_model_and_tokenizer(BUILTIN_MODEL)
    model = wrap_lora(base, LoraSettings(), BUILTIN_MODEL)
    training = TrainingArguments(
        output_dir=str(Path(args.checkpoint_uri) / "checkpoints"), max_steps=args.max_steps,
        per_device_train_batch_size=args.batch_size // world_size(), learning_rate=args.lr, seed=args.seed,
        lr_scheduler_type="linear", warmup_steps=0, logging_steps=1, save_strategy="no",
        report_to="none", disable_tqdm=True, use_cpu=not torch.cuda.is_available(), bf16=args.bf16,
        dataloader_num_workers=0, remove_unused_columns=False,
    )
    try:
        examples = load_pairs(args.data, tokenizer, args.seq_len)
    except (OSError, ValueError) as error:
        print(f"hf_trainer_lora: --data: {error}", file=sys.stderr)
        return EXIT_USAGE
    trainer = Trainer(model=model, args=training, train_dataset=examples,
                      data_collator=collate(tokenizer.pad_token_id), processing_class=tokenizer)
    return spot_train(trainer, args.checkpoint_uri)  # the one line: instead of trainer.train()


if __name__ == "__main__":
    sys.exit(main())
