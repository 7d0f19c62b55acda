"""The workers' process group: torch.distributed from the env:// variables the launcher sets.

``WORLD_SIZE`` (default 1) workers, this one being ``RANK``, meet at ``MASTER_ADDR:MASTER_PORT``;
one worker needs no process group. Under torchrun, which sets the same variables, that address is
its agent's store (``TORCHELASTIC_USE_AGENT_STORE``), which the ``tcp://`` initialisation joins.
CUDA workers use NCCL on ``cuda:$LOCAL_RANK``, CPU workers gloo. Gradients are averaged by an
explicit all-reduce of the (small) LoRA gradients rather than by a DistributedDataParallel
wrapper: it makes every step's gradient the exact mean over the global batch however that batch
is split across ranks (uneven shares, a rank with none), which is what lets a job change its
world size without changing what it computes.
"""

from __future__ import annotations

import functools
import os
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, TypeVar

import torch
import torch.distributed as dist

DEFAULT_RENDEZVOUS_TIMEOUT_S = 600.0
Result = TypeVar("Result")


class PeerLostError(RuntimeError):
    """A collective failed: another worker died or became unreachable (e.g. a spot instance vanished)."""


def collective(method: Callable[..., Result]) -> Callable[..., Result]:
    """Turn a failing collective's RuntimeError (gloo/NCCL transport errors) into :class:`PeerLostError`."""

    @functools.wraps(method)
    def guarded(*args: Any, **kwargs: Any) -> Result:
        try:
            return method(*args, **kwargs)
        except RuntimeError as error:
            raise PeerLostError(str(error).splitlines()[0][:300]) from error

    return guarded


@dataclass(frozen=True)
class Workers:
    """This worker's place among the job's workers, and what joining them took."""

    rank: int
    world_size: int
    device: torch.device
    rendezvous_s: float

    @property
    def distributed(self) -> bool:
        return self.world_size > 1

    @property
    def leader(self) -> bool:
        return self.rank == 0

    @collective
    def all_max(self, values: list[float]) -> list[float]:
        """Element-wise maximum over all workers (agreeing on flags: stop, checkpoint, chunks)."""
        if not self.distributed:
            return values
        tensor = torch.tensor(values, dtype=torch.float64, device=self.device)
        dist.all_reduce(tensor, op=dist.ReduceOp.MAX)
        return tensor.tolist()

    @collective
    def all_sum_(self, tensor: torch.Tensor) -> torch.Tensor:
        """Sum ``tensor`` over all workers in place."""
        if self.distributed:
            dist.all_reduce(tensor, op=dist.ReduceOp.SUM)
        return tensor

    @collective
    def broadcast_object(self, value: Any) -> Any:
        """The leader's ``value`` on every worker."""
        if not self.distributed:
            return value
        holder = [value]
        dist.broadcast_object_list(holder, src=0, device=self.device if self.device.type == "cuda" else None)
        return holder[0]

    @collective
    def broadcast_(self, tensor: torch.Tensor) -> None:
        if self.distributed:
            dist.broadcast(tensor, src=0)

    @collective
    def barrier(self) -> None:
        if self.distributed:
            dist.barrier()

    def close(self) -> None:
        if self.distributed and dist.is_initialized():
            dist.destroy_process_group()


def _env_int(env: Mapping[str, str], name: str, default: int) -> int:
    raw = env.get(name)
    if raw is None or raw == "":
        return default
    try:
        return int(raw)
    except ValueError:
        raise ValueError(f"environment variable {name}={raw!r} must be an integer") from None


def join_workers(env: Mapping[str, str] | None = None) -> Workers:
    """Join the process group described by ``env`` (default: os.environ), timing the rendezvous."""
    env = os.environ if env is None else env
    world_size = _env_int(env, "WORLD_SIZE", 1)
    rank = _env_int(env, "RANK", 0)
    if world_size < 1 or not 0 <= rank < world_size:
        raise ValueError(f"need WORLD_SIZE >= 1 and 0 <= RANK < WORLD_SIZE, got RANK={rank}, WORLD_SIZE={world_size}")
    if torch.cuda.is_available():
        device = torch.device("cuda", _env_int(env, "LOCAL_RANK", 0))
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
    start = time.monotonic()
    if world_size > 1:
        missing = [name for name in ("MASTER_ADDR", "MASTER_PORT") if not env.get(name)]
        if missing:
            raise ValueError(f"WORLD_SIZE={world_size} needs {' and '.join(missing)} (the rendezvous address)")
        timeout = float(env.get("SPOTSCHED_RENDEZVOUS_TIMEOUT_S") or DEFAULT_RENDEZVOUS_TIMEOUT_S)
        dist.init_process_group(
            backend="nccl" if device.type == "cuda" else "gloo",
            init_method=f"tcp://{env['MASTER_ADDR']}:{env['MASTER_PORT']}",
            rank=rank, world_size=world_size, timeout=timedelta(seconds=timeout),
        )
        dist.barrier()
    return Workers(rank, world_size, device, time.monotonic() - start)
