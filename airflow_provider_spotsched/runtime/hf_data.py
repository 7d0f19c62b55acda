"""Fine-tuning data for the hf runtime: ``datasets`` inputs, tokenised with the loss on the answers only.

A dataset is one of: ``builtin:sft`` (the shipped prompt/response JSONL); a ``.jsonl``/``.json``
file, local or an fsspec URL (``s3://``, ``gs://``, ``memory://``, ...; ``storage_options`` are
passed to fsspec); a directory written by ``Dataset.save_to_disk`` (local or an URL); or any other
local directory ``datasets.load_dataset(path)`` reads (a hub-style repository: data files, an
optional ``README.md`` card). The ``train`` split is used when there are several.

Records come in three shapes, told apart by their columns:

- ``messages`` (a list of ``{"role", "content"}``): rendered with the tokenizer's chat template;
  labels only on the assistant turns' content (and the end-of-turn the template writes after it),
  -100 on the system and user turns and on the template's own role markers;
- ``prompt`` and ``response`` (or ``completion``): the prompt and a newline masked, the response
  and EOS labelled;
- ``text``: every token labelled (plain language modelling).

Each record becomes ``input_ids`` plus a ``completion_mask`` (1 where the loss counts), the
format TRL's ``SFTTrainer`` takes pre-tokenised: it turns the mask into labels, -100 (ignored by
the loss) where the mask is 0. Sequences are cut at ``seq_len`` tokens.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import fsspec
from datasets import Dataset, DatasetDict, load_dataset, load_from_disk
from fsspec.implementations.local import LocalFileSystem

from airflow_provider_spotsched.runtime.config import BUILTIN_SFT, ConfigError
from airflow_provider_spotsched.runtime.data import TEXT_DIR

BUILTIN_SFT_PATH = TEXT_DIR / "sft.jsonl"
# The chat template given to a tokenizer that has none (the builtin tiny one): a role marker line
# per turn, the content, and EOS after an assistant turn so that the model learns to stop.
SIMPLE_CHAT_TEMPLATE = (
    "{% for message in messages %}<|{{ message['role'] }}|>\n{{ message['content'] }}"
    "{% if message['role'] == 'assistant' %}{{ eos_token }}{% endif %}{{ '\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)
SAVED_DATASET_FILES = ("dataset_info.json", "state.json", "dataset_dict.json")  # what save_to_disk writes


def load_records(source: str, storage_options: Mapping[str, Any] | None = None) -> Dataset:
    """The records of ``source`` (see the module docstring); errors name the dataset and what is expected."""
    options = dict(storage_options or {})
    if source == BUILTIN_SFT:
        source = str(BUILTIN_SFT_PATH)
    elif source.startswith("builtin:"):
        raise ConfigError(f"dataset {source!r} is not a builtin dataset of runtime 'hf'; builtin: [{BUILTIN_SFT!r}]")
    try:
        fs, path = fsspec.core.url_to_fs(source, **options)
    except (ImportError, ValueError) as error:
        raise ConfigError(f"dataset {source!r}: its storage is not usable here ({error}); install the fsspec "
                          "filesystem for it (s3fs for s3://, gcsfs for gs://) or check storage_options") from None
    if not fs.exists(path):
        raise ConfigError(f"dataset {source!r} does not exist: give a .jsonl file, a dataset directory or {BUILTIN_SFT!r}")
    if fs.isdir(path):
        if any(fs.exists(f"{path.rstrip('/')}/{name}") for name in SAVED_DATASET_FILES):
            loaded = load_from_disk(source, storage_options=options or None)
        elif isinstance(fs, LocalFileSystem):
            loaded = load_dataset(str(Path(path)))
        else:
            raise ConfigError(f"dataset {source!r}: a remote directory must be one written by Dataset.save_to_disk "
                              "(or give its .jsonl file)")
    elif path.endswith((".jsonl", ".json", ".jsonl.gz", ".json.gz")):
        loaded = load_dataset("json", data_files=source, storage_options=options or None)
    else:
        raise ConfigError(f"dataset {source!r}: expected a .jsonl/.json file or a dataset directory")
    return _one_split(loaded, source)


def _one_split(loaded: Dataset | DatasetDict | Any, source: str) -> Dataset:
    if isinstance(loaded, Dataset):
        return loaded
    if isinstance(loaded, DatasetDict):
        if "train" in loaded:
            return loaded["train"]
        if len(loaded) == 1:
            return next(iter(loaded.values()))
        raise ConfigError(f"dataset {source!r} has splits {sorted(loaded)} and none is 'train': give one split's files")
    raise ConfigError(f"dataset {source!r} loaded as {type(loaded).__name__}, not a dataset of records")


def record_format(columns: Sequence[str], source: str) -> str:
    """``messages``, ``pair`` or ``text``: which shape the records have (see the module docstring)."""
    if "messages" in columns:
        return "messages"
    if "prompt" in columns and ("response" in columns or "completion" in columns):
        return "pair"
    if "text" in columns:
        return "text"
    raise ConfigError(f"dataset {source!r} has columns {sorted(columns)}: expected messages, prompt with response "
                      "(or completion), or text")


def ensure_chat_template(tokenizer: Any, template: str | None, builtin_model: bool) -> None:
    """Give the tokenizer ``template``, or the simple one when it is the builtin model's and has none."""
    if template is not None:
        tokenizer.chat_template = template
    elif getattr(tokenizer, "chat_template", None) is None:
        if not builtin_model:
            raise ConfigError("the dataset has a messages column but the model's tokenizer has no chat template: "
                              "set chat_template in the config (a Jinja template over messages)")
        tokenizer.chat_template = SIMPLE_CHAT_TEMPLATE


def _ids(tokenizer: Any, text: str) -> list[int]:
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def _render(tokenizer: Any, messages: Sequence[Mapping[str, str]], generation_prompt: bool = False) -> str:
    return str(tokenizer.apply_chat_template(list(messages), tokenize=False, add_generation_prompt=generation_prompt))


def tokenize_messages(tokenizer: Any, messages: Sequence[Mapping[str, str]]) -> tuple[list[int], list[int]]:
    """``input_ids`` and ``completion_mask`` of one conversation: 1 exactly on the assistant turns' content.

    The conversation is rendered one turn more at a time; each turn's new text is tokenised on its
    own, so the mask falls on token boundaries the model actually sees. An assistant turn's new
    text is split where the template's generation prompt (its role marker) ends.
    """
    if not messages or not all(isinstance(m, Mapping) and "role" in m and "content" in m for m in messages):
        raise ConfigError(f"a messages record must be a non-empty list of {{role, content}} objects, got {messages!r}")
    ids: list[int] = []
    mask: list[int] = []
    rendered = ""
    for turn in range(len(messages)):
        full = _render(tokenizer, messages[: turn + 1])
        if not full.startswith(rendered):
            raise ConfigError("the chat template does not render a conversation as a prefix of the longer one, so "
                              "turns cannot be masked: use a template without look-ahead (or chat_template)")
        if messages[turn]["role"] == "assistant":
            prompt = _render(tokenizer, messages[:turn], generation_prompt=True)
            split = len(prompt) if full.startswith(prompt) and len(prompt) >= len(rendered) else len(rendered)
            marker, content = _ids(tokenizer, full[len(rendered):split]), _ids(tokenizer, full[split:])
            ids += marker + content
            mask += [0] * len(marker) + [1] * len(content)
        else:
            new = _ids(tokenizer, full[len(rendered):])
            ids += new
            mask += [0] * len(new)
        rendered = full
    return ids, mask


def tokenize_record(record: Mapping[str, Any], kind: str, tokenizer: Any, seq_len: int) -> dict[str, list[int]]:
    """One record as ``input_ids`` and ``completion_mask``, cut at ``seq_len`` tokens."""
    if kind == "messages":
        ids, mask = tokenize_messages(tokenizer, record["messages"])
    elif kind == "pair":
        answer = record.get("response") if record.get("response") is not None else record.get("completion")
        prompt = _ids(tokenizer, f"{record['prompt']}\n")
        response = _ids(tokenizer, str(answer)) + [tokenizer.eos_token_id]
        ids, mask = prompt + response, [0] * len(prompt) + [1] * len(response)
    else:
        ids = _ids(tokenizer, str(record["text"])) + [tokenizer.eos_token_id]
        mask = [1] * len(ids)
    return {"input_ids": ids[:seq_len], "completion_mask": mask[:seq_len]}


def tokenize(dataset: Dataset, tokenizer: Any, seq_len: int, source: str) -> Dataset:
    """Every record tokenised (see :func:`tokenize_record`); records with nothing to learn are refused."""
    kind = record_format(dataset.column_names, source)
    tokenized = dataset.map(lambda record: tokenize_record(record, kind, tokenizer, seq_len),
                            remove_columns=dataset.column_names, keep_in_memory=True, load_from_cache_file=False)
    empty = sum(1 for mask in tokenized["completion_mask"] if not any(mask))
    if empty == len(tokenized):
        raise ConfigError(f"dataset {source!r}: no record has a token to learn within seq_len={seq_len} "
                          "(the prompts fill it): raise seq_len")
    return tokenized


def split_eval(dataset: Dataset, fraction: float, seed: int) -> tuple[Dataset, Dataset]:
    """(train, eval): a seeded ``fraction`` of the records held out, at least one each side."""
    if len(dataset) < 2:
        raise ConfigError(f"eval_fraction needs at least 2 records to split, the dataset has {len(dataset)}")
    held_out = min(len(dataset) - 1, max(1, round(fraction * len(dataset))))
    parts = dataset.train_test_split(test_size=held_out, seed=seed, shuffle=True)
    return parts["train"], parts["test"]
