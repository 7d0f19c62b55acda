"""Checkpoint storage: atomic writes under kill -9, checksums, fallback to the previous one, keep-last-K."""

from __future__ import annotations

import json
import os
import signal

import pytest
import torch

from airflow_provider_spotsched.runtime import checkpoint as checkpoint_module
from airflow_provider_spotsched.runtime.checkpoint import CheckpointStore
from airflow_provider_spotsched.runtime.contract import Progress, read_progress, write_progress


def state(step: int) -> dict:
    return {"step": step, "weights": torch.full((64, 64), float(step)), "note": f"state of step {step}"}


def test_a_saved_checkpoint_loads_back_with_its_manifest(tmp_path):
    store = CheckpointStore(str(tmp_path))
    assert store.load_latest() is None
    name = store.save(7, state(7), samples_done=56)
    assert name == "ckpt-000000007"
    manifest = json.loads((tmp_path / "checkpoints" / name / "manifest.json").read_text())
    assert manifest["step"] == 7 and manifest["samples_done"] == 56 and len(manifest["sha256"]) == 64
    loaded = store.load_latest()
    assert loaded.name == name and loaded.skipped == ()
    assert torch.equal(loaded.state["weights"], state(7)["weights"])


def test_only_the_last_k_checkpoints_are_kept(tmp_path):
    store = CheckpointStore(str(tmp_path), keep=2)
    for step in (1, 2, 3, 4, 5):
        store.save(step, state(step))
    assert store.names() == ["ckpt-000000005", "ckpt-000000004"]


@pytest.mark.parametrize("corruption", ["flip a byte", "truncate", "garbled manifest", "no payload"])
def test_a_corrupt_newest_checkpoint_is_detected_and_the_previous_one_used(tmp_path, corruption):
    messages: list[str] = []
    store = CheckpointStore(str(tmp_path), log=messages.append)
    store.save(1, state(1))
    store.save(2, state(2))
    newest = tmp_path / "checkpoints" / "ckpt-000000002"
    payload = newest / "state.pt"
    if corruption == "flip a byte":
        data = bytearray(payload.read_bytes())
        data[len(data) // 2] ^= 0xFF
        payload.write_bytes(bytes(data))
    elif corruption == "truncate":
        payload.write_bytes(payload.read_bytes()[:100])
    elif corruption == "garbled manifest":
        (newest / "manifest.json").write_text('{"sha256": ')
    else:
        payload.unlink()
    loaded = store.load_latest()
    assert loaded.name == "ckpt-000000001" and loaded.state["step"] == 1
    (why,) = loaded.skipped
    expected = {"flip a byte": "checksum mismatch", "truncate": "checksum mismatch",
                "garbled manifest": "unreadable manifest", "no payload": "payload missing"}[corruption]
    assert why.startswith("ckpt-000000002: ") and expected in why
    assert messages == [f"checkpoint ckpt-000000002 skipped: {why.split(': ', 1)[1]}"]


@pytest.mark.parametrize("killed_at_fsync", [1, 3], ids=["writing the payload", "writing the manifest"])
def test_kill_9_in_the_middle_of_a_checkpoint_leaves_the_previous_one_loadable(tmp_path, killed_at_fsync):
    """A writer killed at its n-th fsync (1: the payload's temp file, 3: the manifest's) loses nothing."""
    store = CheckpointStore(str(tmp_path))
    store.save(1, state(1))
    ready_read, ready_write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the writer: announce the chosen fsync to the parent, then hang there until killed
        calls = []
        real_fsync = os.fsync

        def fsync_then_hang(fd: int) -> None:
            real_fsync(fd)
            calls.append(fd)
            if len(calls) == killed_at_fsync:
                os.write(ready_write, b"x")
                signal.pause()

        checkpoint_module.os.fsync = fsync_then_hang
        try:
            CheckpointStore(str(tmp_path)).save(2, state(2))
        finally:
            os._exit(0)
    assert os.read(ready_read, 1) == b"x"
    os.kill(pid, signal.SIGKILL)
    os.waitpid(pid, 0)
    os.close(ready_read)
    os.close(ready_write)

    leftovers = sorted(p.name for p in (tmp_path / "checkpoints" / "ckpt-000000002").iterdir())
    assert any(".tmp-" in name for name in leftovers) and "manifest.json" not in leftovers
    loaded = store.load_latest()
    assert loaded.name == "ckpt-000000001" and loaded.state["step"] == 1
    assert "partial checkpoint" in loaded.skipped[0]
    # newer than the newest valid checkpoint, it could be a live writer's: only its temporary files go
    assert store.clean_leftovers() == [name for name in leftovers if ".tmp-" in name]
    assert store.names() == ["ckpt-000000002", "ckpt-000000001"]
    assert not any(".tmp-" in p.name for p in (tmp_path / "checkpoints" / "ckpt-000000002").iterdir())
    store.save(2, state(2))  # the next save of the same step succeeds
    assert store.load_latest().name == "ckpt-000000002"


def test_a_leftover_temp_file_next_to_a_good_checkpoint_is_ignored_and_cleaned(tmp_path):
    messages: list[str] = []
    store = CheckpointStore(str(tmp_path), log=messages.append)
    store.save(1, state(1))
    leftover = tmp_path / "checkpoints" / "ckpt-000000001" / "state.pt.tmp-deadbeef"
    leftover.write_bytes(b"half a write")
    stray = tmp_path / "progress.json.tmp-0badf00d"
    stray.write_text("{")
    assert store.load_latest().name == "ckpt-000000001"
    assert sorted(store.clean_leftovers()) == sorted([leftover.name, stray.name])
    assert not leftover.exists() and not stray.exists()
    assert sorted(messages) == [
        f"temporary file checkpoints/ckpt-000000001/{leftover.name} removed: leftover of an interrupted write",
        f"temporary file {stray.name} removed: leftover of an interrupted write",
    ]


def test_resaving_a_step_never_pairs_a_new_payload_with_the_old_manifest(tmp_path):
    store = CheckpointStore(str(tmp_path))
    store.save(3, state(3))
    replacement = {**state(3), "note": "saved again after a rollback"}
    store.save(3, replacement)
    assert store.load_latest().state["note"] == "saved again after a rollback"
    files = sorted(p.name for p in (tmp_path / "checkpoints" / "ckpt-000000003").iterdir())
    assert files == ["manifest.json", json.loads((tmp_path / "checkpoints" / "ckpt-000000003" / "manifest.json").read_text())["payload"]]


@pytest.mark.parametrize("failing_write", [1, 2], ids=["the payload", "the manifest"])
def test_a_failed_resave_of_a_step_keeps_its_stored_checkpoint(tmp_path, monkeypatch, failing_write):
    """With keep=1 the step being saved again is the only checkpoint: a write that fails must not cost it."""
    store = CheckpointStore(str(tmp_path), keep=1)
    store.save(4, state(4))
    store.save(5, state(5))
    real_write = checkpoint_module.write_atomic
    writes = []

    def full_disk(fs, path, data):
        writes.append(path)
        if len(writes) == failing_write:
            raise OSError(28, "No space left on device", path)
        real_write(fs, path, data)

    monkeypatch.setattr(checkpoint_module, "write_atomic", full_disk)
    with pytest.raises(OSError, match="No space left"):
        store.save(5, {**state(5), "note": "emergency save of the same step"})
    loaded = store.load_latest()
    assert loaded.name == "ckpt-000000005" and loaded.state["note"] == "state of step 5" and not loaded.skipped


def test_fsspec_urls_work_through_the_same_code(tmp_path):
    """The memory:// filesystem stands in for an object store (no temp-file rename there)."""
    store = CheckpointStore("memory://spotsched-test/job-1", keep=2)
    store.save(1, state(1))
    store.save(2, state(2))
    store.write_json("progress.json", {"samples_done": 16})
    assert not store.local and store.load_latest().name == "ckpt-000000002"
    assert json.loads(store.fs.cat_file(store.path("progress.json")))["samples_done"] == 16
    store.fs.pipe_file(store.path("checkpoints", "ckpt-000000003", "state.pt"), b"partial upload")
    assert store.load_latest().name == "ckpt-000000002"
    store.fs.rm(store.path(), recursive=True)


def manifest_of(directory) -> dict:
    return json.loads((directory / "manifest.json").read_text())


def without(key: str):
    return lambda manifest: {k: v for k, v in manifest.items() if k != key}


def with_field(key: str, value):
    return lambda manifest: {**manifest, key: value}


def rewrite_manifest(change):
    def corrupt(directory) -> None:
        (directory / "manifest.json").write_text(json.dumps(change(manifest_of(directory))))
    return corrupt


def write_manifest_bytes(data: bytes):
    return lambda directory: (directory / "manifest.json").write_bytes(data)


def payload_a_directory(directory) -> None:
    (directory / "state.pt").unlink()
    (directory / "state.pt").mkdir()


def manifest_a_directory(directory) -> None:
    (directory / "manifest.json").unlink()
    (directory / "manifest.json").mkdir()


def payload_one_byte_longer(directory) -> None:
    with open(directory / "state.pt", "ab") as handle:
        handle.write(b"\0")


MANIFEST_CORRUPTIONS = {
    "empty object": (write_manifest_bytes(b"{}"), "malformed manifest (no payload, bytes, sha256)"),
    "array": (write_manifest_bytes(b"[]"), "malformed manifest ([] is not an object)"),
    "null": (write_manifest_bytes(b"null"), "malformed manifest (null is not an object)"),
    "no sha256": (rewrite_manifest(without("sha256")), "malformed manifest (no sha256)"),
    "no bytes": (rewrite_manifest(without("bytes")), "malformed manifest (no bytes)"),
    "no payload key": (rewrite_manifest(without("payload")), "malformed manifest (no payload)"),
    "bytes a string": (rewrite_manifest(with_field("bytes", "4096")),
                       "malformed manifest (bytes is '4096', not a size in bytes)"),
    "bytes a boolean": (rewrite_manifest(with_field("bytes", True)),
                        "malformed manifest (bytes is True, not a size in bytes)"),
    "sha256 not a digest": (rewrite_manifest(with_field("sha256", 42)),
                            "malformed manifest (sha256 is 42, not a hex SHA-256 digest)"),
    "payload outside the checkpoint": (rewrite_manifest(with_field("payload", "../ckpt-000000001/state.pt")),
                                       "malformed manifest (payload is '../ckpt-000000001/state.pt', "
                                       "not a file name)"),
    "not UTF-8": (write_manifest_bytes(b"\x80\x81 not text"), "unreadable manifest (not UTF-8"),
    "not JSON": (write_manifest_bytes(b"step=2\n"), "unreadable manifest (Expecting value"),
    "manifest a directory": (manifest_a_directory, "manifest is a directory"),
    "payload a directory": (payload_a_directory, "payload is a directory"),
    "payload of the wrong size": (payload_one_byte_longer, "checksum mismatch"),
}


@pytest.mark.parametrize("corruption", MANIFEST_CORRUPTIONS)
def test_a_checkpoint_whose_manifest_or_payload_has_the_wrong_shape_is_reported_and_skipped(tmp_path, corruption):
    """A bad manifest is a corrupt checkpoint like a bad payload: the runtime must not crash-loop on it."""
    corrupt, expected = MANIFEST_CORRUPTIONS[corruption]
    store = CheckpointStore(str(tmp_path))
    store.save(1, state(1))
    store.save(2, state(2))
    corrupt(tmp_path / "checkpoints" / "ckpt-000000002")
    messages: list[str] = []
    loaded = CheckpointStore(str(tmp_path), log=messages.append).load_latest()
    assert loaded.name == "ckpt-000000001" and loaded.state["step"] == 1
    (why,) = loaded.skipped
    assert why.startswith(f"ckpt-000000002: {expected}")
    assert messages == [f"checkpoint {why.replace(': ', ' skipped: ', 1)}"]
    with pytest.raises(ValueError, match="ckpt-000000002"):
        store.load("ckpt-000000002")  # what a non-leader rank would call: a clear error, no crash of another kind


def flip_a_byte(directory) -> None:
    payload = directory / "state.pt"
    data = bytearray(payload.read_bytes())
    data[len(data) // 2] ^= 0xFF
    payload.write_bytes(bytes(data))


def test_pruning_keeps_the_k_newest_valid_checkpoints_when_the_newest_ones_are_corrupt(tmp_path):
    writer = CheckpointStore(str(tmp_path), keep=4)
    for step in (1, 2, 3, 4):
        writer.save(step, state(step))
    flip_a_byte(tmp_path / "checkpoints" / "ckpt-000000004")
    flip_a_byte(tmp_path / "checkpoints" / "ckpt-000000003")
    messages: list[str] = []
    store = CheckpointStore(str(tmp_path), keep=2, log=messages.append)
    store.prune()
    assert store.names() == ["ckpt-000000002", "ckpt-000000001"]
    assert store.load_latest().name == "ckpt-000000002"
    assert [m.split(" (")[0] for m in messages] == [
        "checkpoint ckpt-000000004 removed: checksum mismatch", "checkpoint ckpt-000000003 removed: checksum mismatch"]


def test_a_save_after_every_checkpoint_went_bad_is_never_pruned_away(tmp_path):
    """Training restarted from zero: its step-0 checkpoint is older than the corrupt ones, and the only valid one."""
    store = CheckpointStore(str(tmp_path), keep=2)
    store.save(5, state(5))
    store.save(6, state(6))
    flip_a_byte(tmp_path / "checkpoints" / "ckpt-000000006")
    rewrite_manifest(without("sha256"))(tmp_path / "checkpoints" / "ckpt-000000005")
    assert store.load_latest() is None
    store.save(0, state(0))
    assert store.names() == ["ckpt-000000000"]
    assert store.load_latest().name == "ckpt-000000000"


def test_a_checkpoint_that_cannot_be_read_is_skipped_but_not_deleted_for_it(tmp_path, monkeypatch):
    """A read error (permissions, a flaky object store) may pass, and the checkpoint be valid after all."""
    messages: list[str] = []
    store = CheckpointStore(str(tmp_path), keep=2, log=messages.append)
    store.save(1, state(1))
    store.save(2, state(2))
    real_cat_file = store.fs.cat_file

    def denied_for_step_2(path: str, *args, **kwargs) -> bytes:
        if "ckpt-000000002" in path:
            raise PermissionError(13, "Permission denied")
        return real_cat_file(path, *args, **kwargs)

    monkeypatch.setattr(store.fs, "cat_file", denied_for_step_2)
    loaded = store.load_latest()
    why = "manifest could not be read ([Errno 13] Permission denied)"
    assert loaded.name == "ckpt-000000001" and loaded.skipped == (f"ckpt-000000002: {why}",)
    store.prune()
    assert store.names() == ["ckpt-000000002", "ckpt-000000001"]
    assert messages == [f"checkpoint ckpt-000000002 skipped: {why}"]


def partial(store: CheckpointStore, step: int) -> None:
    """A checkpoint whose writer has written the payload but not yet (or never) the manifest."""
    store.write_bytes(f"checkpoints/ckpt-{step:09d}/state.pt", b"payload without a manifest")


def test_pruning_removes_a_partial_checkpoint_only_when_a_valid_one_of_a_higher_step_exists(tmp_path):
    messages: list[str] = []
    store = CheckpointStore(str(tmp_path), keep=3, log=messages.append)
    store.save(1, state(1))
    partial(store, 2)
    store.save(3, state(3))
    partial(store, 4)  # newer than every valid checkpoint: it may be being written right now
    store.prune()
    assert store.names() == ["ckpt-000000004", "ckpt-000000003", "ckpt-000000001"]
    assert messages == ["checkpoint ckpt-000000002 removed: no manifest (partial checkpoint: its writer stopped "
                        "before finishing), older than the best valid checkpoint ckpt-000000003"]


def test_pruning_logs_every_checkpoint_it_removes(tmp_path):
    messages: list[str] = []
    store = CheckpointStore(str(tmp_path), keep=2, log=messages.append)
    for step in (1, 2, 3):
        store.save(step, state(step))
    assert messages == ["checkpoint ckpt-000000001 removed: ranked below the 2 valid checkpoints with the most samples done"]


def test_cleaning_leaves_a_partial_checkpoint_that_may_still_be_being_written(tmp_path):
    """With no valid checkpoint, or none newer, a partial one may be another process's write in progress."""
    messages: list[str] = []
    store = CheckpointStore(str(tmp_path), log=messages.append)
    partial(store, 1)
    assert store.clean_leftovers() == [] and store.names() == ["ckpt-000000001"]
    store.save(3, state(3))  # its prune removes ckpt-1: the writer has moved on
    partial(store, 2)
    partial(store, 4)
    assert store.clean_leftovers() == ["ckpt-000000002"]
    assert store.names() == ["ckpt-000000004", "ckpt-000000003"]
    assert messages == [
        f"checkpoint ckpt-00000000{step} removed: no manifest (partial checkpoint: its writer stopped "
        "before finishing), older than the best valid checkpoint ckpt-000000003" for step in (1, 2)]


def test_a_restart_after_the_two_newest_checkpoints_went_bad_resumes_from_the_last_valid_one(tmp_path):
    """The runtime's start (clean, then load) and its next save (which prunes), as train.py runs them."""
    writer = CheckpointStore(str(tmp_path), keep=4)
    for step in (1, 2, 3, 4):
        writer.save(step, state(step))
    rewrite_manifest(without("sha256"))(tmp_path / "checkpoints" / "ckpt-000000004")
    (tmp_path / "checkpoints" / "ckpt-000000003" / "state.pt").write_bytes(b"truncated")
    messages: list[str] = []
    store = CheckpointStore(str(tmp_path), keep=2, log=messages.append)
    assert store.clean_leftovers() == []
    loaded = store.load_latest()
    assert loaded.name == "ckpt-000000002" and loaded.state["step"] == 2
    assert [why.split(" (")[0] for why in loaded.skipped] == [
        "ckpt-000000004: malformed manifest", "ckpt-000000003: checksum mismatch"]
    store.prune()
    assert store.names() == ["ckpt-000000002", "ckpt-000000001"]
    assert store.load_latest().name == "ckpt-000000002"
    assert [m.split(" (")[0] for m in messages] == [
        "checkpoint ckpt-000000004 skipped: malformed manifest", "checkpoint ckpt-000000003 skipped: checksum mismatch",
        "checkpoint ckpt-000000004 removed: malformed manifest", "checkpoint ckpt-000000003 removed: checksum mismatch",
    ]
    store.save(3, state(3))  # training goes on from step 2
    assert store.names() == ["ckpt-000000003", "ckpt-000000002"]


def test_a_stale_generations_emergency_save_of_a_higher_step_never_prunes_the_checkpoint_with_more_samples(
        tmp_path, monkeypatch):
    """Two generations overlap: the released one (world 1, 8 samples a step) saves step 110 (880 samples) after
    the next one (world 4, 32 a step) resumed from step 100; the new generation's step 105 is 960 samples."""
    uri = str(tmp_path)
    old, new = CheckpointStore(uri, keep=1), CheckpointStore(uri, keep=1)
    monkeypatch.setenv("SPOTSCHED_GENERATION", "3")
    old.save(100, state(100), samples_done=800, world_size=1)
    assert new.load_latest().name == "ckpt-000000100"
    old.save(110, state(110), samples_done=880, world_size=1, kind="emergency")
    monkeypatch.setenv("SPOTSCHED_GENERATION", "4")
    name = new.save(105, state(105), samples_done=960, world_size=4)
    write_progress(uri, Progress(samples_done=960, step=105, checkpoint=name, status="running"))
    assert new.names() == ["ckpt-000000105"] == [read_progress(uri).checkpoint]
    loaded = new.load_latest()
    assert loaded.name == name and loaded.state["step"] == 105 and loaded.skipped == ()
    assert manifest_of(tmp_path / "checkpoints" / name)["generation"] == "4"


def test_the_resume_takes_the_checkpoint_with_the_most_samples_done_whatever_its_step(tmp_path):
    """Ties go to the higher step; a corrupt best one gives way to the next by samples done, not by step."""
    store = CheckpointStore(str(tmp_path), keep=4)
    store.save(110, state(110), samples_done=880)
    store.save(105, state(105), samples_done=960)
    store.save(30, state(30), samples_done=960)
    store.save(90, state(90), samples_done=720)
    assert store.load_latest().name == "ckpt-000000105"
    flip_a_byte(tmp_path / "checkpoints" / "ckpt-000000105")
    loaded = store.load_latest()
    assert loaded.name == "ckpt-000000030" and [why.split(":")[0] for why in loaded.skipped] == ["ckpt-000000105"]
    assert "generation" not in manifest_of(tmp_path / "checkpoints" / "ckpt-000000030")  # none in the environment


def test_a_save_behind_a_stale_generations_better_checkpoint_is_kept_beside_it_until_the_next_save(tmp_path):
    """The stale writer's checkpoint has more samples: it is the one to resume, and the new generation's own
    (which its progress.json names) stays until its next save rather than point progress.json at nothing."""
    messages: list[str] = []
    store = CheckpointStore(str(tmp_path), keep=1, log=messages.append)
    store.save(110, state(110), samples_done=3520, world_size=4)  # the stale generation's
    store.save(101, state(101), samples_done=3208, world_size=1)
    assert store.names() == ["ckpt-000000110", "ckpt-000000101"]
    assert store.load_latest().name == "ckpt-000000110"
    store.save(102, state(102), samples_done=3216, world_size=1)
    assert store.names() == ["ckpt-000000110", "ckpt-000000102"]
    assert messages == ["checkpoint ckpt-000000101 removed: ranked below the 1 valid checkpoints with the most samples done"]
