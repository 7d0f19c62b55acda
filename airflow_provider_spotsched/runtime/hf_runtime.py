"""The default runtime: a CONFIG.json job as TRL ``SFTTrainer`` + peft LoRA under the spot contract.

``spotsched-train --config CONFIG`` with ``runtime: hf`` (the default) builds the model (LoRA on
the builtin tiny GPT-2 unless ``model`` says otherwise), tokenises the data with the loss on the
answers only (:mod:`.hf_data`), and trains with ``SFTTrainer`` through :class:`.hf_callback.SpotCallback`
(notices, emergency checkpoint, Young/Daly saves, checksummed ``checkpoint-N/``, ``progress.json``,
exit 0/75). Several processes (instances x GPUs) run it under torchrun
(:mod:`.node`, which the backends launch): a step takes ``batch_size x gradient_accumulation_steps``
samples whatever the world size, each process ``batch_size / world size`` of them per micro-batch,
so the trajectory and the sample order (:class:`.hf_sampler.GlobalOrderSampler`) survive a
world-size change; the world size must divide ``batch_size``.

``dtype`` is the compute precision of mixed-precision training (the Trainer's ``bf16``/``fp16``
autocast; the weights and the adapter stay fp32): bf16 runs on a GPU that supports it and on
CPU (torch's CPU autocast), fp16 only on a GPU.
"""

from __future__ import annotations

import importlib.util
import math
import os
import time
from collections.abc import Mapping
from typing import Any

import torch
from transformers import PrinterCallback, TrainerCallback, TrainerControl, TrainerState, TrainingArguments

from airflow_provider_spotsched.runtime.config import BUILTIN_MODEL, ConfigError, TrainConfig
from airflow_provider_spotsched.runtime.hf_callback import SpotCallback
from airflow_provider_spotsched.runtime.hf_data import ensure_chat_template, load_records, record_format, split_eval, tokenize
from airflow_provider_spotsched.runtime.model import check_seq_len, load_model_and_tokenizer, wrap_lora
from airflow_provider_spotsched.runtime.preemption import NoticeSource, StopFlag


def check_launch(config: TrainConfig, checkpoint_uri: str, env: Mapping[str, str]) -> None:
    """Refuse what this machine or launch cannot run, naming the field (before seconds of model loading)."""
    world = world_size(env)
    if world > 1 and TORCHRUN_MARKER not in env:
        raise ConfigError(f"WORLD_SIZE={world} without torchrun: runtime 'hf' runs several processes under torchrun; "
                          "launch it with python -m airflow_provider_spotsched.runtime.node (the backends do)")
    if config.batch_size % world:
        raise ConfigError(f"batch_size={config.batch_size} is not a multiple of the world size {world} (instances x "
                          "processes per instance): each process takes an equal share of the step's batch; choose a "
                          "batch_size every world size of the job divides")
    cuda = torch.cuda.is_available()
    if config.dtype == "fp16" and not cuda:
        raise ConfigError("dtype 'fp16' needs a GPU (there is no CUDA device here): use dtype 'bf16' or 'fp32' on CPU")
    if config.dtype == "bf16" and cuda and not torch.cuda.is_bf16_supported():
        raise ConfigError("dtype 'bf16' is not supported by this GPU: use dtype 'fp16' or 'fp32'")
    if config.quantization is not None:
        if not cuda:
            raise ConfigError(f"quantization {config.quantization!r} (QLoRA) needs a CUDA GPU (there is none here): "
                              "remove quantization to train the base in full precision")
        if importlib.util.find_spec("bitsandbytes") is None:
            raise ConfigError(f"quantization {config.quantization!r} (QLoRA) needs bitsandbytes on the training "
                              "machine: pip install bitsandbytes, or remove quantization")


TORCHRUN_MARKER = "TORCHELASTIC_RUN_ID"  # set by torchrun for every worker it starts


def world_size(env: Mapping[str, str]) -> int:
    """The job's processes, as torchrun (or nobody: 1) set them."""
    try:
        world = int(env.get("WORLD_SIZE") or 1)
    except ValueError:
        raise ConfigError(f"WORLD_SIZE={env.get('WORLD_SIZE')!r} is not a number of processes; the launcher sets it "
                          "(unset it for one process)") from None
    if world < 1:
        raise ConfigError(f"WORLD_SIZE={world} must be >= 1")
    return world


def quantization_config(config: TrainConfig) -> Any:
    """QLoRA's ``BitsAndBytesConfig`` (NF4 with double quantization, computing in ``dtype``), None without."""
    if config.quantization is None:
        return None
    from transformers import BitsAndBytesConfig

    if config.quantization == "8bit":
        return BitsAndBytesConfig(load_in_8bit=True)
    compute = torch.bfloat16 if config.dtype == "bf16" else torch.float16 if config.dtype == "fp16" else torch.float32
    return BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True,
                              bnb_4bit_compute_dtype=compute)


def samples_per_step(config: TrainConfig) -> int:
    """Samples one optimizer step consumes, across all processes."""
    return config.batch_size * config.gradient_accumulation_steps


def check_global_batch(train_records: int, config: TrainConfig) -> None:
    """Refuse a step's batch larger than the training set before training: every epoch is cut to whole
    global batches (:class:`.hf_sampler.GlobalOrderSampler`), so no step could be filled, and the
    sampler's own refusal (exit 1, naming the Trainer's fields) would come once the model is built."""
    per_step = samples_per_step(config)
    if train_records < per_step:
        held_out = " left after eval_fraction" if config.eval_fraction is not None else ""
        raise ConfigError(f"dataset {config.dataset!r} has {train_records} training records{held_out}, fewer than one "
                          f"step's batch of {per_step} (batch_size={config.batch_size} x gradient_accumulation_steps="
                          f"{config.gradient_accumulation_steps}): make batch_size x gradient_accumulation_steps "
                          f"at most {train_records}, or add records to the dataset")


def training_arguments(config: TrainConfig, output_dir: str, has_eval: bool, world: int = 1) -> Any:
    """The ``SFTConfig`` of a job: every setting explicit, TRL's defaults (e.g. checkpointing on) not relied on."""
    from trl import SFTConfig

    max_steps = math.ceil(config.samples / samples_per_step(config))
    per_device = config.batch_size // world
    eval_every = config.eval_every_steps if has_eval else None
    return SFTConfig(
        output_dir=output_dir, max_steps=max_steps, per_device_train_batch_size=per_device,
        per_device_eval_batch_size=per_device, gradient_accumulation_steps=config.gradient_accumulation_steps,
        learning_rate=config.lr, weight_decay=config.weight_decay, max_grad_norm=config.max_grad_norm,
        lr_scheduler_type="linear", warmup_steps=round(config.warmup_fraction * max_steps),
        seed=config.seed, data_seed=config.seed, logging_steps=config.log_every_steps,
        save_strategy="no",  # SpotCallback decides every save (Young/Daly, notices, the last step)
        eval_strategy="steps" if eval_every else "no", eval_steps=eval_every,
        bf16=config.dtype == "bf16", fp16=config.dtype == "fp16",
        # transformers 5 calls gradient checkpointing activation checkpointing; non-reentrant works with a frozen base
        activation_checkpointing=config.gradient_checkpointing,
        activation_checkpointing_kwargs={"use_reentrant": False} if config.gradient_checkpointing else None,
        ddp_find_unused_parameters=False,  # every LoRA parameter takes part in every step
        logging_nan_inf_filter=False,  # a NaN loss is logged as NaN, for the divergence guard to see
        use_cpu=not torch.cuda.is_available(), report_to="none", disable_tqdm=True, dataloader_num_workers=0,
        max_length=config.seq_len, packing=False, completion_only_loss=True,
    )


class Pacing(TrainerCallback):
    """Holds the job to ``samples_per_second_per_worker`` per process (an instance of fixed speed, for the
    demo) and sleeps ``fault_injection.step_sleep_s`` per step; both waits end at once on a stop."""

    def __init__(self, config: TrainConfig, stop: StopFlag, world: int = 1) -> None:
        rate = config.samples_per_second_per_worker
        self.rate = rate * world if rate else None
        self.step_sleep_s = config.fault_injection.step_sleep_s
        self.per_step = samples_per_step(config)
        self.stop = stop
        self._start = time.monotonic()
        self._first_step = 0

    def on_train_begin(self, args: TrainingArguments, state: TrainerState, control: TrainerControl,
                       **kwargs: Any) -> None:
        self._start, self._first_step = time.monotonic(), state.global_step

    def on_step_end(self, args: TrainingArguments, state: TrainerState, control: TrainerControl,
                    **kwargs: Any) -> None:
        if self.step_sleep_s:
            self.stop.wait(self.step_sleep_s)
        if self.rate:
            due = (state.global_step - self._first_step) * self.per_step / self.rate
            ahead = due - (time.monotonic() - self._start)
            if ahead > 0:
                self.stop.wait(ahead)


class PoisonWeights(TrainerCallback):
    """``fault_injection.nan_loss_at_steps``: NaN into the trainable weights before these steps, once per
    process, so that the step's loss is NaN and the divergence guard must roll back (a drill)."""

    def __init__(self, steps: tuple[int, ...]) -> None:
        self.left = set(steps)

    def on_step_begin(self, args: TrainingArguments, state: TrainerState, control: TrainerControl,
                      model: torch.nn.Module | None = None, **kwargs: Any) -> None:
        if state.global_step + 1 in self.left and model is not None:
            self.left.discard(state.global_step + 1)
            with torch.no_grad():
                for parameter in model.parameters():
                    if parameter.requires_grad:
                        parameter.fill_(float("nan"))


class EvaluateAtEnd(TrainerCallback):
    """An eval at the last step, so that the final ``progress.json`` carries the finished model's eval loss."""

    def on_step_end(self, args: TrainingArguments, state: TrainerState, control: TrainerControl,
                    **kwargs: Any) -> TrainerControl:
        if state.global_step >= state.max_steps:
            control.should_evaluate = True
        return control


def build_trainer(config: TrainConfig, output_dir: str, stop: StopFlag) -> Any:
    """The ``SFTTrainer`` of a job: model with LoRA, tokenised train (and eval) data, the runtime's callbacks."""
    from trl import SFTTrainer

    torch.manual_seed(config.seed)  # the LoRA initialisation
    base, tokenizer = load_model_and_tokenizer(config.model, quantization_config(config))
    check_seq_len(base, config.seq_len)
    if config.quantization is not None:  # QLoRA: norms in fp32, inputs that need grads for checkpointing
        from peft import prepare_model_for_kbit_training

        base = prepare_model_for_kbit_training(base, use_gradient_checkpointing=config.gradient_checkpointing)
    records = load_records(config.dataset, config.storage_options)
    evaluation = load_records(config.eval_dataset, config.storage_options) if config.eval_dataset else None
    if config.eval_fraction is not None:
        records, evaluation = split_eval(records, config.eval_fraction, config.seed)
    check_global_batch(len(records), config)  # a record is one sample: tokenising keeps every one
    kinds = {record_format(part.column_names, config.dataset) for part in (records, evaluation) if part is not None}
    if config.chat_template is not None or "messages" in kinds:
        ensure_chat_template(tokenizer, config.chat_template, config.model == BUILTIN_MODEL)
    train = tokenize(records, tokenizer, config.seq_len, config.dataset)
    held_out = tokenize(evaluation, tokenizer, config.seq_len, config.eval_dataset or config.dataset) \
        if evaluation is not None else None
    model = wrap_lora(base, config.lora, config.model)
    world = world_size(os.environ)
    callbacks: list[TrainerCallback] = [Pacing(config, stop, world)]
    if config.fault_injection.nan_loss_at_steps:
        callbacks.append(PoisonWeights(config.fault_injection.nan_loss_at_steps))
    if held_out is not None:
        callbacks.append(EvaluateAtEnd())
    trainer = SFTTrainer(model=model, args=training_arguments(config, output_dir, held_out is not None, world),
                         train_dataset=train, eval_dataset=held_out, processing_class=tokenizer, callbacks=callbacks)
    trainer.remove_callback(PrinterCallback)  # its Python-dict lines would break the JSON-lines stdout
    return trainer


def run(config: TrainConfig, checkpoint_uri: str, stop: StopFlag, notice: NoticeSource | None,
        notice_poll_s: float) -> int:
    """Train the job to the end (0) or to a stop (75); raises on failure."""
    step_batch = {"batch_size": config.batch_size, "gradient_accumulation_steps": config.gradient_accumulation_steps}
    spot = SpotCallback(checkpoint_uri, config.checkpoint, notice, notice_poll_s, stop=stop, guard=config.guard,
                        resume_shape=config.resume_shape(), step_batch=step_batch)
    return spot.train(build_trainer(config, str(spot.output_dir), stop))
