"""The model and tokenizer a job fine-tunes, and the LoRA wrapping.

``builtin:tiny-gpt2`` is built by the project, never downloaded: a byte-level BPE tokenizer (at
most 2,000 tokens; the shipped corpus yields 935) trained with ``tokenizers`` on the shipped
corpus, and a 2-layer, 128-wide GPT-2 (transformers ``GPT2Config``) whose "pretrained" weights
are its seeded initialisation, saved once (LoRA then fine-tunes on the dataset). Both are a
deterministic function of the corpus and the constants below, cached under
``$SPOTSCHED_CACHE_DIR`` (default ``~/.cache/spotsched``) in a directory named by their hash, and
built atomically so that concurrent workers may race. Any other model string is a local path or
hub name for ``AutoModelForCausalLM``/``AutoTokenizer``.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from airflow_provider_spotsched.runtime.config import BUILTIN_DATASET, BUILTIN_MODEL, ConfigError, LoraSettings
from airflow_provider_spotsched.runtime.data import BUILTIN_DATASETS

if TYPE_CHECKING:
    from peft import PeftModel

TINY_GPT2 = {"vocab_size": 2000, "n_layer": 2, "n_embd": 128, "n_head": 4, "n_positions": 256, "seed": 1234}
EOS = "<|endoftext|>"
# Every linear layer of GPT-2 (peft's own GPT-2 default is c_attn only, too little for a tiny model).
TINY_GPT2_LORA_TARGETS = ("c_attn", "c_proj", "c_fc")
# What a usable cached build holds; a directory missing any of them is rebuilt.
TINY_GPT2_FILES = ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json")

logger = logging.getLogger(__name__)


def cache_root() -> Path:
    return Path(os.environ.get("SPOTSCHED_CACHE_DIR") or Path.home() / ".cache" / "spotsched")


def tiny_gpt2_dir(root: Path | None = None) -> Path:
    """Where the builtin model lives: named by a hash of the corpus and the build constants."""
    digest = hashlib.sha256(BUILTIN_DATASETS[BUILTIN_DATASET].read_bytes())
    digest.update(json.dumps(TINY_GPT2, sort_keys=True).encode())
    return (root or cache_root()) / f"tiny-gpt2-{digest.hexdigest()[:12]}"


def is_complete(directory: Path) -> bool:
    """Whether ``directory`` holds every file of a builtin-model build."""
    return all((directory / name).is_file() for name in TINY_GPT2_FILES)


def build_tiny_gpt2(directory: Path) -> None:
    """Train the tokenizer and save the seeded model into ``directory`` (atomically: temp + rename).

    A concurrent worker that installed a complete build first wins; an incomplete directory in
    the way (a cache damaged outside this code) is moved aside and replaced.
    """
    from safetensors.torch import save_model
    from tokenizers import ByteLevelBPETokenizer
    from transformers import GPT2Config, GPT2LMHeadModel, PreTrainedTokenizerFast

    directory.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{directory.name}.tmp-", dir=directory.parent))
    try:
        bpe = ByteLevelBPETokenizer()
        bpe.train(files=[str(BUILTIN_DATASETS[BUILTIN_DATASET])], vocab_size=TINY_GPT2["vocab_size"],
                  min_frequency=2, special_tokens=[EOS], show_progress=False)
        tokenizer = PreTrainedTokenizerFast(tokenizer_object=bpe._tokenizer, eos_token=EOS, bos_token=EOS,
                                            unk_token=EOS, pad_token=EOS, model_max_length=TINY_GPT2["n_positions"])
        config = GPT2Config(
            vocab_size=len(tokenizer), n_positions=TINY_GPT2["n_positions"], n_embd=TINY_GPT2["n_embd"],
            n_layer=TINY_GPT2["n_layer"], n_head=TINY_GPT2["n_head"],
            resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,  # deterministic fine-tuning, any world size
            bos_token_id=tokenizer.eos_token_id, eos_token_id=tokenizer.eos_token_id,
        )
        with torch.random.fork_rng():
            torch.manual_seed(TINY_GPT2["seed"])
            model = GPT2LMHeadModel(config)
        # Not model.save_pretrained: in a process of an initialised torch.distributed group other
        # than rank 0 it writes nothing, and every rank of a job may be the one to build the cache.
        model.config.save_pretrained(staging)
        save_model(model, str(staging / "model.safetensors"), metadata={"format": "pt"})
        tokenizer.save_pretrained(staging)
        missing = [name for name in TINY_GPT2_FILES if not (staging / name).is_file()]
        if missing:
            raise RuntimeError(f"building the builtin model left {missing} out of {staging}")
        _install(staging, directory)
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def _install(staging: Path, directory: Path) -> None:
    """Rename ``staging`` to ``directory``, unless a complete build is already there."""
    try:
        os.rename(staging, directory)
        return
    except OSError:
        if is_complete(directory):
            return  # lost a race with another worker
    aside = Path(tempfile.mkdtemp(prefix=f".{directory.name}.broken-", dir=directory.parent))
    logger.warning("the cached builtin model %s is incomplete; replacing it", directory)
    try:
        os.replace(directory, aside / directory.name)
    except FileNotFoundError:
        pass  # another worker moved it first
    try:
        os.rename(staging, directory)
    except OSError:
        if not is_complete(directory):
            raise  # not a lost race with another worker: a real failure
    finally:
        shutil.rmtree(aside, ignore_errors=True)


def resolve_model(name: str) -> str:
    """A path or hub name ``from_pretrained`` accepts; builds the builtin model on first use."""
    if name == BUILTIN_MODEL:
        directory = tiny_gpt2_dir()
        if not is_complete(directory):
            build_tiny_gpt2(directory)
        return str(directory)
    if name.startswith("builtin:"):
        raise ValueError(f"model {name!r} is not a builtin model; the builtin model is {BUILTIN_MODEL!r}")
    return name


def load_model_and_tokenizer(name: str, quantization_config: Any = None) -> tuple[torch.nn.Module, Any]:
    """The model and its tokenizer; with a ``BitsAndBytesConfig`` the base is quantized onto this process's GPU."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    source = resolve_model(name)
    placement = {} if quantization_config is None else {
        "quantization_config": quantization_config, "device_map": {"": int(os.environ.get("LOCAL_RANK", "0"))}}
    try:
        tokenizer = AutoTokenizer.from_pretrained(source)
        model = AutoModelForCausalLM.from_pretrained(source, **placement)
    except OSError as error:
        raise ValueError(
            f"model {name!r} could not be loaded (a local path or a hub name is expected): {error}") from None
    return model, tokenizer


def check_seq_len(model: torch.nn.Module, seq_len: int) -> None:
    """Refuse a ``seq_len`` beyond the model's context: its position embeddings would index out of
    range in the first long batch, after the start-up was paid for, and every retry the same."""
    config = getattr(model, "config", None)
    context = getattr(config, "n_positions", None) or getattr(config, "max_position_embeddings", None)
    if isinstance(context, int) and seq_len > context:
        raise ConfigError(f"seq_len={seq_len} exceeds the model's context of {context} positions; give seq_len <= {context}")


def wrap_lora(model: torch.nn.Module, settings: LoraSettings, model_name: str) -> PeftModel:
    """The model with LoRA adapters; only the adapters are trainable."""
    from peft import LoraConfig, get_peft_model

    targets = settings.target_modules
    if targets is None and model_name == BUILTIN_MODEL:
        targets = TINY_GPT2_LORA_TARGETS
    # peft annotates lora_alpha as int, yet only divides by it (scaling = alpha / r): a float alpha is valid
    config = LoraConfig(task_type="CAUSAL_LM", r=settings.r, lora_alpha=settings.alpha,  # type: ignore[arg-type]
                        lora_dropout=settings.dropout, target_modules=list(targets) if targets else None,
                        fan_in_fan_out=getattr(model.config, "model_type", "") == "gpt2")
    return get_peft_model(model, config)
