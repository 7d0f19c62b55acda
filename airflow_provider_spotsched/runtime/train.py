"""The training loop: LoRA fine-tuning over the global sample stream, checkpointing and stopping cleanly.

Each optimizer step consumes the next global batch (``global_batch_size`` samples, or
``batch_size`` x world size without it; fewer at the end); every rank trains on its share,
gradients are summed across ranks and normalised by the global batch, so the update is the exact
global-batch mean however the batch is split. Between steps the workers agree (one
all-reduce) on whether to stop (SIGTERM or a notice on any worker) and whether a checkpoint is due
(the leader's Young/Daly clock). A stop saves an emergency checkpoint at the last step boundary
(a step in progress is abandoned between its gradient-accumulation chunks) and exits 75.

A checkpoint store that refuses a write (down, full, throttled) never costs the checkpoints
already stored: a failed save leaves a partial checkpoint that loading skips. A refused periodic
save is reported and training goes on (the next save is due an interval later); a refused
emergency save still exits 75 (the newest stored checkpoint is where the restart resumes, and
``progress.json`` says so); a refused final save is tried again a few times, then exits 75 too.
A stop right after a checkpoint does not save the same step again. ``progress.json`` is written
best-effort: a refused write is reported and the next one replaces it.
"""

from __future__ import annotations

import json
import math
import random
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from airflow_provider_spotsched.runtime.checkpoint import CheckpointStore, checkpoint_name, utc_now
from airflow_provider_spotsched.runtime.config import ConfigError, TrainConfig, check_resumable
from airflow_provider_spotsched.runtime.contract import EXIT_DONE, EXIT_PREEMPTED, Progress, write_progress
from airflow_provider_spotsched.runtime.data import SampleStream, load_text, rank_share
from airflow_provider_spotsched.runtime.distributed import PeerLostError, Workers
from airflow_provider_spotsched.runtime.guard import bad_loss_reason, check_rollback_allowed
from airflow_provider_spotsched.runtime.interval import CheckpointInterval
from airflow_provider_spotsched.runtime.model import check_seq_len, load_model_and_tokenizer, wrap_lora
from airflow_provider_spotsched.runtime.preemption import StopFlag

LOSS_HISTORY = 200  # losses kept in a checkpoint (the guard's median window and the curve's tail)
STATE_FORMAT = 1
FINAL_SAVE_ATTEMPTS = 3  # the final checkpoint and adapter, with FINAL_SAVE_PAUSE_S, then 2x, between tries
FINAL_SAVE_PAUSE_S = 1.0


def lr_factor(samples_done: int, samples_total: int, warmup_fraction: float) -> float:
    """Linear warm-up then linear decay to 0, as a function of the global data position."""
    warmup = warmup_fraction * samples_total
    if samples_done < warmup:
        return min(1.0, (samples_done + 1) / warmup)
    return max(0.0, (samples_total - samples_done) / max(1.0, samples_total - warmup))


def rng_state() -> dict[str, Any]:
    state = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


class Emitter:
    """One JSON line per event on stdout (leader only), flushed so that launchers see it at once."""

    def __init__(self, enabled: bool) -> None:
        self.enabled = enabled

    def __call__(self, event: str, **fields: Any) -> None:
        if self.enabled:
            print(json.dumps({"event": event, **fields}, default=float), flush=True)


def warn(message: str) -> None:
    print(f"spotsched-train: {message}", file=sys.stderr, flush=True)


@dataclass
class StepResult:
    """What one step did: ``loss`` applied, or ``stopped`` (abandoned on a stop), or ``bad`` (guard)."""

    loss: float = float("nan")
    samples: int = 0
    stopped: bool = False
    bad: str | None = None


class Trainer:
    """One worker of one job: builds the model, resumes, trains to the end or to a stop."""

    def __init__(self, config: TrainConfig, checkpoint_uri: str, workers: Workers, stop: StopFlag,
                 notice_window_s: float | None = None, emit: Callable[..., None] | None = None) -> None:
        self.config, self.workers, self.stop = config, workers, stop
        self.notice_window_s = notice_window_s
        self.emit = emit or Emitter(workers.leader)
        self.store = CheckpointStore(checkpoint_uri, keep=config.checkpoint.keep, log=warn)
        self.interval = CheckpointInterval(config.checkpoint)
        self.step = 0
        self.samples_done = 0
        self.losses: list[float] = []
        self.lr_scale = 1.0
        self.rollbacks = 0
        self.latest_checkpoint: str | None = None  # the newest stored checkpoint, known on every rank
        self.checkpointed_samples = 0  # its samples_done: the work a restart resumes from
        self.checkpointed_at = ""  # when checkpointed_samples was stored or restored (contract.Progress)
        self.resumed, self.resumed_samples = "", 0  # when this process began training, from how much work
        self.seconds_per_sample: float | None = None
        self.nan_injections_left = set(config.fault_injection.nan_loss_at_steps)
        self.throughput = 0.0

    # -- set-up --------------------------------------------------------------------------------

    def build(self) -> None:
        config = self.config
        torch.manual_seed(config.seed)  # LoRA's initialisation: identical on every rank
        random.seed(config.seed)
        np.random.seed(config.seed)
        text = load_text(config.dataset)  # a missing dataset is refused before the model loads
        base, self.tokenizer = load_model_and_tokenizer(config.model)
        check_seq_len(base, config.seq_len)
        self.model = wrap_lora(base, config.lora, config.model).to(self.workers.device)
        self.model.train()
        self.trainable = [(name, p) for name, p in self.model.named_parameters() if p.requires_grad]
        self.stream = SampleStream.from_text(text, self.tokenizer, config.seq_len, config.seed, config.dataset)
        self.optimizer = torch.optim.AdamW([p for _, p in self.trainable], lr=config.lr,
                                           weight_decay=config.weight_decay)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer,
            lambda _: self.lr_scale * lr_factor(self.samples_done, config.samples, config.warmup_fraction))

    def state(self) -> dict[str, Any]:
        return {
            "format": STATE_FORMAT, "step": self.step, "samples_done": self.samples_done,
            "samples_total": self.config.samples, "world_size": self.workers.world_size,
            **self.config.resume_shape(),
            "trainable": {name: p.detach().cpu().clone() for name, p in self.trainable},
            "optimizer": self.optimizer.state_dict(), "scheduler": self.scheduler.state_dict(),
            "rng": rng_state(), "losses": self.losses[-LOSS_HISTORY:], "lr_scale": self.lr_scale,
            "rollbacks": self.rollbacks,
        }

    def apply_state(self, state: dict[str, Any]) -> None:
        check_resumable(state, self.config.resume_shape(), f"the checkpoint of step {state['step']} under {self.store.uri}")
        if state["samples_total"] != self.config.samples:
            raise ConfigError(
                f"the checkpoint under {self.store.uri} belongs to a job with samples={state['samples_total']!r}, "
                f"this config has {self.config.samples!r}: use a fresh checkpoint URI or the original config"
            )
        saved = state["trainable"]
        if sorted(saved) != sorted(name for name, _ in self.trainable) or any(
                saved[name].shape != parameter.shape for name, parameter in self.trainable):  # made before the record
            raise ConfigError(
                f"the checkpoint of step {state['step']} under {self.store.uri} has other LoRA layers than this "
                "config makes: restore the lora.r and lora.target_modules it was made with to resume it, or give "
                "the job a new checkpoint URI to start over (this checkpoint is kept)")
        with torch.no_grad():
            for name, parameter in self.trainable:
                parameter.copy_(saved[name].to(parameter.device))
        self.optimizer.load_state_dict(state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])
        set_rng_state(state["rng"])
        self.step, self.samples_done = state["step"], state["samples_done"]
        self.losses = list(state["losses"])
        self.lr_scale = state["lr_scale"]
        self.rollbacks = max(self.rollbacks, state["rollbacks"])
        self._apply_lr()

    def _apply_lr(self) -> None:
        factor = self.lr_scale * lr_factor(self.samples_done, self.config.samples, self.config.warmup_fraction)
        for group, base_lr in zip(self.optimizer.param_groups, self.scheduler.base_lrs):
            group["lr"] = base_lr * factor

    def restore_latest(self) -> tuple[str | None, tuple[str, ...]]:
        """Load the newest good checkpoint on every rank (the leader picks it); None when there is none."""
        choice: tuple[str | None, tuple[str, ...]] = (None, ())
        state = None
        if self.workers.leader:
            self.store.clean_leftovers()
            loaded = self.store.load_latest()
            if loaded is not None:
                choice, state = (loaded.name, loaded.skipped), loaded.state
        choice = self.workers.broadcast_object(choice)
        name = choice[0]
        if name is not None:
            if state is None:
                state = self.store.load(name)
            self.apply_state(state)
        # every rank starts from the leader's adapter, whatever happened before
        with torch.no_grad():
            for _, parameter in self.trainable:
                self.workers.broadcast_(parameter.data)
        self.latest_checkpoint = name
        self.checkpointed_samples, self.checkpointed_at = self.samples_done, utc_now()
        return choice

    # -- checkpoints and progress --------------------------------------------------------------

    def save_checkpoint(self, kind: str) -> float | None:
        """All ranks meet, the leader saves; the seconds it took (barriers included), or None if refused.

        Every rank learns whether the store took it (one all-reduce), so that all agree on the
        newest stored checkpoint; a refused save changes nothing stored (see the module docstring).
        """
        start, reached = time.monotonic(), utc_now()
        self.workers.barrier()
        error: Exception | None = None
        if self.workers.leader:
            try:
                self.store.save(self.step, self.state(), samples_done=self.samples_done,
                                world_size=self.workers.world_size, kind=kind)
            except Exception as exc:  # storage errors share no base class (OSError, botocore, gcsfs, ...)
                error = exc
        if self.workers.all_max([float(error is not None)])[0]:
            self.emit("checkpoint_failed", kind=kind, step=self.step, samples_done=self.samples_done,
                      error=f"{type(error).__name__}: {error}" if error else "refused on the leader",
                      checkpoint=self.latest_checkpoint)
            if error is not None:
                warn(f"{kind} checkpoint of step {self.step} not stored ({type(error).__name__}: {error}); "
                     f"the newest stored one is {self.latest_checkpoint}")
            return None
        self.latest_checkpoint, self.checkpointed_samples = checkpoint_name(self.step), self.samples_done
        self.checkpointed_at = reached
        seconds = time.monotonic() - start
        self.interval.record_cost(seconds)
        self.emit("checkpoint", name=self.latest_checkpoint, kind=kind, step=self.step,
                  samples_done=self.samples_done, save_s=round(seconds, 4),
                  interval_s=round(self.interval.seconds, 3), cost_s=round(self.interval.cost_s, 4))
        self.write_progress("running" if kind != "final" else "done")
        return seconds

    def write_progress(self, status: str, samples_done: int | None = None) -> None:
        """The leader's ``progress.json``; best-effort. Its ``samples_done`` is the checkpointed work
        (the contract's: what survives a preemption), unless given: the scheduler plans on it, and
        reads all of it done as the job's end."""
        if not self.workers.leader:
            return
        try:
            write_progress(self.store.uri, Progress(
                samples_done=self.checkpointed_samples if samples_done is None else samples_done,
                samples_total=self.config.samples, step=self.step,
                loss=self.losses[-1] if self.losses else None, samples_per_second=round(self.throughput, 3),
                world_size=self.workers.world_size, checkpoint=self.latest_checkpoint, status=status,
                updated=utc_now(), checkpointed=self.checkpointed_at, resumed=self.resumed,
                resumed_samples=self.resumed_samples,
            ))
        except Exception as error:
            warn(f"progress not written ({type(error).__name__}: {error}); the next write replaces it")

    def save_final(self) -> bool:
        """The finished adapter (peft format) and tokenizer under URI/final/; False if the store refused it."""
        error: Exception | None = None
        if self.workers.leader:
            try:
                with tempfile.TemporaryDirectory(prefix="spotsched-final-") as staging:
                    self.model.save_pretrained(staging)
                    self.tokenizer.save_pretrained(staging)
                    self.store.put_directory(staging, "final")
            except Exception as exc:
                error = exc
                warn(f"final adapter not stored ({type(exc).__name__}: {exc})")
        return not self.workers.all_max([float(error is not None)])[0]

    def save_the_end(self) -> bool:
        """The final checkpoint (unless this step has one) and the adapter, tried a few times."""
        for attempt in range(FINAL_SAVE_ATTEMPTS):
            if attempt:
                time.sleep(FINAL_SAVE_PAUSE_S * 2 ** (attempt - 1))
            if self.latest_checkpoint != checkpoint_name(self.step) and self.save_checkpoint("final") is None:
                continue
            if self.save_final():
                return True
        return False

    # -- one step ------------------------------------------------------------------------------

    def _chunks_wanted(self, local_count: int) -> int:
        micro = self.config.micro_batch_size or self.config.batch_size
        chunks = math.ceil(local_count / micro) if local_count else 1
        if self.config.max_step_seconds and self.seconds_per_sample:
            per_chunk = max(1, int(self.config.max_step_seconds / self.seconds_per_sample))
            chunks = max(chunks, math.ceil(local_count / per_chunk))
        return max(1, chunks)

    def train_step(self, global_count: int, chunks: int) -> StepResult:
        """Forward/backward the rank's share in ``chunks`` pieces, all-reduce, judge, update."""
        first, count = rank_share(self.samples_done, global_count, self.workers.rank, self.workers.world_size)
        batch = self.stream.batch(first, count).to(self.workers.device)
        started = time.monotonic()
        loss_sum = torch.zeros((), dtype=torch.float64, device=self.workers.device)
        pieces = torch.tensor_split(batch, chunks)
        for index, piece in enumerate(pieces):
            remaining = sum(len(p) for p in pieces[index:])
            if index > 0 and self.workers.all_max([float(self.abandon_step(remaining))])[0]:
                self.optimizer.zero_grad(set_to_none=True)
                return StepResult(stopped=True, samples=global_count)
            if self.config.fault_injection.step_sleep_s:
                time.sleep(self.config.fault_injection.step_sleep_s / chunks)
            if len(piece):
                output = self.model(input_ids=piece, labels=piece)
                piece_sum = output.loss * len(piece)  # equal-length samples: sum of per-sample means
                (piece_sum / global_count).backward()
                loss_sum += piece_sum.detach().double()
        if count:
            elapsed = (time.monotonic() - started) / count
            previous = self.seconds_per_sample
            self.seconds_per_sample = elapsed if previous is None else 0.8 * previous + 0.2 * elapsed
        self._all_reduce_gradients()
        loss = float(self.workers.all_sum_(loss_sum).item()) / global_count
        if self.step + 1 in self.nan_injections_left:  # fault injection (documented): once per process
            self.nan_injections_left.discard(self.step + 1)
            loss = float("nan")
        reason = bad_loss_reason(loss, self.losses, self.config.guard)
        if reason:
            self.optimizer.zero_grad(set_to_none=True)
            return StepResult(loss=loss, samples=global_count, bad=reason)
        torch.nn.utils.clip_grad_norm_([p for _, p in self.trainable], self.config.max_grad_norm)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.samples_done += global_count
        self.step += 1
        self.scheduler.step()
        self.losses.append(loss)
        return StepResult(loss=loss, samples=global_count)

    def abandon_step(self, remaining_samples: int) -> bool:
        """Whether a stop must abandon the step in progress rather than finish it first.

        SIGTERM: yes (the grace period before SIGKILL is unknown). A notice: only when finishing
        the step and saving would not fit in half the cloud's notice window (a file notice,
        whose SIGTERM follows, lets the step finish).
        """
        if not self.stop.is_set():
            return False
        if self.stop.reason == "sigterm":
            return True
        if self.notice_window_s is None:
            return False
        finishing = (self.seconds_per_sample or 0.0) * remaining_samples + self.interval.cost_s
        return finishing > self.notice_window_s / 2

    def _all_reduce_gradients(self) -> None:
        if not self.workers.distributed:
            return
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for _, p in self.trainable]
        flat = torch.cat([g.reshape(-1) for g in grads])
        self.workers.all_sum_(flat)
        offset = 0
        for (_, parameter), grad in zip(self.trainable, grads):
            parameter.grad = flat[offset: offset + grad.numel()].view_as(parameter).clone()
            offset += grad.numel()

    def rollback(self, reason: str) -> None:
        check_rollback_allowed(self.rollbacks, reason, self.config.guard)
        bad_step = self.step + 1
        self.rollbacks += 1
        rollbacks, lr_scale = self.rollbacks, self.lr_scale * self.config.guard.lr_backoff
        name, _ = self.restore_latest()
        if name is None:
            raise RuntimeError("divergence guard: no checkpoint to roll back to (the initial one is missing)")
        self.rollbacks, self.lr_scale = rollbacks, lr_scale
        self._apply_lr()
        self.emit("rollback", reason=reason, bad_step=bad_step, checkpoint=name, step=self.step,
                  samples_done=self.samples_done, lr_scale=self.lr_scale, rollbacks=self.rollbacks)

    # -- the loop ------------------------------------------------------------------------------

    def run(self) -> int:
        """Train to the end (0) or to a stop (75); raises on failure."""
        config, workers = self.config, self.workers
        started = time.monotonic()
        self.build()
        build_s = time.monotonic() - started
        load_start = time.monotonic()
        name, skipped = self.restore_latest()
        load_s = time.monotonic() - load_start
        common = dict(world_size=workers.world_size, rendezvous_s=round(workers.rendezvous_s, 4),
                      load_s=round(load_s, 4), build_s=round(build_s, 4), skipped=list(skipped))
        if name is None:
            self.emit("started", samples_total=config.samples, **common)
            self.save_checkpoint("initial")  # the guard's fallback, and the first cost measurement
        else:
            self.emit("resumed", checkpoint=name, step=self.step, samples_done=self.samples_done, **common)
        first_step = self.step + 1
        try:
            return self._train(first_step, started)
        except PeerLostError as error:
            return self.peer_lost(error)

    def _train(self, first_step: int, started: float) -> int:
        config, workers = self.config, self.workers
        self.resumed, self.resumed_samples = utc_now(), self.checkpointed_samples
        last_checkpoint = time.monotonic()
        window_start, window_samples = time.monotonic(), 0
        paced_from, paced_samples = time.monotonic(), self.samples_done
        while self.samples_done < config.samples:
            step_samples = config.global_batch_size or config.batch_size * workers.world_size
            global_count = min(step_samples, config.samples - self.samples_done)
            _, local = rank_share(self.samples_done, global_count, workers.rank, workers.world_size)
            due_here = workers.leader and self.interval.due(time.monotonic() - last_checkpoint)
            stop, due, chunks = workers.all_max([float(self.stop.is_set()), float(due_here), self._chunks_wanted(local)])
            if stop:
                return self.preempted(discarded=0)
            if due:
                if not self.stored_this_step():  # just resumed or rolled back: the step is stored already
                    self.save_checkpoint("periodic")
                last_checkpoint = time.monotonic()
            result = self.train_step(global_count, int(chunks))
            if result.stopped:
                return self.preempted(discarded=result.samples)
            if result.bad:
                self.rollback(result.bad)
                last_checkpoint = time.monotonic()
                window_start, window_samples = time.monotonic(), 0
                continue
            window_samples += result.samples
            if config.samples_per_second_per_worker:
                rate = config.samples_per_second_per_worker * workers.world_size
                ahead = (self.samples_done - paced_samples) / rate - (time.monotonic() - paced_from)
                if ahead > 0:
                    self.stop.wait(ahead)  # a stop ends the wait; the next step boundary acts on it
            if self.step == first_step:
                self._check_notice_window()
            if self.step % config.log_every_steps == 0 or self.samples_done >= config.samples:
                now = time.monotonic()
                self.throughput = window_samples / max(now - window_start, 1e-9)
                window_start, window_samples = now, 0
                self.emit("step", step=self.step, samples_done=self.samples_done, samples_total=config.samples,
                          loss=result.loss, lr=self.optimizer.param_groups[0]["lr"],
                          samples_per_second=round(self.throughput, 3), world_size=workers.world_size)
                self.write_progress("running")
        if not self.save_the_end():
            warn(f"the work is done but the store refused the final checkpoint {FINAL_SAVE_ATTEMPTS} times: "
                 f"stopping resumable, from {self.latest_checkpoint}")
            return self.stopped_unsaved(reason="final checkpoint refused by the store", discarded=0)
        final = self.store.path("final")
        self.write_progress("done")
        workers.barrier()
        self.emit("done", step=self.step, samples_done=self.samples_done, samples_total=config.samples,
                  loss=self.losses[-1] if self.losses else None, final=final,
                  elapsed_s=round(time.monotonic() - started, 3), rollbacks=self.rollbacks)
        return EXIT_DONE

    def stored_this_step(self) -> bool:
        """Whether the newest stored checkpoint is of the current step: nothing since it to save."""
        return self.latest_checkpoint == checkpoint_name(self.step)

    def preempted(self, discarded: int) -> int:
        if self.stored_this_step():
            seconds: float | None = 0.0
        else:
            seconds = self.save_checkpoint("emergency")
        if seconds is None:
            return self.stopped_unsaved(reason=self.stop.reason, discarded=discarded)
        self.write_progress("preempted")
        self.emit("preempted", reason=self.stop.reason, checkpoint=self.latest_checkpoint, step=self.step,
                  samples_done=self.samples_done, samples_total=self.config.samples, save_s=round(seconds, 4),
                  discarded_samples=discarded)
        return EXIT_PREEMPTED

    def stopped_unsaved(self, reason: str | None, discarded: int) -> int:
        """Exit 75 with the work since the newest stored checkpoint unsaved: progress says where a restart resumes."""
        self.write_progress("preempted", samples_done=self.checkpointed_samples)
        self.emit("preempted", reason=reason, checkpoint=self.latest_checkpoint, step=self.step,
                  samples_done=self.checkpointed_samples, samples_total=self.config.samples, save_s=None,
                  discarded_samples=discarded + self.samples_done - self.checkpointed_samples)
        return EXIT_PREEMPTED

    def peer_lost(self, error: PeerLostError) -> int:
        """Another worker vanished mid-collective: the leader saves its last completed step alone.

        Every rank's adapter and optimizer are those of the last completed step (an update is only
        applied after its all-reduces succeed), so the leader's state is a consistent checkpoint;
        it is written without barriers, since the group is broken. Exit 75: the job is resumable.
        """
        warn(f"a peer was lost ({error})" + ("; saving the last completed step" if self.workers.leader else ""))
        self.optimizer.zero_grad(set_to_none=True)
        if not self.workers.leader:
            return EXIT_PREEMPTED
        start, reached = time.monotonic(), utc_now()
        if not self.stored_this_step():  # a step stored already is never written again
            try:
                self.latest_checkpoint = self.store.save(self.step, self.state(), samples_done=self.samples_done,
                                                         world_size=self.workers.world_size, kind="emergency")
            except Exception as exc:
                warn(f"emergency checkpoint not stored ({type(exc).__name__}: {exc})")
                return self.stopped_unsaved(reason=f"peer lost: {error}", discarded=0)
            self.checkpointed_samples, self.checkpointed_at = self.samples_done, reached
        seconds = time.monotonic() - start
        self.write_progress("preempted")
        self.emit("preempted", reason=f"peer lost: {error}", checkpoint=self.latest_checkpoint, step=self.step,
                  samples_done=self.samples_done, samples_total=self.config.samples, save_s=round(seconds, 4),
                  discarded_samples=0)
        return EXIT_PREEMPTED

    def _check_notice_window(self) -> None:
        """Warn when a step plus a save would not fit in the cloud's notice window."""
        if self.notice_window_s is None:
            return
        step_s = (self.seconds_per_sample or 0.0) * self.config.batch_size
        if self.interval.cost_s + step_s > self.notice_window_s:
            warn(f"a step ({step_s:.1f} s) plus a checkpoint ({self.interval.cost_s:.1f} s) exceeds the "
                 f"{self.notice_window_s:.0f} s preemption notice: set max_step_seconds or a smaller batch_size")
