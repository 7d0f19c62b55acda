"""The training job's configuration (CONFIG.json): validated once, with errors naming the field.

Work is counted in training samples consumed globally (the scheduling model's work units), so a
job's progress does not depend on how many workers run it. ``steps`` is accepted instead of
``samples`` as a shorthand for ``steps * batch_size * gradient_accumulation_steps`` (steps of a
single worker).

A step consumes ``batch_size`` samples per worker (the global batch grows with the world size),
unless ``global_batch_size`` fixes it: then every step takes that many samples whatever the world
size, each worker its share in micro-batches of ``batch_size`` (gradient accumulation), so a
world-size change leaves the training trajectory unchanged up to float summation order.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

import fsspec

BUILTIN_MODEL = "builtin:tiny-gpt2"
BUILTIN_DATASET = "builtin:synthetic-stories"
BUILTIN_SFT = "builtin:sft"  # the shipped prompt/response JSONL, the hf runtime's default data
RUNTIMES = ("hf", "loop")
DTYPES = ("fp32", "bf16", "fp16")
QUANTIZATIONS = ("4bit", "8bit")  # QLoRA: the frozen base in bitsandbytes' NF4 (4bit) or int8, on a GPU
# settings only one runtime implements: (field, its default) -> refused under the other one when changed
HF_ONLY: dict[str, object] = {"dtype": "fp32", "gradient_checkpointing": False, "gradient_accumulation_steps": 1,
           "eval_dataset": None, "eval_fraction": None, "eval_every_steps": None, "chat_template": None,
           "storage_options": None, "quantization": None}
LOOP_ONLY: dict[str, object] = {"global_batch_size": None, "micro_batch_size": None, "max_step_seconds": None}
# What the sample stream is made of: which records or chunks a position (samples consumed) names, and their
# tokens. A checkpoint records them, and a resume under other values is refused (check_resumable).
DATA_SHAPE = ("model", "dataset", "seq_len", "seed", "eval_fraction", "chat_template")
# The LoRA layers the adapter has: a checkpoint's weights and optimizer state fit only a config that makes the
# same ones (lora.alpha and lora.dropout may change on resume). Recorded and judged like DATA_SHAPE.
ADAPTER_SHAPE = ("lora.r", "lora.target_modules")


class ConfigError(ValueError):
    """CONFIG.json is invalid; the message names the field and how to fix it."""


def check_resumable(saved: Mapping[str, Any], current: Mapping[str, Any], checkpoint: str) -> None:
    """Refuse to resume ``checkpoint`` under :data:`DATA_SHAPE` or :data:`ADAPTER_SHAPE` values other than those
    it ``saved``.

    Its position (samples consumed) would go on over other samples than it counted, silently: a job
    that is neither config's; or its adapter would not load into this config's LoRA layers (a crash
    that every retry repeats). A field the checkpoint lacks (made before it was recorded) is not judged.
    The checkpoint is left as it is, to be resumed with its own values.
    """
    for name, value in current.items():
        if name in saved and saved[name] != value:
            why = ("its adapter's LoRA layers do not fit this config's" if name in ADAPTER_SHAPE
                   else "its position (samples consumed) would continue over other samples")
            raise ConfigError(
                f"{checkpoint} was made with {name}={saved[name]!r}, and this config has {name}={value!r}: {why}. "
                f"Restore {name}={saved[name]!r} to resume it, or give the job a new checkpoint URI to start over "
                "(this checkpoint is kept)")


def _number(raw: Mapping[str, Any], name: str, default: float | None, *, minimum: float | None = None,
            strict_minimum: bool = False, integer: bool = False, prefix: str = "", required: bool = False) -> Any:
    value = raw.get(name, default)
    label = f"{prefix}{name}"
    kind = "an integer" if integer else "a number"
    if value is None:
        if required or default is not None:  # null is no value for a setting that has one by default
            raise ConfigError(f"{label} must be {kind}, got None")
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ConfigError(f"{label} must be {kind}, got {value!r}")
    try:
        as_float = float(value)
    except OverflowError:
        raise ConfigError(f"{label} is too large, got {value!r}") from None
    if integer and not as_float.is_integer():
        raise ConfigError(f"{label} must be {kind}, got {value!r}")
    if not math.isfinite(value):
        raise ConfigError(f"{label} must be finite, got {value!r}")
    if minimum is not None and (value <= minimum if strict_minimum else value < minimum):
        raise ConfigError(f"{label} must be {'>' if strict_minimum else '>='} {minimum}, got {value!r}")
    return int(value) if integer else float(value)


def _section(raw: Mapping[str, Any], name: str) -> Mapping[str, Any]:
    section = raw.get(name)
    if section is None:
        return {}
    if not isinstance(section, Mapping):
        raise ConfigError(f"{name} must be a JSON object, got {section!r}")
    return section


def _reject_unknown(raw: Mapping[str, Any], known: set[str], where: str) -> None:
    unknown = sorted(set(raw) - known)
    if unknown:
        raise ConfigError(f"unknown field(s) {unknown} in {where}; known fields: {sorted(known)}")


def _reject_other_runtime(raw: Mapping[str, Any], runtime: str) -> None:
    """A setting the chosen runtime does not implement is an error, not a silent no-op."""
    foreign = {"hf": LOOP_ONLY, "loop": HF_ONLY}[runtime]
    other = "loop" if runtime == "hf" else "hf"
    for name, default in foreign.items():
        if raw.get(name, default) != default:
            raise ConfigError(f"{name} is a setting of runtime {other!r}, and this config runs runtime {runtime!r}: "
                              f"remove {name}, or set runtime to {other!r}")


@dataclass(frozen=True)
class LoraSettings:
    """LoRA adapter shape; ``target_modules`` None lets peft pick the model type's default."""

    r: int = 8
    alpha: float = 16.0
    dropout: float = 0.0
    target_modules: tuple[str, ...] | None = None

    @classmethod
    def from_dict(cls, raw: Mapping[str, Any]) -> LoraSettings:
        _reject_unknown(raw, {f.name for f in fields(cls)}, "lora")
        targets = raw.get("target_modules")
        if targets is not None and (not isinstance(targets, list) or not targets
                                    or not all(isinstance(t, str) and t for t in targets)):
            raise ConfigError(f"lora.target_modules must be a non-empty list of module names, got {targets!r}")
        dropout = _number(raw, "dropout", 0.0, minimum=0.0, prefix="lora.")
        if dropout >= 1:
            raise ConfigError(f"lora.dropout must be < 1, got {dropout!r}")
        return cls(
            r=_number(raw, "r", 8, minimum=1, integer=True, prefix="lora."),
            alpha=_number(raw, "alpha", 16.0, minimum=0.0, strict_minimum=True, prefix="lora."),
            dropout=dropout,
            target_modules=tuple(targets) if targets else None,
        )


@dataclass(frozen=True)
class CheckpointSettings:
    """How often to checkpoint (Young/Daly inside [min, max]) and how many checkpoints to keep."""

    keep: int = 3
    min_interval_s: float = 10.0
    max_interval_s: float = 600.0
    cost_s: float | None = None  # measured from the runtime's own saves when None
    mtbp_hours: float | None = None  # no forecast: checkpoint every max_interval_s

    @classmethod
    def from_dict(cls, raw: Mapping[str, Any]) -> CheckpointSettings:
        _reject_unknown(raw, {f.name for f in fields(cls)}, "checkpoint")
        settings = cls(
            keep=_number(raw, "keep", 3, minimum=1, integer=True, prefix="checkpoint."),
            min_interval_s=_number(raw, "min_interval_s", 10.0, minimum=0.0, prefix="checkpoint."),
            max_interval_s=_number(raw, "max_interval_s", 600.0, minimum=0.0, strict_minimum=True,
                                   prefix="checkpoint."),
            cost_s=_number(raw, "cost_s", None, minimum=0.0, prefix="checkpoint."),
            mtbp_hours=_number(raw, "mtbp_hours", None, minimum=0.0, strict_minimum=True, prefix="checkpoint."),
        )
        if settings.min_interval_s > settings.max_interval_s:
            raise ConfigError(
                f"checkpoint.min_interval_s ({settings.min_interval_s}) must not exceed "
                f"checkpoint.max_interval_s ({settings.max_interval_s})"
            )
        return settings


@dataclass(frozen=True)
class GuardSettings:
    """Divergence guard: what counts as an exploding loss and how often it may roll back."""

    explode_factor: float = 4.0  # loss > factor x median of the recent window
    window: int = 20  # recent losses the median is taken over (needs window // 2 to judge)
    max_rollbacks: int = 3
    lr_backoff: float = 0.5  # the learning rate is multiplied by this at every rollback

    @classmethod
    def from_dict(cls, raw: Mapping[str, Any]) -> GuardSettings:
        _reject_unknown(raw, {f.name for f in fields(cls)}, "guard")
        backoff = _number(raw, "lr_backoff", 0.5, minimum=0.0, strict_minimum=True, prefix="guard.")
        if backoff > 1:
            raise ConfigError(f"guard.lr_backoff must be in (0, 1], got {backoff!r}")
        return cls(
            explode_factor=_number(raw, "explode_factor", 4.0, minimum=1.0, strict_minimum=True, prefix="guard."),
            window=_number(raw, "window", 20, minimum=2, integer=True, prefix="guard."),
            max_rollbacks=_number(raw, "max_rollbacks", 3, minimum=0, integer=True, prefix="guard."),
            lr_backoff=backoff,
        )


@dataclass(frozen=True)
class FaultInjection:
    """Fault-injection options for tests and drills (never set in production).

    ``nan_loss_at_steps``: the loss of these optimizer steps is replaced by NaN, once per
    process, to exercise the divergence guard. ``step_sleep_s``: sleep this long in every step,
    to stretch a short job in wall time (preemption drills on a fast machine).
    """

    nan_loss_at_steps: tuple[int, ...] = ()
    step_sleep_s: float = 0.0

    @classmethod
    def from_dict(cls, raw: Mapping[str, Any]) -> FaultInjection:
        _reject_unknown(raw, {f.name for f in fields(cls)}, "fault_injection")
        steps = raw.get("nan_loss_at_steps", [])
        if not isinstance(steps, list) or not all(isinstance(s, int) and not isinstance(s, bool) and s >= 1
                                                  for s in steps):
            raise ConfigError(f"fault_injection.nan_loss_at_steps must be a list of step numbers >= 1, got {steps!r}")
        return cls(tuple(steps), _number(raw, "step_sleep_s", 0.0, minimum=0.0, prefix="fault_injection."))


@dataclass(frozen=True)
class TrainConfig:
    """Everything one training job needs besides its checkpoint URI (see docs/runtime.md)."""

    samples: int
    runtime: str = "hf"
    model: str = BUILTIN_MODEL
    dataset: str = BUILTIN_SFT  # BUILTIN_DATASET (plain text) under the loop
    batch_size: int = 8  # per worker: samples per step, or per micro-batch with global_batch_size
    global_batch_size: int | None = None  # fixed samples per step at any world size (elastic-invariant)
    micro_batch_size: int | None = None  # gradient-accumulation chunk; None = batch_size
    seq_len: int = 64
    lr: float = 2e-3
    warmup_fraction: float = 0.05
    weight_decay: float = 0.0
    max_grad_norm: float = 1.0
    seed: int = 0
    log_every_steps: int = 10
    max_step_seconds: float | None = None  # bound on the time between two preemption checks
    threads: int | None = None  # torch threads per worker; None = $SPOTSCHED_THREADS or 1 on CPU
    # Emulates an instance of fixed speed: at most this many samples per second per worker. The
    # demo uses it so that its replayed market clock and its planning model hold on any CPU.
    samples_per_second_per_worker: float | None = None
    # the hf runtime's data and precision (see docs/runtime.md, "The default runtime")
    dtype: str = "fp32"  # bf16 also on CPU (torch autocast); fp16 only on a GPU
    gradient_checkpointing: bool = False
    quantization: str | None = None  # QLoRA's quantized base model (QUANTIZATIONS), GPU and bitsandbytes only
    gradient_accumulation_steps: int = 1  # micro-batches of batch_size per optimizer step
    eval_dataset: str | None = None  # a separate eval set, in any format the dataset may have
    eval_fraction: float | None = None  # or this share of the dataset held out (seeded)
    eval_every_steps: int | None = None  # evaluate every N steps (and at the last); None = at the last only
    chat_template: str | None = None  # Jinja template for a "messages" column; None = the tokenizer's
    storage_options: Mapping[str, Any] | None = None  # fsspec options for s3:// or gs:// datasets
    lora: LoraSettings = field(default_factory=LoraSettings)
    checkpoint: CheckpointSettings = field(default_factory=CheckpointSettings)
    guard: GuardSettings = field(default_factory=GuardSettings)
    fault_injection: FaultInjection = field(default_factory=FaultInjection)

    @classmethod
    def from_dict(cls, raw: Mapping[str, Any]) -> TrainConfig:
        if not isinstance(raw, Mapping):
            raise ConfigError(f"the config must be a JSON object, got {type(raw).__name__}")
        _reject_unknown(raw, {f.name for f in fields(cls)} | {"steps"}, "the config")
        runtime = raw.get("runtime", "hf")
        if runtime not in RUNTIMES:
            raise ConfigError(f"runtime must be one of {list(RUNTIMES)}, got {runtime!r}")
        batch_size = _number(raw, "batch_size", 8, minimum=1, integer=True)
        accumulation = _number(raw, "gradient_accumulation_steps", 1, minimum=1, integer=True)
        if ("samples" in raw) == ("steps" in raw):
            raise ConfigError("give exactly one of samples (total training samples, the job's work) or steps "
                              "(optimizer steps of one worker: samples = steps * batch_size * gradient_accumulation_steps)")
        samples = (_number(raw, "samples", None, minimum=1, integer=True, required=True) if "samples" in raw
                   else _number(raw, "steps", None, minimum=1, integer=True, required=True) * batch_size * accumulation)
        for name in ("model", "dataset", "eval_dataset", "chat_template"):
            optional = name in ("eval_dataset", "chat_template") and raw.get(name) is None
            if name in raw and not optional and (not isinstance(raw[name], str) or not raw[name]):
                raise ConfigError(f"{name} must be a non-empty string, got {raw[name]!r}")
        dtype = raw.get("dtype", "fp32")
        if dtype not in DTYPES:
            raise ConfigError(f"dtype must be one of {list(DTYPES)}, got {dtype!r}")
        checkpointing = raw.get("gradient_checkpointing", False)
        if not isinstance(checkpointing, bool):
            raise ConfigError(f"gradient_checkpointing must be true or false, got {checkpointing!r}")
        quantization = raw.get("quantization")
        if quantization is not None and quantization not in QUANTIZATIONS:
            raise ConfigError(f"quantization must be one of {list(QUANTIZATIONS)} or null, got {quantization!r}")
        eval_fraction = _number(raw, "eval_fraction", None, minimum=0.0, strict_minimum=True)
        if eval_fraction is not None and eval_fraction >= 1:
            raise ConfigError(f"eval_fraction must be < 1 (the share of the dataset held out), got {eval_fraction!r}")
        if eval_fraction is not None and raw.get("eval_dataset") is not None:
            raise ConfigError("give eval_dataset (a separate eval set) or eval_fraction (a share of dataset held out), "
                              "not both")
        eval_every = _number(raw, "eval_every_steps", None, minimum=1, integer=True)
        if eval_every is not None and eval_fraction is None and raw.get("eval_dataset") is None:
            raise ConfigError("eval_every_steps needs an eval split: set eval_dataset or eval_fraction")
        storage_options = raw.get("storage_options")
        if storage_options is not None and not isinstance(storage_options, Mapping):
            raise ConfigError(f"storage_options must be a JSON object of fsspec options (e.g. "
                              f'{{"anon": true}}), got {storage_options!r}')
        global_batch = _number(raw, "global_batch_size", None, minimum=1, integer=True)
        micro = _number(raw, "micro_batch_size", None, minimum=1, integer=True)
        if micro is not None and micro > batch_size:
            raise ConfigError(f"micro_batch_size ({micro}) must not exceed batch_size ({batch_size})")
        warmup = _number(raw, "warmup_fraction", 0.05, minimum=0.0)
        if warmup >= 1:
            raise ConfigError(f"warmup_fraction must be < 1, got {warmup!r}")
        config = cls(
            samples=samples,
            runtime=runtime,
            model=raw.get("model", BUILTIN_MODEL),
            dataset=raw.get("dataset", BUILTIN_SFT if runtime == "hf" else BUILTIN_DATASET),
            batch_size=batch_size,
            global_batch_size=global_batch,
            micro_batch_size=micro,
            seq_len=_number(raw, "seq_len", 64, minimum=2, integer=True),
            lr=_number(raw, "lr", 2e-3, minimum=0.0, strict_minimum=True),
            warmup_fraction=warmup,
            weight_decay=_number(raw, "weight_decay", 0.0, minimum=0.0),
            max_grad_norm=_number(raw, "max_grad_norm", 1.0, minimum=0.0, strict_minimum=True),
            seed=_number(raw, "seed", 0, minimum=0, integer=True),
            log_every_steps=_number(raw, "log_every_steps", 10, minimum=1, integer=True),
            max_step_seconds=_number(raw, "max_step_seconds", None, minimum=0.0, strict_minimum=True),
            threads=_number(raw, "threads", None, minimum=1, integer=True),
            samples_per_second_per_worker=_number(
                raw, "samples_per_second_per_worker", None, minimum=0.0, strict_minimum=True
            ),
            dtype=dtype,
            gradient_checkpointing=checkpointing,
            quantization=quantization,
            gradient_accumulation_steps=accumulation,
            eval_dataset=raw.get("eval_dataset"),
            eval_fraction=eval_fraction,
            eval_every_steps=eval_every,
            chat_template=raw.get("chat_template"),
            storage_options=dict(storage_options) if storage_options is not None else None,
            lora=LoraSettings.from_dict(_section(raw, "lora")),
            checkpoint=CheckpointSettings.from_dict(_section(raw, "checkpoint")),
            guard=GuardSettings.from_dict(_section(raw, "guard")),
            fault_injection=FaultInjection.from_dict(_section(raw, "fault_injection")),
        )
        _reject_other_runtime(raw, runtime)  # after the values: a bad value is named as such first
        return config

    def resume_shape(self) -> dict[str, Any]:
        """This config's :data:`DATA_SHAPE` and :data:`ADAPTER_SHAPE` fields, as a checkpoint records them
        (JSON values: the hf runtime's manifest reads them back)."""
        targets = self.lora.target_modules
        return {**{name: getattr(self, name) for name in DATA_SHAPE},
                "lora.r": self.lora.r, "lora.target_modules": list(targets) if targets else None}

    @classmethod
    def from_file(cls, path: str | Path) -> TrainConfig:
        try:
            with fsspec.open(str(path), "r", encoding="utf-8") as handle:  # a local path, s3:// or gs://
                raw = json.loads(handle.read())
        except FileNotFoundError:
            raise ConfigError(f"config file {path} does not exist") from None
        except json.JSONDecodeError as error:
            raise ConfigError(f"config file {path} is not valid JSON: {error}") from None
        return cls.from_dict(raw)
