"""The object-store mirror of Trainer checkpoints: complete-or-absent in the store, verified on the way down."""

from __future__ import annotations

import errno
import json
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from fsspec.implementations.local import LocalFileSystem
from transformers import TrainerControl, TrainerState

from airflow_provider_spotsched.runtime import hf_checkpoints
from airflow_provider_spotsched.runtime.contract import read_progress
from airflow_provider_spotsched.runtime.hf_callback import SpotCallback
from airflow_provider_spotsched.runtime.hf_checkpoints import MANIFEST, verify, write_manifest
from airflow_provider_spotsched.runtime.hf_mirror import (
    CheckpointMirror,
    is_remote,
    staging_directory,
    stored_generation,
    stored_step,
)


class RecordingFileSystem(LocalFileSystem):
    """The local filesystem, with the order of the files put into it."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.put: list[str] = []

    def put_file(self, lpath: str, rpath: str, **kwargs: Any) -> None:
        self.put.append(Path(rpath).name)
        super().put_file(lpath, rpath, **kwargs)


class InterleavingFileSystem(LocalFileSystem):
    """The local filesystem that runs ``meanwhile`` once, right after the first file is put: another writer's
    upload lands in the middle of this one's."""

    def __init__(self, meanwhile: Callable[[], None] | None = None) -> None:
        super().__init__(skip_instance_cache=True)
        self.meanwhile = meanwhile

    def put_file(self, lpath: str, rpath: str, **kwargs: Any) -> None:
        self.makedirs(self._parent(rpath), exist_ok=True)  # as in an object store, whose folders are only names
        super().put_file(lpath, rpath, **kwargs)
        meanwhile, self.meanwhile = self.meanwhile, None
        if meanwhile is not None:
            meanwhile()


def saved(local: Path, step: int, payload: bytes = b"weights") -> Path:
    """A complete local checkpoint of ``step``, as the callback leaves it after a save."""
    directory = local / "checkpoints" / f"checkpoint-{step}"
    directory.mkdir(parents=True)
    (directory / "adapter_model.safetensors").write_bytes(payload)
    (directory / "trainer_state.json").write_text(json.dumps({"global_step": step}))
    write_manifest(directory, step=step)
    return directory


def mirror_in(tmp_path: Path) -> tuple[CheckpointMirror, Path, Path, list[str]]:
    local, store = tmp_path / "staging", tmp_path / "store"
    log: list[str] = []
    mirror = CheckpointMirror(f"local://{store}", local, log.append)
    mirror.fs = RecordingFileSystem()
    return mirror, local, store, log


def test_only_object_store_urls_are_mirrored(tmp_path: Path) -> None:
    assert is_remote("s3://bucket/run") and is_remote("gs://bucket/run") and is_remote("local:///tmp/x")
    assert not is_remote("/tmp/run") and not is_remote("file:///tmp/run") and not is_remote("relative/run")
    one, other = staging_directory("s3://b/run", {"SPOTSCHED_STAGING_DIR": str(tmp_path)}), \
        staging_directory("s3://b/run2", {"SPOTSCHED_STAGING_DIR": str(tmp_path)})
    assert one.parent == tmp_path and one != other
    assert staging_directory("s3://b/run/", {"SPOTSCHED_STAGING_DIR": str(tmp_path)}) == one


def test_the_manifest_goes_up_last(tmp_path: Path) -> None:
    mirror, local, store, _ = mirror_in(tmp_path)
    mirror.upload(saved(local, 4))
    assert mirror.fs.put[-1] == MANIFEST and len(mirror.fs.put) == 3  # type: ignore[attr-defined]
    assert (store / "checkpoints" / "checkpoint-4" / MANIFEST).is_file()


def test_an_upload_cut_off_before_its_manifest_is_never_resumed_from(tmp_path: Path) -> None:
    mirror, local, store, _ = mirror_in(tmp_path)
    mirror.upload(saved(local, 4))
    cut = saved(local, 8)
    (store / "checkpoints" / "checkpoint-8").mkdir(parents=True)
    (store / "checkpoints" / "checkpoint-8" / "adapter_model.safetensors").write_bytes((cut / "adapter_model.safetensors").read_bytes())
    fresh = tmp_path / "other-machine"
    mirror.local_root = fresh
    chosen, _, skipped = mirror.fetch_latest_valid(fresh / "checkpoints")
    assert chosen == fresh / "checkpoints" / "checkpoint-4" and skipped == []
    assert (chosen / "adapter_model.safetensors").read_bytes() == b"weights"


def test_a_corrupt_store_checkpoint_is_skipped_named_and_removed(tmp_path: Path) -> None:
    mirror, local, store, log = mirror_in(tmp_path)
    mirror.upload(saved(local, 4))
    mirror.upload(saved(local, 8))
    (store / "checkpoints" / "checkpoint-8" / "adapter_model.safetensors").write_bytes(b"bitrot!")
    chosen, _, skipped = mirror.fetch_latest_valid(local / "checkpoints")
    assert chosen is not None and chosen.name == "checkpoint-4"
    assert skipped and skipped[0].startswith("checkpoint-8: checksum mismatch")
    assert not (store / "checkpoints" / "checkpoint-8").exists() and "checkpoint-8" in log[0]


def test_a_store_checkpoint_unreadable_on_the_staging_disk_is_skipped_and_kept(tmp_path: Path, monkeypatch) -> None:
    """A read error on the local copy says nothing against the store's: only a corrupt one is removed there."""
    mirror, local, store, log = mirror_in(tmp_path)
    mirror.upload(saved(local, 4))
    mirror.upload(saved(local, 8))
    real_digest = hf_checkpoints._digest

    def flaky_disk(path: Path) -> tuple[int, str]:
        if path.parent.name == "checkpoint-8":
            raise OSError(errno.EIO, "Input/output error", str(path))
        return real_digest(path)

    monkeypatch.setattr(hf_checkpoints, "_digest", flaky_disk)
    chosen, _, skipped = mirror.fetch_latest_valid(local / "checkpoints")
    assert chosen is not None and chosen.name == "checkpoint-4"
    assert skipped and skipped[0].startswith("checkpoint-8: ") and "could not be read" in skipped[0]
    assert (store / "checkpoints" / "checkpoint-8" / MANIFEST).is_file() and "kept there" in log[0]


def test_the_store_keeps_the_newest_complete_checkpoints_and_a_running_upload(tmp_path: Path) -> None:
    mirror, local, store, _ = mirror_in(tmp_path)
    for step in (2, 4, 6, 8):
        mirror.upload(saved(local, step))
    (store / "checkpoints" / "checkpoint-1").mkdir()  # an old upload that never finished
    (store / "checkpoints" / "checkpoint-10").mkdir()  # one being uploaded now (no manifest yet)
    removed = mirror.prune(local / "checkpoints", keep=2)
    assert sorted(removed) == ["checkpoint-1", "checkpoint-2", "checkpoint-4"]
    assert sorted(p.name for p in (store / "checkpoints").iterdir()) == ["checkpoint-10", "checkpoint-6", "checkpoint-8"]


def test_an_empty_store_has_nothing_to_resume(tmp_path: Path) -> None:
    mirror, local, _, _ = mirror_in(tmp_path)
    assert mirror.fetch_latest_valid(local / "checkpoints") == (None, None, [])
    assert mirror.prune(local / "checkpoints", keep=1) == []


def test_a_stale_generations_newer_checkpoint_never_leaves_the_store_without_a_fallback(tmp_path: Path) -> None:
    """keep=1. Generation 2 resumes from checkpoint-100 while a stale writer of generation 1 (a released
    instance) finishes its checkpoint-150 afterwards. Ranked by step, 150 pushed generation 2's own saves out
    of the store, so when generation 2 saved step 150 again over it and was cut off mid-upload, 150 was
    corrupt (generation 1's manifest, generation 2's files) and nothing was left to resume from."""
    mirror, first, store, _ = mirror_in(tmp_path)
    mirror.upload(saved(first, 100))
    second = tmp_path / "generation-2"
    mirror.local_root = second
    chosen, _, _ = mirror.fetch_latest_valid(second / "checkpoints")
    assert chosen is not None and chosen.name == "checkpoint-100"
    mirror.local_root = first
    mirror.upload(saved(first, 150, b"generation 1's weights"))  # the stale writer's upload lands now
    mirror.local_root = second
    mirror.upload(saved(second, 120))
    mirror.prune(second / "checkpoints", keep=1, keeping="checkpoint-120")
    assert (store / "checkpoints" / "checkpoint-120" / MANIFEST).is_file()  # progress.json names it
    own = saved(second, 150, b"generation 2's weights")  # the same step again, cut off after its first file
    (store / "checkpoints" / "checkpoint-150" / "adapter_model.safetensors").write_bytes(
        (own / "adapter_model.safetensors").read_bytes())
    third = tmp_path / "generation-3"
    mirror.local_root = third
    chosen, _, skipped = mirror.fetch_latest_valid(third / "checkpoints")
    assert [s.split(":")[0] for s in skipped] == ["checkpoint-150"]
    assert chosen is not None and chosen.name == "checkpoint-120"


def test_two_generations_saving_the_same_step_at_once_leave_only_complete_checkpoints(tmp_path: Path) -> None:
    """keep=1. A stale generation and the next both resumed from checkpoint-100 and save step 150 at the same
    moment: the next one's whole upload and prune land between the stale one's first file and the rest. Into one
    checkpoint-150 they mixed their files under the stale one's manifest (last), after the next one's prune had
    removed checkpoint-100: the store held no usable checkpoint. Each upload now has a directory of its own, and
    a prune leaves an upload of the newest step alone."""
    store = tmp_path / "store"

    def writer(name: str, meanwhile: Callable[[], None] | None = None) -> CheckpointMirror:
        mirror = CheckpointMirror(f"local://{store}", tmp_path / name, lambda message: None)
        mirror.fs = InterleavingFileSystem(meanwhile)
        return mirror

    writer("first").upload_checkpoint(saved(tmp_path / "first", 100))
    new = writer("new")

    def new_generation_saves() -> None:
        stored = new.upload_checkpoint(saved(tmp_path / "new", 150, b"the new generation's weights"))
        new.prune(tmp_path / "new" / "checkpoints", keep=1, keeping=stored)

    stale = writer("stale", new_generation_saves)
    stored = stale.upload_checkpoint(saved(tmp_path / "stale", 150, b"the stale generation's weights"))
    stale.prune(tmp_path / "stale" / "checkpoints", keep=1, keeping=stored)

    fresh, output = writer("fresh"), tmp_path / "fresh" / "checkpoints"
    names = fresh.remote_checkpoints(output)
    assert names and all(stored_step(name) == 150 for name in names)
    for name in names:  # every checkpoint with a manifest is whole: none is a mix, none lost files to a prune
        verify(fresh.download(output, name))
    chosen, _, skipped = fresh.fetch_latest_valid(output)
    assert skipped == [] and chosen == output / "checkpoint-150"



def test_an_older_generations_cut_off_upload_goes_once_a_newer_one_completes_its_step(tmp_path: Path, monkeypatch) -> None:
    """Generation 1 was preempted while uploading step 8, the job's last; generation 2 resumed and completed step 8.
    No higher step ever came to prune generation 1's upload, and a prune kept it for ever as "maybe still running".
    The generation is in the upload's name (its manifest, last, never came), so a prune can tell it is stale."""
    monkeypatch.setenv("SPOTSCHED_GENERATION", "2")
    mirror, local, store, _ = mirror_in(tmp_path)
    folder = store / "checkpoints"
    for cut_off in ("checkpoint-8.g1-0badc0de", "checkpoint-8.g2-0000beef", "checkpoint-8.g3-00c0ffee",
                    "checkpoint-8.00000001", "checkpoint-12.g1-0badc0de"):
        (folder / cut_off).mkdir(parents=True)
        (folder / cut_off / "adapter_model.safetensors").write_bytes(b"half")
    stored = mirror.upload_checkpoint(saved(local, 8))
    assert stored.startswith("checkpoint-8.g2-") and stored_generation(stored) == 2
    assert mirror.prune(local / "checkpoints", keep=1, keeping=stored) == ["checkpoint-8.g1-0badc0de"]
    # kept: this generation's own and a newer one's (either may still be uploading), one that names no
    # generation, and generation 1's of a step no newer generation completed
    assert sorted(p.name for p in folder.iterdir()) == sorted(
        [stored, "checkpoint-8.g2-0000beef", "checkpoint-8.g3-00c0ffee", "checkpoint-8.00000001", "checkpoint-12.g1-0badc0de"])


def test_a_stale_upload_whose_files_a_prune_removed_never_displaces_the_newer_generations(tmp_path: Path) -> None:
    """keep=1. Generations 9 (stale) and 10 save step 150 at once: 10's upload and prune land after 9's first file,
    and the prune removes 9's upload as an older generation's at a step 10 completed. 9 goes on and puts the rest
    and its manifest: a checkpoint missing a file. Ranked by name ("g9-" after "g10-"), 9's prune then kept it and
    removed 10's, and the store held nothing usable; of one step the newest generation's now ranks first."""
    store = tmp_path / "store"

    def writer(name: str, generation: int | None, meanwhile: Callable[[], None] | None = None) -> CheckpointMirror:
        mirror = CheckpointMirror(f"local://{store}", tmp_path / name, lambda message: None)
        mirror.fs, mirror.generation = InterleavingFileSystem(meanwhile), generation
        return mirror

    writer("first", 9).upload_checkpoint(saved(tmp_path / "first", 100))
    new = writer("new", 10)

    def new_generation_saves() -> None:
        stored = new.upload_checkpoint(saved(tmp_path / "new", 150, b"generation 10's weights"))
        new.prune(tmp_path / "new" / "checkpoints", keep=1, keeping=stored)

    stale = writer("stale", 9, new_generation_saves)
    stored = stale.upload_checkpoint(saved(tmp_path / "stale", 150, b"generation 9's weights"))
    stale.prune(tmp_path / "stale" / "checkpoints", keep=1, keeping=stored)

    output = tmp_path / "fresh" / "checkpoints"
    chosen, name, skipped = writer("fresh", 11).fetch_latest_valid(output)
    assert skipped == [] and name is not None and stored_generation(name) == 10
    assert chosen is not None and (chosen / "adapter_model.safetensors").read_bytes() == b"generation 10's weights"


def test_progress_names_the_checkpoints_directory_in_the_store(tmp_path: Path) -> None:
    """progress.json's checkpoint said checkpoint-N, which the store does not hold since each upload has a
    directory of its own (checkpoint-N.<upload id>): it names that directory, after a save and after a resume."""
    store, world = tmp_path / "store", SimpleNamespace(should_save=True, world_size=1)
    saver = SpotCallback(f"local://{store}", staging_dir=tmp_path / "machine-a", emit=lambda event, **fields: None)
    (saver.output_dir / "checkpoint-3").mkdir(parents=True)
    (saver.output_dir / "checkpoint-3" / "adapter_model.safetensors").write_bytes(b"weights")
    saver.on_save(world, TrainerState(global_step=3, max_steps=6, is_world_process_zero=True), TrainerControl())
    named = read_progress(f"local://{store}").checkpoint
    assert named is not None and named.startswith("checkpoint-3.") and (store / "checkpoints" / named / MANIFEST).is_file()
    resumed = SpotCallback(f"local://{store}", staging_dir=tmp_path / "machine-b", emit=lambda event, **fields: None)
    resumed.resume_checkpoint()
    resumed.write_progress(world, TrainerState(max_steps=6, is_world_process_zero=True), "running")
    assert read_progress(f"local://{store}").checkpoint == named

@pytest.mark.parametrize("in_store", [True, False], ids=["store", "disk"])
def test_the_checkpoint_and_resumed_events_name_the_checkpoints_directory_in_the_store(
        tmp_path: Path, in_store: bool) -> None:
    """The events said checkpoint-N, the staging copy's name, which a user reading the run log could not find in
    the store (checkpoint-N.<upload id>); on a local disk they keep the name the checkpoint has there."""
    uri, world = f"local://{tmp_path / 'store'}" if in_store else str(tmp_path / "disk"), \
        SimpleNamespace(should_save=True, world_size=1)
    events: list[dict[str, Any]] = []

    def callback(machine: str) -> SpotCallback:
        return SpotCallback(uri, staging_dir=tmp_path / machine if in_store else None,
                            emit=lambda event, **fields: events.append({"event": event, **fields}))

    saver = callback("machine-a")
    (saver.output_dir / "checkpoint-3").mkdir(parents=True)
    (saver.output_dir / "checkpoint-3" / "adapter_model.safetensors").write_bytes(b"weights")
    saver.on_save(world, TrainerState(global_step=3, max_steps=6, is_world_process_zero=True), TrainerControl())
    callback("machine-b").resume_checkpoint()
    named = read_progress(uri).checkpoint
    assert [(event["event"], event.get("name", event.get("checkpoint"))) for event in events] == [
        ("checkpoint", named), ("resumed", named)]
    if in_store:
        assert named is not None and named.startswith("checkpoint-3.")
        assert (tmp_path / "store" / "checkpoints" / named / MANIFEST).is_file()
    else:
        assert named == "checkpoint-3"

RANK_SAVES = """
import sys
from pathlib import Path
from types import SimpleNamespace
import torch.distributed as dist
from transformers import TrainerControl, TrainerState
from airflow_provider_spotsched.runtime.config import CheckpointSettings
from airflow_provider_spotsched.runtime.hf_callback import SpotCallback
rank, tmp, steps, each_node = int(sys.argv[1]), Path(sys.argv[2]), [int(s) for s in sys.argv[3].split(",")], sys.argv[4] == "1"
dist.init_process_group("gloo", init_method=f"file://{tmp / 'rendezvous'}", rank=rank, world_size=2)
callback = SpotCallback(f"local://{tmp / 'store'}", CheckpointSettings(keep=1), staging_dir=tmp / f"instance-{rank}",
                        emit=lambda event, **fields: None)
for step in steps:
    directory = callback.output_dir / f"checkpoint-{step}"  # as the Trainer leaves it on this rank's instance
    directory.mkdir(parents=True)
    (directory / f"rng_state_{rank}.pth").write_bytes(f"rank {rank}'s generators".encode())
    if rank == 0 or each_node:  # the Trainer's save_on_each_node: the model is saved on every instance
        (directory / "adapter_model.safetensors").write_bytes(b"weights")
    state = TrainerState(global_step=step, max_steps=6, is_world_process_zero=rank == 0)
    callback.on_save(SimpleNamespace(should_save=rank == 0 or each_node, world_size=2), state, TrainerControl())
dist.destroy_process_group()
"""


def save_on_two_instances(tmp_path: Path, steps: list[int], each_node: bool = False) -> Path:
    """Ranks 0 and 1, each the first process of an instance of its own (a staging disk each), save ``steps``
    (keep=1) into the store under ``tmp_path``; a fresh instance's copy of the store's newest checkpoint."""
    workers = [subprocess.Popen([sys.executable, "-c", RANK_SAVES, str(rank), str(tmp_path), ",".join(map(str, steps)),
                                 str(int(each_node))], env={**os.environ, "LOCAL_RANK": "0", "GROUP_RANK": str(rank)},
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for rank in range(2)]
    for worker in workers:
        _, err = worker.communicate(timeout=240)
        assert worker.returncode == 0, err[-2000:]
    fresh = CheckpointMirror(f"local://{tmp_path / 'store'}", tmp_path / "instance-new", lambda message: None)
    chosen, _, skipped = fresh.fetch_latest_valid(tmp_path / "instance-new" / "checkpoints")
    assert skipped == [] and chosen is not None and chosen.name == f"checkpoint-{steps[-1]}"
    return chosen


def test_the_rng_state_of_a_rank_on_another_instance_goes_into_the_stored_checkpoint(tmp_path: Path) -> None:
    """Two ranks on two instances (staging disks) save step 3: rank 1's rng_state_1.pth was written on its own
    disk only, so the store's checkpoint lacked it and a resume on fresh instances went on without it."""
    chosen = save_on_two_instances(tmp_path, [3])
    assert (chosen / "rng_state_1.pth").read_bytes() == b"rank 1's generators"
    assert {"rng_state_0.pth", "rng_state_1.pth"} <= set(verify(chosen)["files"])  # checksummed with the rest


def test_with_save_on_each_node_only_rank_0_uploads_a_checkpoint(tmp_path: Path) -> None:
    """The Trainer's save_on_each_node makes the first process of every instance a saver (should_save): each
    wrote a manifest and uploaded its own copy of the step, one of them without the other instances' RNG states,
    which a resume could pick, and pruned the store against the other's upload."""
    chosen = save_on_two_instances(tmp_path, [3], each_node=True)
    assert [path.name.split(".")[0] for path in (tmp_path / "store" / "checkpoints").iterdir()] == ["checkpoint-3"]
    assert {"rng_state_0.pth", "rng_state_1.pth"} <= set(verify(chosen)["files"])
    assert not (tmp_path / "instance-1" / "checkpoints" / "checkpoint-3" / MANIFEST).exists()  # rank 1 vouched for none


def test_another_instances_staging_keeps_only_its_newest_checkpoints(tmp_path: Path) -> None:
    """keep=1. On an instance other than rank 0's nothing vouches for the staging checkpoint-N/ (its ranks' RNG
    states), and nothing pruned them: the staging disk grew by one directory per save."""
    chosen = save_on_two_instances(tmp_path, [1, 2, 3])
    assert [path.name for path in (tmp_path / "instance-1" / "checkpoints").iterdir()] == ["checkpoint-3"]
    assert [path.name for path in (tmp_path / "instance-0" / "checkpoints").iterdir()] == ["checkpoint-3"]
    assert (chosen / "rng_state_1.pth").read_bytes() == b"rank 1's generators"  # the store's copy is whole
