"""The runtime's spot contract as a transformers ``TrainerCallback``: any Trainer script becomes spot-safe.

A user's script replaces ``trainer.train()`` with ``sys.exit(spot_train(trainer))``. That one line
adds :class:`SpotCallback` and resumes from the newest complete, checksum-valid checkpoint under
the checkpoint URI; during training the callback

- installs the runtime's preemption watchers (:mod:`.preemption`: SIGTERM, the AWS/GCP notices,
  ``file://`` notices) and, at the first optimizer-step end after a notice, makes the Trainer save
  (an emergency checkpoint, inside the notice window when a step is shorter than it) and stop;
  the script then exits 75 (:data:`.contract.EXIT_PREEMPTED`);
- asks for periodic saves on the Young/Daly interval (:mod:`.interval`), and for one at the last step;
- after every save writes the checkpoint's checksum manifest and prunes to the K newest valid
  checkpoints (:mod:`.hf_checkpoints`), then ``progress.json`` (:mod:`.contract`);
- prints one JSON line per event (``resumed``, ``log``, ``eval``, ``stop``, ``checkpoint``, ``done``);
  the latest eval loss, when the Trainer has an eval set, goes into ``progress.json`` as ``eval_loss``.

At the end it exports the adapter to ``URI/final/`` and reports ``done`` (exit 0). A checkpoint
URI in an object store (``s3://``, ``gs://``) is staged on local disk and mirrored, complete
checkpoints only (:mod:`.hf_mirror`). With a ``guard`` (:mod:`.guard`; the default runtime always
gives one) every logged loss is judged, and the loss since the last log before every save: a bad
one stops ``Trainer.train`` unsaved, and :meth:`SpotCallback.train` resumes it from the newest
checkpoint (the resume rewinds the data position with it) with the learning rate times
``lr_backoff``; the rollbacks and the factor are kept in each checkpoint's manifest.

Under torchrun (world size > 1) every rank runs the callback: at each step end the ranks agree,
by one all-reduce (MAX) of their stop and save-due flags, so a notice seen by any rank stops all
of them at the same step and a time-based save is taken by all or none. After a save rank 0
gathers every rank's ``rng_state_R.pth`` into its copy of the checkpoint (other instances write
theirs on their own disks), writes the manifest and prunes, and a barrier keeps the others from
exiting (which makes torchrun stop the group) before the checkpoint is complete. :func:`spot_train` also gives the Trainer a
:class:`~.hf_sampler.GlobalOrderSampler`, so the data order survives a change of world size.
"""

from __future__ import annotations

import json
import os
import shutil
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

import torch
import torch.distributed as dist
from transformers import Trainer, TrainerCallback, TrainerControl, TrainerState, TrainingArguments
from transformers.trainer_utils import has_length

from airflow_provider_spotsched.runtime.checkpoint import utc_now, writer_generation
from airflow_provider_spotsched.runtime.config import CheckpointSettings, ConfigError, GuardSettings, check_resumable
from airflow_provider_spotsched.runtime.contract import EXIT_DONE, EXIT_PREEMPTED, Progress, read_progress, write_progress
from airflow_provider_spotsched.runtime.guard import DivergenceError, bad_loss_reason, check_rollback_allowed
from airflow_provider_spotsched.runtime.hf_checkpoints import (
    MANIFEST,
    checkpoint_step,
    checkpoints,
    latest_valid,
    prune,
    remove_newer_than,
    write_manifest,
)
from airflow_provider_spotsched.runtime.hf_mirror import CheckpointMirror, is_remote, staging_directory
from airflow_provider_spotsched.runtime.hf_sampler import GlobalOrderSampler
from airflow_provider_spotsched.runtime.interval import CheckpointInterval
from airflow_provider_spotsched.runtime.preemption import NoticeSource, NoticeWatcher, StopFlag, install_sigterm_handler
from airflow_provider_spotsched.runtime.train import Emitter, warn

CHECKPOINTS = "checkpoints"  # URI/checkpoints/checkpoint-N/: the Trainer's output_dir
FINAL = "final"  # URI/final/: the finished adapter, as for the builtin runtime
URI_ENV = "SPOTSCHED_CHECKPOINT_URI"
SETTINGS_ENV = "SPOTSCHED_CHECKPOINT"  # JSON object: the runtime config's "checkpoint" section
POLL_ENV = "SPOTSCHED_NOTICE_POLL_S"
DEFAULT_POLL_S = 1.0
LOSS_HISTORY = 200  # the guard's recent good losses kept (its median window is at most this)


def local_directory(checkpoint_uri: str) -> Path:
    """The directory of a local checkpoint URI (an object store's is staged instead: :mod:`.hf_mirror`)."""
    parsed = urlparse(checkpoint_uri)
    return Path(parsed.path if parsed.scheme == "file" else checkpoint_uri).expanduser()


class SpotCallback(TrainerCallback):
    """Notices -> emergency save and stop; Young/Daly periodic saves; manifests, pruning, ``progress.json``."""

    def __init__(self, checkpoint_uri: str, checkpoint: CheckpointSettings | None = None,
                 notice: NoticeSource | None = None, notice_poll_s: float = DEFAULT_POLL_S,
                 emit: Callable[..., None] | None = None, stop: StopFlag | None = None,
                 staging_dir: Path | None = None, guard: GuardSettings | None = None,
                 resume_shape: Mapping[str, Any] | None = None, step_batch: Mapping[str, int] | None = None) -> None:
        """``stop``: a flag the caller's own SIGTERM handler already sets (a stop during start-up counts);
        ``staging_dir``: the local disk for an object-store URI's checkpoints (default: ``$SPOTSCHED_STAGING_DIR``);
        ``guard``: roll back to the newest checkpoint on a diverging loss (:mod:`.guard`); None: no guard;
        ``resume_shape``: what makes the sample stream and the adapter's layers (the runtime's
        :meth:`.TrainConfig.resume_shape`), recorded in every manifest: a resume from a checkpoint made with
        other values is refused (a ConfigError);
        ``step_batch``: the settings whose product is a step's samples, with their values, as the caller's users
        set them (the runtime's batch_size and gradient_accumulation_steps), for the refusal of a resume under
        another step batch to name; by default the TrainingArguments' (:func:`global_batch`)."""
        if notice_poll_s <= 0:
            raise ValueError(f"notice_poll_s must be > 0, got {notice_poll_s!r}")
        self.mirror: CheckpointMirror | None = None
        if is_remote(checkpoint_uri):  # the Trainer writes locally; complete checkpoints go up (hf_mirror)
            self.root = staging_dir or staging_directory(checkpoint_uri, os.environ)
            self.checkpoint_uri = checkpoint_uri.rstrip("/")
            self.mirror = CheckpointMirror(self.checkpoint_uri, self.root, warn)
        else:
            self.root = local_directory(checkpoint_uri)
            self.checkpoint_uri = str(self.root)
        self.settings = checkpoint or CheckpointSettings()
        self.interval = CheckpointInterval(self.settings)
        self.notice, self.notice_poll_s = notice, notice_poll_s
        self.emit = emit or Emitter(os.environ.get("RANK", "0") == "0")  # one event stream per job: rank 0's
        self.stop = stop or StopFlag()
        self.preempted = False
        self.keep = self.settings.keep
        self.checkpointed_step = 0
        self.checkpointed_at = ""  # when checkpointed_step was saved or restored (contract.Progress)
        self.resumed, self.resumed_samples = "", 0  # when this process began training, from how much work
        self.checkpoint_name: str | None = None  # its directory under URI/checkpoints (a store's has an upload id)
        self.loss: float | None = None
        self.eval_loss: float | None = None  # the latest loss on the Trainer's eval_dataset, when it has one
        self._watcher: NoticeWatcher | None = None
        self._restore_sigterm: Callable[[], None] | None = None
        self._last_save = self._last_step_end = time.monotonic()
        self._save_requested: float | None = None
        self._train_seconds = 0.0
        self._steps_timed = 0
        self._global_batch = 0  # samples per optimizer step, known once training begins
        self.guard = guard
        self.losses: list[float] = []  # the guard's recent good losses
        self.diverged: str | None = None  # why the guard stopped this train() call
        self.rollbacks = 0
        self.lr_scale = 1.0  # the learning rate's factor after rollbacks (lr_backoff per rollback)
        self._lr_factor_due = 1.0  # still to apply to the optimizer and scheduler loaded on resume
        self.resume_shape = dict(resume_shape or {})
        self.step_batch = dict(step_batch) if step_batch else None
        self._batch_fields: dict[str, int] = {}  # the settings that make _global_batch, named in a refusal

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None, checkpoint_uri: str | None = None) -> SpotCallback:
        """Built from ``$SPOTSCHED_CHECKPOINT_URI`` (unless given), ``$SPOTSCHED_NOTICE``,
        ``$SPOTSCHED_CHECKPOINT`` (JSON: keep, min/max_interval_s, cost_s, mtbp_hours) and
        ``$SPOTSCHED_NOTICE_POLL_S``: what a launcher sets, so the script needs no arguments for it."""
        env = os.environ if env is None else env
        uri = checkpoint_uri or env.get(URI_ENV)
        if not uri:
            raise ValueError(f"no checkpoint URI: set ${URI_ENV} or pass checkpoint_uri (where checkpoints "
                             "and progress.json go)")
        try:
            raw = json.loads(env.get(SETTINGS_ENV) or "{}")
        except json.JSONDecodeError as error:
            raise ConfigError(f"${SETTINGS_ENV} is not JSON ({error}); give an object such as "
                              '{"max_interval_s": 600}') from None
        if not isinstance(raw, dict):
            raise ConfigError(f"${SETTINGS_ENV} must be a JSON object, got {raw!r}")
        try:
            poll = float(env.get(POLL_ENV) or DEFAULT_POLL_S)
        except ValueError:
            raise ValueError(f"${POLL_ENV} must be a number of seconds, got {env.get(POLL_ENV)!r}") from None
        staging = staging_directory(uri, env) if is_remote(uri) else None
        return cls(uri, CheckpointSettings.from_dict(raw), NoticeSource.from_env(env), poll, staging_dir=staging)

    @property
    def output_dir(self) -> Path:
        return self.root / CHECKPOINTS

    # -- resuming ------------------------------------------------------------------------------

    def resume_checkpoint(self, leader: bool = True, lr_scale: float | None = None) -> str | None:
        """The newest complete, checksum-valid checkpoint (for ``resume_from_checkpoint``), None if none.

        The leader chooses and removes the unusable newer ones, so the Trainer never saves into a
        stale directory; under torchrun the others take its choice (they must not verify files the
        leader is removing). ``lr_scale``: the learning rate's factor to train on from it (a rollback's);
        by default the one the checkpoint was saved with.
        """
        chosen: Path | None = None
        stored: str | None = None  # its directory in the store (checkpoint-N.<upload id>), for the other instances
        skipped: list[str] = []
        node_leader = os.environ.get("LOCAL_RANK", "0") == "0"  # the first process of each instance
        if self.mirror is not None and node_leader:
            shutil.rmtree(self.output_dir, ignore_errors=True)  # the store holds the truth; stale copies go
        if leader:
            if self.mirror is not None:
                chosen, stored, skipped = self.mirror.fetch_latest_valid(self.output_dir)
            else:
                chosen, skipped = latest_valid(self.output_dir, warn)
                remove_newer_than(self.output_dir, checkpoint_step(chosen) if chosen else None, warn)
        if distributed():
            holder = [str(chosen) if chosen else None, stored]
            dist.broadcast_object_list(holder, src=0)
            chosen, stored = (Path(holder[0]) if holder[0] else None), holder[1]
            if self.mirror is not None and stored is not None and not leader and other_instance_leader():
                self.mirror.download(self.output_dir, stored)
            barrier()  # every instance has its copy before any process loads it
        elif not leader:
            raise RuntimeError("a non-zero rank without a torch.distributed process group cannot resume: "
                               "launch the script with torchrun")
        step = checkpoint_step(chosen) if chosen else None
        self.checkpointed_step, self.checkpointed_at = step or 0, utc_now()
        self.checkpoint_name = stored or (chosen.name if chosen else None)
        saved = json.loads((chosen / MANIFEST).read_text()) if chosen else {}
        if chosen is not None:
            check_resumable(saved.get("resume_shape", {}), self.resume_shape,
                            f"checkpoint {self.checkpoint_name} under {self.checkpoint_uri}")
            self.check_step_batch(saved, f"checkpoint {self.checkpoint_name} under {self.checkpoint_uri}")
        self.rollbacks = max(self.rollbacks, int(saved.get("rollbacks", 0)))
        saved_scale = float(saved.get("lr_scale", 1.0))  # what the checkpoint's scheduler state already has
        self.lr_scale = saved_scale if lr_scale is None else lr_scale
        self._lr_factor_due = self.lr_scale / saved_scale
        self.emit("resumed", checkpoint=self.checkpoint_name, step=self.checkpointed_step,
                  skipped=skipped)
        return str(chosen) if chosen else None

    def check_step_batch(self, saved: Mapping[str, Any], checkpoint: str) -> None:
        """Refuse to resume ``checkpoint`` under another step batch than it was made with (its manifest's
        ``samples_done`` / ``step``): the Trainer resumes at optimizer step k and skips k of this run's batches,
        so k x the new batch would be counted done (and billed, and planned on) where k x the old one were
        consumed, and training would go on over other samples. Not judged before :meth:`train` knows the batch."""
        step, done = int(saved.get("step", 0)), int(saved.get("samples_done", 0))
        if not step or not self._global_batch or done == step * self._global_batch:
            return
        names = " x ".join(self._batch_fields)
        values = " x ".join(f"{name}={value}" for name, value in self._batch_fields.items())
        raise ConfigError(
            f"{checkpoint} was made with {done // step} samples per optimizer step ({names}), and this run's step "
            f"takes {self._global_batch} ({values}): resumed at step {step}, it would count {step * self._global_batch} "
            f"samples done where {done} were, and go on over other samples. Make {names} {done // step} again to "
            "resume it, or give the job a new checkpoint URI to start over (this checkpoint is kept)")

    # -- the Trainer's events ------------------------------------------------------------------

    def on_train_begin(self, args: TrainingArguments, state: TrainerState, control: TrainerControl,
                       **kwargs: Any) -> None:
        if Path(args.output_dir or "").resolve() != self.output_dir.resolve():
            raise ValueError(f"TrainingArguments.output_dir is {args.output_dir!r}, but SpotCallback checkpoints "
                             f"under {str(self.output_dir)!r}: set output_dir to it, or use spot_train(trainer)")
        if args.save_total_limit:  # the Trainer's rotation counts directories, valid or not: prune here instead
            self.keep, args.save_total_limit = args.save_total_limit, None
        self._restore_sigterm = install_sigterm_handler(self.stop)
        if self.notice is not None:
            self._watcher = NoticeWatcher(self.notice, self.stop, self.notice_poll_s, on_error=warn).start()
        self._global_batch = global_batch(args)
        self._last_save = self._last_step_end = time.monotonic()
        self.resumed, self.resumed_samples = utc_now(), self.checkpointed_step * self._global_batch

    def on_step_begin(self, args: TrainingArguments, state: TrainerState, control: TrainerControl,
                      optimizer: torch.optim.Optimizer | None = None, lr_scheduler: Any = None,
                      **kwargs: Any) -> None:
        if self._lr_factor_due != 1.0 and optimizer is not None:  # after a rollback: the loaded lr, backed off
            for group in optimizer.param_groups:
                group["lr"] *= self._lr_factor_due
            if hasattr(lr_scheduler, "base_lrs"):
                lr_scheduler.base_lrs = [lr * self._lr_factor_due for lr in lr_scheduler.base_lrs]
            self._lr_factor_due = 1.0

    def on_step_end(self, args: TrainingArguments, state: TrainerState, control: TrainerControl,
                    **kwargs: Any) -> TrainerControl:
        now = time.monotonic()
        step_s = now - self._last_step_end
        self._train_seconds += step_s
        self._steps_timed += 1
        self._last_step_end = now
        if self._steps_timed == 1:
            self.check_notice_window(step_s)
        due = state.global_step >= state.max_steps or self.interval.due(now - self._last_save)
        stop, due = agree([self.stop.is_set(), due], args.device)
        if stop:
            self.stop.set("a peer's notice")  # kept as is when this rank saw the notice itself
            if not self.preempted:
                self.preempted = True
                self.emit("stop", reason=self.stop.reason, step=state.global_step)
            control.should_save = control.should_training_stop = True
        elif due:
            control.should_save = True
        if control.should_save:
            self._save_requested = now
            if self.guard is not None:
                control.should_log = True  # the guard judges the loss before any state is saved
        return control

    def check_notice_window(self, step_s: float) -> None:
        """Warn once when a step plus a save would overrun the cloud's notice window (the stop waits for both)."""
        window = self.notice.window_s if self.notice is not None else None
        if window is not None and step_s + self.interval.cost_s > window:
            warn(f"a step ({step_s:.1f} s) plus a checkpoint ({self.interval.cost_s:.1f} s) exceeds the {window:.0f} s "
                 "preemption notice: an emergency checkpoint may not finish; use a smaller global batch "
                 "(per_device_train_batch_size x gradient_accumulation_steps)")

    def on_save(self, args: TrainingArguments, state: TrainerState, control: TrainerControl,
                **kwargs: Any) -> None:
        now, reached = time.monotonic(), utc_now()
        step = state.global_step
        kind = "emergency" if self.preempted else "final" if step >= state.max_steps else "periodic"
        directory = self.output_dir / f"checkpoint-{step}"
        gather_rng_states(directory)  # before the manifest vouches for them
        # In a store rank 0 alone vouches and uploads: with the Trainer's save_on_each_node every instance's first
        # process would upload a copy of its own (its manifest vouching for its instance's RNG states only), and
        # prune the store against the others. On disk each process the Trainer saves with keeps its copy.
        vouches = state.is_world_process_zero if self.mirror is not None else args.should_save
        name = directory.name
        if vouches:
            write_manifest(directory, step=step, samples_done=step * self._global_batch,
                           world_size=args.world_size, kind=kind, rollbacks=self.rollbacks, lr_scale=self.lr_scale,
                           resume_shape=self.resume_shape, **writer_generation())
            prune(self.output_dir, self.keep, warn)
            if self.mirror is not None:  # inside the save's time, so the Young/Daly interval counts it
                name = self.mirror.upload_checkpoint(directory)
                self.mirror.prune(self.output_dir, self.keep, keeping=name)
        barrier()  # no rank exits (torchrun would then stop the others) before the checkpoint is complete
        if self.mirror is not None and other_instance_leader():
            prune_staging(self.output_dir, self.keep)
        self.checkpointed_step, self.checkpoint_name, self.checkpointed_at = step, name, reached
        save_s = now - self._save_requested if self._save_requested is not None else None
        if save_s is not None:  # a save the Trainer made on its own (e.g. at an epoch end) is not timed
            self.interval.record_cost(save_s)
        self._save_requested = None
        self._last_save = self._last_step_end = time.monotonic()  # a save is not training time
        self.write_progress(args, state, "preempted" if self.preempted else "running")
        self.emit("checkpoint", name=name, kind=kind, step=step,
                  samples_done=step * self._global_batch, save_s=None if save_s is None else round(save_s, 4),
                  interval_s=round(self.interval.seconds, 3))

    def on_log(self, args: TrainingArguments, state: TrainerState, control: TrainerControl,
               logs: dict[str, float] | None = None, **kwargs: Any) -> TrainerControl:
        if logs and "loss" in logs:
            self.loss = float(logs["loss"])
            self.emit("log", step=state.global_step, loss=self.loss)
            reason = bad_loss_reason(self.loss, self.losses, self.guard) if self.guard is not None else None
            if reason is not None:  # the same gathered loss on every rank: they all stop here, unsaved
                self.diverged = reason
                control.should_save, control.should_training_stop = False, True
            else:
                self.losses = [*self.losses, self.loss][-LOSS_HISTORY:]
        return control

    def on_evaluate(self, args: TrainingArguments, state: TrainerState, control: TrainerControl,
                    metrics: dict[str, float] | None = None, **kwargs: Any) -> None:
        if metrics and "eval_loss" in metrics:
            self.eval_loss = float(metrics["eval_loss"])
            self.emit("eval", step=state.global_step, eval_loss=self.eval_loss)

    def on_train_end(self, args: TrainingArguments, state: TrainerState, control: TrainerControl,
                     **kwargs: Any) -> None:
        self.close()

    def close(self) -> None:
        """Stop the notice watcher and give SIGTERM its previous handler back."""
        if self._watcher is not None:
            self._watcher.stop()
            self._watcher = None
        if self._restore_sigterm is not None:
            self._restore_sigterm()
            self._restore_sigterm = None

    # -- reporting -----------------------------------------------------------------------------

    @property
    def samples_per_second(self) -> float:
        """Measured over this process's steps, checkpoint saves excluded."""
        return 0.0 if not self._train_seconds else self._steps_timed * self._global_batch / self._train_seconds

    def write_progress(self, args: TrainingArguments, state: TrainerState, status: str) -> None:
        """Rank 0's ``progress.json``: checkpointed samples, measured samples/s, loss, step; best-effort."""
        if not state.is_world_process_zero:
            return
        try:
            write_progress(self.checkpoint_uri, Progress(
                samples_done=self.checkpointed_step * self._global_batch,
                samples_total=state.max_steps * self._global_batch, step=self.checkpointed_step, loss=self.loss,
                samples_per_second=round(self.samples_per_second, 3), world_size=args.world_size,
                checkpoint=self.checkpoint_name,
                status=status, updated=utc_now(), eval_loss=self.eval_loss, checkpointed=self.checkpointed_at,
                resumed=self.resumed, resumed_samples=self.resumed_samples))
        except Exception as error:  # storage errors share no base class; the next write replaces it
            warn(f"progress not written ({type(error).__name__}: {error}); the next write replaces it")

    @property
    def exit_code(self) -> int:
        return EXIT_PREEMPTED if self.preempted else EXIT_DONE

    def train(self, trainer: Trainer) -> int:
        """Point ``trainer`` at the checkpoint URI, resume, train, export the adapter; the exit code."""
        trainer.args.output_dir = str(self.output_dir)
        use_global_order(trainer)
        trainer.add_callback(self)
        leader = trainer.is_world_process_zero()
        self._global_batch = global_batch(trainer.args)  # what the checkpoint resumed must have been made with
        self._batch_fields = self.step_batch or {
            "per_device_train_batch_size": trainer.args.per_device_train_batch_size,
            "gradient_accumulation_steps": trainer.args.gradient_accumulation_steps, "world_size": trainer.args.world_size}
        resume = self.resume_checkpoint(leader)
        # the checkpoint of the job's last step, when that is where it resumes: nothing is left to train
        finished = resume if resume is not None and 0 < trainer.args.max_steps <= self.checkpointed_step else None
        if finished is not None and self.exported_and_done():
            self.emit("done", step=self.checkpointed_step, loss=read_progress(self.checkpoint_uri).loss,
                      final=self.final_uri)
            return EXIT_DONE
        if finished is not None:
            self.load_finished(trainer, finished, leader)
        else:
            while True:
                try:
                    trainer.train(resume_from_checkpoint=resume)
                finally:
                    self.close()
                if self.diverged is None or self.preempted:
                    break
                resume = self.roll_back(leader)
            if self.preempted:
                return EXIT_PREEMPTED
        if leader:
            trainer.save_model(str(self.root / FINAL))
            if self.mirror is not None:
                self.mirror.upload(self.root / FINAL)
        self.write_progress(trainer.args, trainer.state, "done")
        self.emit("done", step=trainer.state.global_step, loss=self.loss, final=self.final_uri)
        return EXIT_DONE

    def load_finished(self, trainer: Trainer, checkpoint: str, leader: bool) -> None:
        """Load the last step's checkpoint into ``trainer`` to export it: the run that saved it ended
        before its export, and ``Trainer.train`` resumed at ``max_steps`` would train one step more
        than asked (a step billed, and an adapter off the uninterrupted curve)."""
        trainer._load_from_checkpoint(checkpoint)  # what train(resume_from_checkpoint=...) loads first
        trainer.state.max_steps, trainer.state.global_step = trainer.args.max_steps, self.checkpointed_step
        trainer.state.is_world_process_zero = leader
        self.loss = read_progress(self.checkpoint_uri).loss

    def roll_back(self, leader: bool) -> str:
        """After the guard stopped training: the newest checkpoint (every saved state was judged good) and
        the learning rate times ``lr_backoff``; :class:`.guard.DivergenceError` past ``max_rollbacks``."""
        assert self.guard is not None and self.diverged is not None
        reason, self.diverged = self.diverged, None
        check_rollback_allowed(self.rollbacks, reason, self.guard)
        resume = self.resume_checkpoint(leader, lr_scale=self.lr_scale * self.guard.lr_backoff)
        if resume is None:
            raise DivergenceError(f"training diverged ({reason}) before its first checkpoint: nothing to roll back "
                                  "to; lower lr or check the data")
        self.rollbacks += 1
        self.emit("rollback", reason=reason, checkpoint=self.checkpoint_name, step=self.checkpointed_step,
                  lr_scale=self.lr_scale, rollbacks=self.rollbacks)
        return resume

    @property
    def final_uri(self) -> str:
        """Where the finished adapter is: ``URI/final``."""
        return f"{self.checkpoint_uri}/{FINAL}" if self.mirror is not None else str(self.root / FINAL)

    def exported_and_done(self) -> bool:
        """Whether a job whose last step is checkpointed also got as far as its export and its progress
        ``done``: started again, it has nothing left to do."""
        exported = self.mirror.has(self.root / FINAL) if self.mirror is not None else (self.root / FINAL).is_dir()
        return exported and read_progress(self.checkpoint_uri).status == "done"


def distributed() -> bool:
    """Whether this process is one of several in a torch.distributed group (as under torchrun)."""
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def agree(flags: list[bool], device: torch.device) -> list[bool]:
    """Each flag set on any rank, on every rank: one all-reduce (MAX) of them, gloo on CPU, NCCL on GPU."""
    if not distributed():
        return flags
    tensor = torch.tensor([float(flag) for flag in flags], device=device)
    dist.all_reduce(tensor, op=dist.ReduceOp.MAX)
    return [bool(value) for value in tensor.tolist()]


def barrier() -> None:
    if distributed():
        dist.barrier()


def other_instance_leader() -> bool:
    """Whether this process is the first (torchrun's ``LOCAL_RANK`` 0) of another instance than rank 0's
    (``GROUP_RANK`` not 0): the one that keeps that instance's staging disk."""
    return os.environ.get("LOCAL_RANK", "0") == "0" and os.environ.get("GROUP_RANK", "0") != "0"


def prune_staging(output_dir: Path, keep: int) -> None:
    """Keep the ``keep`` newest ``checkpoint-N`` of another instance than rank 0's staging disk; never the store.

    No manifest vouches for them there (rank 0 gathered their RNG states and uploaded the checkpoint), so
    :func:`.hf_checkpoints.prune` would keep them all, and the disk grew by one directory per save. Called after
    the save's last barrier, when rank 0's own pruning is over; errors are ignored, as several instances on one
    machine share a staging disk and prune the same directories.
    """
    for old in checkpoints(output_dir)[keep:]:
        shutil.rmtree(old, ignore_errors=True)


def gather_rng_states(directory: Path) -> None:
    """Bring every rank's ``rng_state_R.pth`` into rank 0's copy of the checkpoint just saved, for its manifest
    to vouch for and the mirror to upload.

    The Trainer writes each process's RNG state on its own instance's disk: from another instance than rank 0's
    it never reached the store, and a resume there went on with other random streams (dropout) than an
    uninterrupted run. A few KB per rank, gathered to rank 0, which writes the ones it lacks; a rank without
    one (``save_only_model``) sends nothing, and the checkpoint goes without it. Also the barrier after the
    Trainer's save: every rank has written its files when it sends.
    """
    if not distributed():
        return
    rank = dist.get_rank()
    own = directory / f"rng_state_{rank}.pth"
    sent = own.read_bytes() if rank != 0 and own.is_file() else None
    received: list[bytes | None] | None = [None] * dist.get_world_size() if rank == 0 else None
    dist.gather_object(sent, received, dst=0)
    for peer, data in enumerate(received or []):
        if data is not None and not (directory / f"rng_state_{peer}.pth").is_file():
            (directory / f"rng_state_{peer}.pth").write_bytes(data)


def use_global_order(trainer: Trainer) -> None:
    """Give ``trainer`` a :class:`GlobalOrderSampler` in place of its (world-size dependent) random one.

    Only for the default ``train_sampling_strategy="random"`` on a sized data set; a script that
    chose another strategy (or an iterable data set) keeps its own, and with it the order it implies.
    """
    dataset = trainer.train_dataset
    if trainer.args.train_sampling_strategy != "random" or dataset is None or not has_length(dataset):
        return
    sampler = GlobalOrderSampler(len(dataset), global_batch(trainer.args), trainer.args.seed)
    # Trainer documents subclassing to change the sampler; an instance attribute does the same for
    # a Trainer (or SFTTrainer) the user built, without asking them to subclass it.
    trainer._get_train_sampler = lambda train_dataset=None: sampler  # type: ignore[method-assign]
    trainer.add_callback(SamplerEpoch(sampler))


class SamplerEpoch(TrainerCallback):
    """Tells the :class:`GlobalOrderSampler` its epoch, from the step count, as each epoch begins.

    The Trainer's own ``set_epoch`` misses the sampler of a multi-process job that resumes inside
    an epoch after the first: accelerate's ``skip_first_batches`` wraps the sharded batch sampler in
    a ``SkipBatchSampler``, and neither ``DataLoaderShard.set_epoch`` nor the Trainer looks through
    both wrappers (transformers 5.24, accelerate 1.15), so the resumed epoch replayed epoch 0's order.
    """

    def __init__(self, sampler: GlobalOrderSampler) -> None:
        self.sampler = sampler

    def on_epoch_begin(self, args: TrainingArguments, state: TrainerState, control: TrainerControl,
                       **kwargs: Any) -> None:
        self.sampler.set_epoch(self.sampler.epoch_of(state.global_step))


def global_batch(args: TrainingArguments) -> int:
    """Samples per optimizer step across all processes (the work unit's step size)."""
    return args.per_device_train_batch_size * args.gradient_accumulation_steps * args.world_size


def spot_train(trainer: Trainer, checkpoint_uri: str | None = None) -> int:
    """``trainer.train()`` under the spot contract; returns the exit code (0 done, 75 preempted)."""
    return SpotCallback.from_env(checkpoint_uri=checkpoint_uri).train(trainer)

