"""The default (hf) runtime's data and precision: datasets inputs, prompt masking, the eval split, settings.

Tokenisation tests run on the builtin tiny tokenizer and need no training; two end-to-end runs of
``spotsched-train`` (a few steps each, in-process) check the eval loss in ``progress.json`` and a
notice then a resume on the default runtime.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import fsspec
import pytest
import torch
from datasets import Dataset
from safetensors.torch import load_file

from airflow_provider_spotsched.runtime.config import BUILTIN_SFT, ConfigError, TrainConfig
from airflow_provider_spotsched.runtime.contract import EXIT_DONE, EXIT_PREEMPTED, EXIT_USAGE, Progress, read_progress
from airflow_provider_spotsched.runtime.hf_data import (
    SIMPLE_CHAT_TEMPLATE,
    ensure_chat_template,
    load_records,
    split_eval,
    tokenize,
    tokenize_messages,
)
from airflow_provider_spotsched.runtime.hf_runtime import build_trainer, check_launch, quantization_config, training_arguments
from airflow_provider_spotsched.runtime.model import load_model_and_tokenizer
from airflow_provider_spotsched.runtime.preemption import StopFlag
from tests.runtime_support import environment, run_inline, when_progress

CONVERSATION = [
    {"role": "system", "content": "Answer in one sentence."},
    {"role": "user", "content": "Where did Kira walk?"},
    {"role": "assistant", "content": "Kira walked to the river bank."},
    {"role": "user", "content": "What did she see?"},
    {"role": "assistant", "content": "A bear with calm eyes."},
]
IGNORE = -100  # the label value the loss skips
TINY_HF_JOB: dict[str, Any] = {"samples": 32, "batch_size": 8, "seq_len": 32, "lr": 0.002, "seed": 1,
                               "log_every_steps": 1, "checkpoint": {"min_interval_s": 0.2, "max_interval_s": 0.5}}


@pytest.fixture(scope="module", autouse=True)
def caches(tmp_path_factory):
    with environment(SPOTSCHED_CACHE_DIR=str(tmp_path_factory.mktemp("model-cache")),
                     HF_DATASETS_CACHE=str(tmp_path_factory.mktemp("datasets-cache"))):
        yield


@pytest.fixture(scope="module")
def tokenizer():
    _, tokenizer = load_model_and_tokenizer("builtin:tiny-gpt2")
    ensure_chat_template(tokenizer, None, builtin_model=True)
    return tokenizer


def labels(example: dict[str, list[int]]) -> list[int]:
    """The labels a completion mask means (TRL's reading of it): the ids where it is 1, -100 elsewhere."""
    return [token if keep else IGNORE for token, keep in zip(example["input_ids"], example["completion_mask"])]


def write_jsonl(path: Path, records: list[dict[str, Any]]) -> Path:
    path.write_text("".join(json.dumps(record) + "\n" for record in records))
    return path


# -- inputs ------------------------------------------------------------------------------------


def test_the_shipped_jsonl_loads_and_masks_exactly_the_prompt_and_its_newline(tokenizer):
    records = load_records(BUILTIN_SFT)
    assert len(records) == 300 and set(records.column_names) == {"prompt", "response"}
    example = tokenize(records.select(range(4)), tokenizer, 64, BUILTIN_SFT)[0]
    prompt = tokenizer(records[0]["prompt"] + "\n", add_special_tokens=False)["input_ids"]
    response = tokenizer(records[0]["response"], add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
    assert example["input_ids"] == prompt + response
    assert labels(example) == [IGNORE] * len(prompt) + response


def test_a_chat_template_labels_only_the_assistant_turns(tokenizer):
    ids, mask = tokenize_messages(tokenizer, CONVERSATION)
    assert len(ids) == len(mask) and tokenizer.decode(ids) == tokenizer.apply_chat_template(CONVERSATION, tokenize=False)
    # the labelled tokens are each assistant content with its EOS and newline, and nothing else
    eos = tokenizer.eos_token
    learnt = tokenizer.decode([token for token, keep in zip(ids, mask) if keep])
    assert learnt == f"Kira walked to the river bank.{eos}\nA bear with calm eyes.{eos}\n"
    spans, current = [], []
    for token, keep in zip(ids, mask):
        if keep:
            current.append(token)
        elif current:
            spans.append(current)
            current = []
    spans.append(current)
    assert [tokenizer.decode(span) for span in spans] == [
        f"Kira walked to the river bank.{eos}\n", f"A bear with calm eyes.{eos}\n"]
    masked = tokenizer.decode([token for token, keep in zip(ids, mask) if not keep])
    assert masked == ("<|system|>\nAnswer in one sentence.\n<|user|>\nWhere did Kira walk?\n<|assistant|>\n"
                      "<|user|>\nWhat did she see?\n<|assistant|>\n")
    example = {"input_ids": ids, "completion_mask": mask}
    assert [label == IGNORE for label in labels(example)] == [not keep for keep in mask]


def test_the_builtin_tokenizer_gets_the_simple_template_and_another_model_must_bring_one(tokenizer):
    assert tokenizer.chat_template == SIMPLE_CHAT_TEMPLATE

    class Bare:
        chat_template = None

    with pytest.raises(ConfigError, match="has no chat template: set chat_template in the config"):
        ensure_chat_template(Bare(), None, builtin_model=False)
    custom = Bare()
    ensure_chat_template(custom, "{{ messages }}", builtin_model=False)
    assert custom.chat_template == "{{ messages }}"


def test_a_jsonl_file_a_saved_dataset_and_a_hub_style_directory_all_load(tmp_path):
    rows = [{"messages": CONVERSATION}] * 3
    jsonl = write_jsonl(tmp_path / "chat.jsonl", rows)
    assert load_records(str(jsonl))[0]["messages"] == CONVERSATION

    saved = tmp_path / "saved"
    Dataset.from_list(rows).save_to_disk(str(saved))
    assert len(load_records(str(saved))) == 3

    hub = tmp_path / "hub"  # a repository as on the hub: a data directory with its splits' files
    (hub / "data").mkdir(parents=True)
    write_jsonl(hub / "data" / "train.jsonl", [{"text": "one"}, {"text": "two"}])
    write_jsonl(hub / "data" / "test.jsonl", [{"text": "three"}])
    assert list(load_records(str(hub))["text"]) == ["one", "two"]  # the train split


def test_an_fsspec_url_loads_through_storage_options():
    # s3fs is not installed here (gcsfs is, without credentials): fsspec's memory filesystem stands in
    # for a bucket, on the same code path an s3:// or gs:// URL takes
    with fsspec.open("memory://bucket/sft/train.jsonl", "w") as handle:
        handle.write(json.dumps({"prompt": "a", "response": "b"}) + "\n")
    records = load_records("memory://bucket/sft/train.jsonl", storage_options={})
    assert records[0] == {"prompt": "a", "response": "b"}


@pytest.mark.parametrize(("source", "message"), [
    ("builtin:stories", "is not a builtin dataset of runtime 'hf'"),
    ("/nonexistent/data.jsonl", "does not exist: give a .jsonl file"),
])
def test_a_dataset_that_is_not_there_is_named(source, message):
    with pytest.raises(ConfigError, match=message):
        load_records(source)


def test_records_of_an_unknown_shape_and_prompts_that_fill_seq_len_are_refused(tmp_path, tokenizer):
    with pytest.raises(ConfigError, match=r"has columns \['question'\]: expected messages"):
        tokenize(Dataset.from_list([{"question": "x"}]), tokenizer, 32, "q.jsonl")
    long = Dataset.from_list([{"prompt": "word " * 40, "response": "answer"}])
    with pytest.raises(ConfigError, match="no record has a token to learn within seq_len=8"):
        tokenize(long, tokenizer, 8, "long.jsonl")


def test_eval_fraction_holds_out_a_seeded_share():
    records = Dataset.from_list([{"text": str(i)} for i in range(20)])
    train, held_out = split_eval(records, 0.25, seed=3)
    assert (len(train), len(held_out)) == (15, 5)
    assert sorted(list(train["text"]) + list(held_out["text"])) == sorted(records["text"])
    assert list(split_eval(records, 0.25, seed=3)[1]["text"]) == list(held_out["text"])


# -- settings ----------------------------------------------------------------------------------


def test_precision_accumulation_and_checkpointing_reach_the_training_arguments(tmp_path):
    config = TrainConfig.from_dict({"samples": 100, "batch_size": 4, "gradient_accumulation_steps": 3, "dtype": "bf16",
                                    "gradient_checkpointing": True, "eval_fraction": 0.1, "eval_every_steps": 5,
                                    "warmup_fraction": 0.2, "log_every_steps": 2})
    args = training_arguments(config, str(tmp_path), has_eval=True)
    assert (args.bf16, args.fp16, args.activation_checkpointing) == (True, False, True)
    assert args.activation_checkpointing_kwargs == {"use_reentrant": False}
    assert (args.per_device_train_batch_size, args.gradient_accumulation_steps) == (4, 3)
    assert args.max_steps == 9  # ceil(100 samples / 12 per step)
    assert (args.eval_strategy, args.eval_steps, args.logging_steps, args.warmup_steps) == ("steps", 5, 2, 2)
    assert (args.save_strategy, args.completion_only_loss, args.max_length) == ("no", True, 64)
    plain = training_arguments(TrainConfig.from_dict({"samples": 8}), str(tmp_path), has_eval=False)
    assert (plain.bf16, plain.fp16, plain.activation_checkpointing, plain.eval_strategy) == (False, False, False, "no")
    assert TrainConfig.from_dict({"steps": 5, "batch_size": 4, "gradient_accumulation_steps": 2}).samples == 40


@pytest.mark.parametrize(("raw", "message"), [
    ({"dtype": "int8"}, r"dtype must be one of \['fp32', 'bf16', 'fp16'\], got 'int8'"),
    ({"gradient_checkpointing": "yes"}, "gradient_checkpointing must be true or false, got 'yes'"),
    ({"gradient_accumulation_steps": 0}, "gradient_accumulation_steps must be >= 1"),
    ({"eval_fraction": 1.0}, "eval_fraction must be < 1"),
    ({"eval_fraction": 0.1, "eval_dataset": "e.jsonl"}, "give eval_dataset .* or eval_fraction .*, not both"),
    ({"eval_every_steps": 5}, "eval_every_steps needs an eval split: set eval_dataset or eval_fraction"),
    ({"storage_options": ["anon"]}, "storage_options must be a JSON object of fsspec options"),
    ({"runtime": "deepspeed"}, r"runtime must be one of \['hf', 'loop'\]"),
    ({"global_batch_size": 16}, "global_batch_size is a setting of runtime 'loop'.*set runtime to 'loop'"),
    ({"runtime": "loop", "dtype": "bf16"}, "dtype is a setting of runtime 'hf'.*remove dtype, or set runtime to 'hf'"),
    ({"runtime": "loop", "eval_fraction": 0.1}, "eval_fraction is a setting of runtime 'hf'"),
    ({"quantization": "2bit"}, r"quantization must be one of \['4bit', '8bit'\] or null, got '2bit'"),
    ({"runtime": "loop", "quantization": "4bit"}, "quantization is a setting of runtime 'hf'"),
])
def test_a_bad_data_or_precision_setting_names_the_field_and_the_fix(raw, message):
    with pytest.raises(ConfigError, match=message):
        TrainConfig.from_dict({"samples": 8, **raw})


def test_the_default_runtime_is_hf_on_the_shipped_jsonl_and_the_loop_keeps_its_text():
    default = TrainConfig.from_dict({"samples": 8})
    assert (default.runtime, default.dataset, default.dtype) == ("hf", BUILTIN_SFT, "fp32")
    assert TrainConfig.from_dict({"samples": 8, "runtime": "loop"}).dataset == "builtin:synthetic-stories"


@pytest.mark.parametrize(("raw", "uri", "env", "message"), [
    ({"dtype": "fp16"}, "/tmp/ckpt", {}, "dtype 'fp16' needs a GPU .*use dtype 'bf16' or 'fp32' on CPU"),
    ({"quantization": "4bit"}, "/tmp/ckpt", {}, r"quantization '4bit' \(QLoRA\) needs a CUDA GPU"),
    ({}, "/tmp/ckpt", {"WORLD_SIZE": "2"}, "WORLD_SIZE=2 without torchrun.*runtime.node"),
    ({}, "/tmp/ckpt", {"WORLD_SIZE": "two"}, "WORLD_SIZE='two' is not a number of processes"),
    ({"batch_size": 4}, "s3://bucket/job", {"WORLD_SIZE": "3", "TORCHELASTIC_RUN_ID": "job-1"},
     "batch_size=4 is not a multiple of the world size 3"),
])
def test_what_this_machine_or_launch_cannot_run_is_refused_before_loading(raw, uri, env, message):
    import torch

    if torch.cuda.is_available() and ("fp16" in raw.get("dtype", "") or "quantization" in raw):
        pytest.skip("fp16 and QLoRA run on a GPU")
    with pytest.raises(ConfigError, match=message):
        check_launch(TrainConfig.from_dict({"samples": 8, **raw}), uri, env)


def test_a_separate_chat_eval_set_and_the_settings_reach_the_sft_trainer(tmp_path):
    eval_file = write_jsonl(tmp_path / "eval.jsonl", [{"messages": CONVERSATION}] * 3)
    config = TrainConfig.from_dict({"samples": 16, "batch_size": 4, "gradient_accumulation_steps": 2, "seq_len": 128,
                                    "eval_dataset": str(eval_file), "gradient_checkpointing": True, "dtype": "bf16"})
    trainer = build_trainer(config, str(tmp_path / "out"), StopFlag())
    assert (len(trainer.train_dataset), len(trainer.eval_dataset)) == (300, 3)
    assert trainer.processing_class.chat_template == SIMPLE_CHAT_TEMPLATE  # the builtin tokenizer got one
    ids, mask = tokenize_messages(trainer.processing_class, CONVERSATION)
    # what SFTTrainer trains on: its labels are exactly the mask's, -100 on every prompt token
    assert trainer.eval_dataset[0] == {"input_ids": ids, "labels": labels({"input_ids": ids, "completion_mask": mask})}
    args = trainer.args
    assert (args.max_steps, args.gradient_accumulation_steps, args.bf16, args.activation_checkpointing) == (2, 2, True, True)
    assert not any(type(callback).__name__ == "PrinterCallback" for callback in trainer.callback_handler.callbacks)


def test_bf16_is_allowed_on_cpu():
    check_launch(TrainConfig.from_dict({"samples": 8, "dtype": "bf16"}), "/tmp/ckpt", {})


def test_old_progress_files_without_eval_loss_still_load(tmp_path):
    old = {"samples_done": 8, "samples_total": 16, "step": 1, "loss": 2.0, "samples_per_second": 3.0,
           "world_size": 1, "checkpoint": "ckpt-000000001", "status": "running", "updated": "2025-10-14T03:00:00Z"}
    (tmp_path / "progress.json").write_text(json.dumps(old))
    progress = read_progress(str(tmp_path))
    assert progress.eval_loss is None and progress.samples_done == 8
    assert "eval_loss" not in progress.training_report()
    assert Progress(eval_loss=1.5, updated="x").training_report()["eval_loss"] == 1.5


# -- end to end on the default runtime -----------------------------------------------------------


def test_the_eval_loss_reaches_progress_json_a_rerun_stays_done_and_a_missing_dataset_exits_2(tmp_path, capsys):
    config = tmp_path / "config.json"
    config.write_text(json.dumps({**TINY_HF_JOB, "eval_fraction": 0.1, "eval_every_steps": 2}))
    code, events = run_inline(config, tmp_path / "ckpt")
    assert code == EXIT_DONE
    evals = [e for e in events if e["event"] == "eval"]
    assert [e["step"] for e in evals] == [2, 4]  # every 2 steps, the last one included
    progress = read_progress(str(tmp_path / "ckpt"))
    assert progress.status == "done" and progress.samples_done == 32
    assert progress.eval_loss == pytest.approx(evals[-1]["eval_loss"]) and 0 < progress.eval_loss < 20
    assert (tmp_path / "ckpt" / "final" / "adapter_model.safetensors").is_file()

    # started again, a finished job trains no step past the end (Trainer.train would) and stays done
    code, again = run_inline(config, tmp_path / "ckpt")
    assert code == EXIT_DONE and [e["event"] for e in again] == ["resumed", "done"]
    assert read_progress(str(tmp_path / "ckpt")) == progress

    config.write_text(json.dumps({**TINY_HF_JOB, "dataset": str(tmp_path / "missing.jsonl")}))
    assert run_inline(config, tmp_path / "other")[0] == EXIT_USAGE
    assert "missing.jsonl' does not exist" in capsys.readouterr().err


def test_a_step_batch_larger_than_the_training_set_exits_2_naming_batch_size_before_training(tmp_path, capsys):
    data = write_jsonl(tmp_path / "five.jsonl", [{"prompt": f"q{i}", "response": f"a{i}"} for i in range(5)])
    config = tmp_path / "config.json"  # 3 records left after the hold-out, 4 samples a step
    config.write_text(json.dumps({**TINY_HF_JOB, "dataset": str(data), "eval_fraction": 0.4, "batch_size": 2,
                                  "gradient_accumulation_steps": 2}))
    code, events = run_inline(config, tmp_path / "ckpt")
    assert code == EXIT_USAGE and not [e for e in events if e["event"] in ("log", "checkpoint")]
    assert (f"dataset {str(data)!r} has 3 training records left after eval_fraction, fewer than one step's batch of 4 "
            "(batch_size=2 x gradient_accumulation_steps=2): make batch_size x gradient_accumulation_steps at most 3"
            ) in capsys.readouterr().err
    assert not (tmp_path / "ckpt" / "checkpoints").exists()


def test_a_run_that_ended_between_its_last_checkpoint_and_the_export_exports_it_and_trains_no_more(tmp_path):
    config, uri = tmp_path / "config.json", tmp_path / "ckpt"
    config.write_text(json.dumps(TINY_HF_JOB))
    code, events = run_inline(config, uri)
    assert code == EXIT_DONE
    last = [e for e in events if e["event"] == "checkpoint"][-1]
    assert last["kind"] == "final" and last["step"] == 4
    saved = load_file(uri / "checkpoints" / "checkpoint-4" / "adapter_model.safetensors")
    # As if the instance vanished after the last save: no export, progress still "running".
    shutil.rmtree(uri / "final")
    (uri / "progress.json").write_text(json.dumps({**json.loads((uri / "progress.json").read_text()), "status": "running"}))

    code, again = run_inline(config, uri)
    assert code == EXIT_DONE and [e["event"] for e in again] == ["resumed", "done"]  # no step 5 (Trainer.train would)
    assert again[-1]["step"] == 4 and again[-1]["loss"] == pytest.approx(events[-1]["loss"])
    exported = load_file(uri / "final" / "adapter_model.safetensors")
    assert exported.keys() == saved.keys() and all(torch.equal(exported[k], saved[k]) for k in saved)
    progress = read_progress(str(uri))
    assert progress.status == "done" and progress.step == 4 and progress.samples_done == 32


def refused_then_resumed(tmp_path: Path, capsys: pytest.CaptureFixture[str], refused: dict[str, Any], message: str,
                         resumed: dict[str, Any]) -> tuple[Path, list[dict[str, Any]]]:
    """Train 2 steps of 8 samples (checkpoint-2); a resume for 32 samples under ``refused`` exits 2 with ``message``
    (``{uri}`` in it: the checkpoint's location) before training, leaving the checkpoint as it was; one under
    ``resumed`` goes on from it. The job's URI and the last run's events."""
    config, uri = tmp_path / "config.json", tmp_path / "ckpt"
    config.write_text(json.dumps({**TINY_HF_JOB, "samples": 16}))
    assert run_inline(config, uri)[0] == EXIT_DONE
    checkpoint = uri / "checkpoints" / "checkpoint-2"
    stored = {path: path.read_bytes() for path in checkpoint.rglob("*") if path.is_file()}

    config.write_text(json.dumps({**TINY_HF_JOB, "samples": 32, **refused}))
    code, events = run_inline(config, uri)
    assert code == EXIT_USAGE and not [e for e in events if e["event"] in ("log", "checkpoint")]
    assert message.format(uri=uri) in capsys.readouterr().err
    assert {path: path.read_bytes() for path in checkpoint.rglob("*") if path.is_file()} == stored

    config.write_text(json.dumps({**TINY_HF_JOB, "samples": 32, **resumed}))
    code, events = run_inline(config, uri)
    assert code == EXIT_DONE and events[0]["checkpoint"] == "checkpoint-2" and events[-1]["step"] == 4
    return uri, events


def test_a_resume_under_another_seq_len_exits_2_and_keeps_the_checkpoint_for_the_original_one(tmp_path, capsys):
    # more samples: the job goes on from checkpoint-2, but with records cut at another length
    refused_then_resumed(
        tmp_path, capsys, {"seq_len": 48},
        "checkpoint checkpoint-2 under {uri} was made with seq_len=32, and this config has seq_len=48: its position "
        "(samples consumed) would continue over other samples. Restore seq_len=32 to resume it, or give the job a new "
        "checkpoint URI",
        {},
    )


def test_a_resume_under_other_lora_layers_exits_2_and_another_alpha_resumes(tmp_path, capsys):
    refused_then_resumed(  # under lora.r 4 the Trainer's load itself fails (exit 1)
        tmp_path, capsys, {"lora": {"r": 4}},
        "checkpoint checkpoint-2 under {uri} was made with lora.r=8, and this config has lora.r=4: its adapter's "
        "LoRA layers do not fit this config's. Restore lora.r=8 to resume it",
        {"lora": {"alpha": 8.0}},
    )


def test_a_resume_under_another_step_batch_exits_2_and_one_of_the_same_product_resumes(tmp_path, capsys):
    # the Trainer would resume at step 2 and count (and skip) 2 x 4 samples where 16 were consumed; the same 8
    # samples a step in micro-batches of 4 are the same sample stream, position and progress
    uri, events = refused_then_resumed(
        tmp_path, capsys, {"batch_size": 4},
        "checkpoint checkpoint-2 under {uri} was made with 8 samples per optimizer step (batch_size x "
        "gradient_accumulation_steps), and this run's step takes 4 (batch_size=4 x gradient_accumulation_steps=1): "
        "resumed at step 2, it would count 8 samples done where 16 were, and go on over other samples. Make "
        "batch_size x gradient_accumulation_steps 8 again to resume it, or give the job a new checkpoint URI",
        {"batch_size": 4, "gradient_accumulation_steps": 2},
    )
    assert [e["samples_done"] for e in events if e["event"] == "checkpoint"][-1] == 32
    assert read_progress(str(uri)).samples_done == 32


def test_a_notice_on_the_default_runtime_checkpoints_exits_75_and_the_restart_finishes(tmp_path):
    config, uri, notice = tmp_path / "config.json", tmp_path / "ckpt", tmp_path / "notice"
    config.write_text(json.dumps({**TINY_HF_JOB, "samples": 96, "samples_per_second_per_worker": 40.0}))
    when_progress(uri, lambda p: p["step"] >= 2, notice.touch)
    code, first = run_inline(config, uri, SPOTSCHED_NOTICE=f"file://{notice}")
    assert code == EXIT_PREEMPTED
    (stop,) = [e for e in first if e["event"] == "stop"]
    emergency = first[-1]
    assert emergency["event"] == "checkpoint" and emergency["kind"] == "emergency"
    assert emergency["step"] == stop["step"] and emergency["samples_done"] == 8 * stop["step"]
    assert read_progress(str(uri)).status == "preempted"

    notice.unlink()
    code, second = run_inline(config, uri, SPOTSCHED_NOTICE=f"file://{notice}")
    assert code == EXIT_DONE
    assert second[0] == {"event": "resumed", "checkpoint": f"checkpoint-{stop['step']}", "step": stop["step"],
                         "skipped": []}
    assert second[-1]["event"] == "done" and read_progress(str(uri)).samples_done == 96


def test_qlora_quantizes_the_base_to_nf4_computing_in_the_configured_dtype():
    import torch

    four = quantization_config(TrainConfig.from_dict({"samples": 8, "quantization": "4bit", "dtype": "bf16"}))
    assert four.load_in_4bit and four.bnb_4bit_quant_type == "nf4" and four.bnb_4bit_use_double_quant
    assert four.bnb_4bit_compute_dtype == torch.bfloat16
    assert quantization_config(TrainConfig.from_dict({"samples": 8, "quantization": "8bit"})).load_in_8bit
    assert quantization_config(TrainConfig.from_dict({"samples": 8})) is None
