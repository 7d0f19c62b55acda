"""Training data as a stream of fixed-length token samples addressed by a global sample index.

The data position of a job is one integer, the number of samples consumed globally. Sample g is
chunk ``permutation(epoch)[g % N]`` of the tokenised text (N chunks of ``seq_len`` tokens, one
seeded permutation per epoch), so the position alone says what comes next: a job restarted at a
different world size continues at the same sample, each rank taking its share of the next global
batch. Samples have no padding, so a sample's loss is a plain mean over its tokens.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import torch

from airflow_provider_spotsched.runtime.config import BUILTIN_DATASET, ConfigError

TEXT_DIR = Path(__file__).resolve().parent.parent / "data" / "text"
BUILTIN_DATASETS = {BUILTIN_DATASET: TEXT_DIR / "synthetic_stories.txt"}


def dataset_path(dataset: str) -> Path:
    """The text file behind a dataset name: a builtin name or a path to a UTF-8 text file.

    A name that is neither is a ConfigError (exit 2): every retry of the job would fail the same way.
    """
    if dataset.startswith("builtin:"):
        if dataset not in BUILTIN_DATASETS:
            raise ConfigError(f"dataset {dataset!r} is not a builtin dataset of runtime 'loop'; builtin: "
                              f"{sorted(BUILTIN_DATASETS)}")
        return BUILTIN_DATASETS[dataset]
    path = Path(dataset).expanduser()
    if not path.is_file():
        raise ConfigError(f"dataset {dataset!r} is neither a builtin dataset nor an existing text file: give the path "
                          f"of a UTF-8 text file on the training machine, or one of {sorted(BUILTIN_DATASETS)}")
    return path


def load_text(dataset: str) -> str:
    path = dataset_path(dataset)
    try:
        return path.read_text(encoding="utf-8")
    except UnicodeDecodeError as error:
        raise ConfigError(f"dataset {dataset!r} is not UTF-8 text ({error}): give a UTF-8 text file") from None


def rank_share(start: int, count: int, rank: int, world_size: int) -> tuple[int, int]:
    """The contiguous part ``(first sample, how many)`` of a global batch that ``rank`` trains on.

    The first ``count % world_size`` ranks take one sample more; a rank may get none in a short
    final batch (it then contributes zero gradients).
    """
    base, extra = divmod(count, world_size)
    first = start + rank * base + min(rank, extra)
    return first, base + (1 if rank < extra else 0)


class SampleStream:
    """Fixed-length samples of a tokenised text, in a seeded order that is a function of the index."""

    def __init__(self, token_ids: list[int] | np.ndarray, seq_len: int, seed: int, dataset: str) -> None:
        """``dataset``: the config's name for the text, for the refusal of one too short to name."""
        tokens = np.asarray(token_ids, dtype=np.int64)
        num_chunks = len(tokens) // seq_len
        if num_chunks < 1:  # a ConfigError (exit 2): every retry would tokenise the same too-short text
            raise ConfigError(
                f"dataset {dataset!r} has {len(tokens)} tokens, fewer than one sample of seq_len={seq_len}: "
                f"give seq_len <= {len(tokens)} or a longer dataset"
            )
        self.chunks = tokens[: num_chunks * seq_len].reshape(num_chunks, seq_len)
        self.seed = seed
        self._orders: dict[int, np.ndarray] = {}

    @classmethod
    def from_text(cls, text: str, tokenizer: Any, seq_len: int, seed: int, dataset: str) -> SampleStream:
        ids = tokenizer(text, add_special_tokens=False, verbose=False)["input_ids"]
        return cls(ids, seq_len, seed, dataset)

    def __len__(self) -> int:
        """Samples per epoch."""
        return len(self.chunks)

    def _order(self, epoch: int) -> np.ndarray:
        if epoch not in self._orders:
            self._orders = {epoch: np.random.default_rng([self.seed, epoch]).permutation(len(self.chunks))}
        return self._orders[epoch]

    def batch(self, start: int, count: int) -> torch.Tensor:
        """Samples ``start .. start + count - 1`` (global indices) as a ``(count, seq_len)`` tensor."""
        per_epoch = len(self.chunks)
        rows = [self.chunks[self._order(g // per_epoch)[g % per_epoch]] for g in range(start, start + count)]
        if not rows:
            return torch.empty((0, self.chunks.shape[1]), dtype=torch.long)
        return torch.from_numpy(np.stack(rows))
