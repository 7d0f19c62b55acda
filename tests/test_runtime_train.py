"""The training runtime end to end, in-process and with forked gloo workers: loss, resume, elasticity, guard."""

from __future__ import annotations

import json
import os
import shutil
import signal

import pytest

from airflow_provider_spotsched.runtime.checkpoint import CheckpointStore
from tests.runtime_support import (
    TINY_JOB,
    environment,
    late_sigterm_ignored,
    run_forked_workers,
    run_inline,
    step_losses,
    when_progress,
    write_config,
)


@pytest.fixture(scope="module", autouse=True)
def model_cache(tmp_path_factory):
    with environment(SPOTSCHED_CACHE_DIR=str(tmp_path_factory.mktemp("model-cache"))):
        yield


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    """One uninterrupted run of TINY_JOB: (exit code, events, checkpoint URI)."""
    directory = tmp_path_factory.mktemp("uninterrupted")
    code, events = run_inline(write_config(directory), directory / "ckpt")
    return code, events, directory / "ckpt"


def test_a_short_run_lowers_the_loss_and_leaves_progress_and_the_final_adapter(uninterrupted):
    code, events, uri = uninterrupted
    assert code == 0
    losses = list(step_losses(events).values())
    assert len(losses) == TINY_JOB["samples"] // TINY_JOB["global_batch_size"]
    assert sum(losses[-4:]) / 4 < sum(losses[:4]) / 4 - 0.2
    progress = json.loads((uri / "progress.json").read_text())
    assert progress["samples_done"] == progress["samples_total"] == TINY_JOB["samples"]
    assert progress["status"] == "done" and progress["world_size"] == 1
    assert progress["checkpoint"] == f"ckpt-{len(losses):09d}"
    assert (uri / "final" / "adapter_model.safetensors").is_file()
    assert json.loads((uri / "final" / "adapter_config.json").read_text())["r"] == 8
    done = events[-1]
    assert done["event"] == "done" and done["samples_done"] == TINY_JOB["samples"]
    assert all(e["samples_per_second"] > 0 for e in events if e["event"] == "step")


def test_a_finished_job_restarted_exits_0_without_training_again(uninterrupted, tmp_path):
    _, _, uri = uninterrupted
    code, events = run_inline(write_config(tmp_path), uri)
    assert code == 0
    assert [e["event"] for e in events] == ["resumed", "done"]


def test_a_restart_whose_two_newest_checkpoints_are_corrupt_resumes_from_the_last_valid_one(
        uninterrupted, tmp_path, capsys):
    """Start (clean, load), then saves that prune: the bad checkpoints are reported, skipped and replaced."""
    _, reference_events, _ = uninterrupted
    config = write_config(tmp_path, checkpoint={"keep": 3, "min_interval_s": 0, "max_interval_s": 0.001})
    uri = tmp_path / "ckpt"
    assert run_inline(config, uri)[0] == 0  # a checkpoint before every step: the last three are 18, 19, 20
    newest, second, third = sorted((p.name for p in (uri / "checkpoints").iterdir()), reverse=True)
    (uri / "checkpoints" / newest / "manifest.json").write_text("{}")
    (uri / "checkpoints" / second / "state.pt").write_bytes(b"")
    code, events = run_inline(config, uri)
    assert code == 0
    resumed = events[0]
    assert resumed["event"] == "resumed" and resumed["checkpoint"] == third
    bad = ((newest, "malformed manifest (no payload, bytes, sha256)"), (second, "checksum mismatch (0 bytes read"))
    assert len(resumed["skipped"]) == 2
    assert all(why.startswith(f"{name}: {reason}") for why, (name, reason) in zip(resumed["skipped"], bad))
    stderr = capsys.readouterr().err
    for name, reason in bad:
        assert f"spotsched-train: checkpoint {name} skipped: {reason}" in stderr
    # the first save rewrites step 19's checkpoint whole, and its prune removes the corrupt step 20
    assert f"spotsched-train: checkpoint {newest} removed: {bad[0][1]}" in stderr
    reference = step_losses(reference_events)
    assert step_losses(events) == {step: loss for step, loss in reference.items() if step > resumed["step"]}
    assert events[-1]["event"] == "done"
    assert CheckpointStore(str(uri)).load_latest().name == newest  # saved again by the resumed run


def test_sigterm_stops_with_an_emergency_checkpoint_and_resume_repeats_the_same_losses(uninterrupted, tmp_path):
    _, reference_events, _ = uninterrupted
    reference = step_losses(reference_events)
    config, uri = write_config(tmp_path), tmp_path / "ckpt"
    with late_sigterm_ignored():
        when_progress(uri, lambda p: p["step"] >= 7, lambda: os.kill(os.getpid(), signal.SIGTERM))
        code, first = run_inline(config, uri)
    assert code == 75
    preempted = first[-1]
    assert preempted["event"] == "preempted" and preempted["reason"] == "sigterm"
    last_step = max(step_losses(first))
    # nothing but the step in progress is lost: the emergency checkpoint is the last completed step
    assert preempted["step"] == last_step and preempted["samples_done"] == last_step * TINY_JOB["global_batch_size"]
    assert preempted["discarded_samples"] <= TINY_JOB["global_batch_size"]

    code, second = run_inline(config, uri)
    assert code == 0
    resumed = second[0]
    assert resumed["event"] == "resumed" and resumed["checkpoint"] == preempted["checkpoint"]
    assert resumed["samples_done"] == preempted["samples_done"]
    # the checkpoint's load was timed, and inside this process's run (done's elapsed_s counts from its start)
    assert second[-1]["event"] == "done" and 0 < resumed["load_s"] <= second[-1]["elapsed_s"]
    assert resumed["rendezvous_s"] == 0
    combined = {**step_losses(first), **step_losses(second)}
    assert combined == reference  # bitwise: same data, same optimizer state, same RNG
    # the scheduler measures the slot that restarted the job from here: when and from what it resumed
    progress = json.loads((uri / "progress.json").read_text())
    assert progress["resumed_samples"] == preempted["samples_done"]
    assert progress["resumed"] <= progress["checkpointed"] <= progress["updated"]


def test_world_size_1_2_1_resumes_at_the_same_sample_and_follows_the_same_curve(uninterrupted, tmp_path):
    _, reference_events, _ = uninterrupted
    reference = step_losses(reference_events)
    # paced (losses are unchanged by pacing) so that a fast machine cannot finish a stage before its
    # notice, which the runtime polls about once a second
    config, uri = write_config(tmp_path, samples_per_second_per_worker=16.0), tmp_path / "ckpt"
    notice1, notice2 = tmp_path / "notice-1", tmp_path / "notice-2"

    when_progress(uri, lambda p: p["samples_done"] >= 24, notice1.touch)
    code, stage1 = run_inline(config, uri, SPOTSCHED_NOTICE=f"file://{notice1}")
    assert code == 75 and stage1[-1]["reason"].startswith("notice: notice file")
    stopped_at = stage1[-1]["samples_done"]

    when_progress(uri, lambda p: p["samples_done"] >= stopped_at + 24, notice2.touch)
    (code0, stage2), (code1, rank1_events) = run_forked_workers(config, uri, 2, tmp_path,
                                                                 SPOTSCHED_NOTICE=f"file://{notice2}")
    assert (code0, code1) == (75, 75) and rank1_events == []  # only the leader prints
    resumed = stage2[0]
    assert resumed["event"] == "resumed" and resumed["world_size"] == 2
    assert resumed["samples_done"] == stopped_at and resumed["rendezvous_s"] > 0
    steps2 = [e for e in stage2 if e["event"] == "step"]
    assert all(e["samples_done"] - stopped_at == 8 * (e["step"] - resumed["step"]) for e in steps2)
    stopped_again = stage2[-1]["samples_done"]

    code, stage3 = run_inline(config, uri)
    assert code == 0
    assert stage3[0]["samples_done"] == stopped_again and stage3[0]["world_size"] == 1
    assert stage3[-1]["samples_done"] == TINY_JOB["samples"]
    # a fixed global batch makes every step the same whatever the world size: the curve is the
    # uninterrupted one, bit for bit at world size 1 and up to float summation order at 2
    combined = {**step_losses(stage1), **step_losses(stage2), **step_losses(stage3)}
    assert combined.keys() == reference.keys()
    assert {s: loss for s, loss in combined.items() if s <= stage1[-1]["step"]} == {
        s: loss for s, loss in reference.items() if s <= stage1[-1]["step"]}
    assert max(abs(combined[s] - reference[s]) for s in reference) < 1e-4


def test_a_resumed_run_never_writes_the_checkpoint_it_resumed_from_again(tmp_path):
    """With the interval from a preemption forecast and no save timed yet, a save is due at once on
    resume; writing the step just loaded again would put the only checkpoint (keep 1) at risk for nothing."""
    config, uri = write_config(tmp_path, checkpoint={"keep": 1, "min_interval_s": 0, "mtbp_hours": 1}), tmp_path / "ckpt"
    with late_sigterm_ignored():
        when_progress(uri, lambda p: p["step"] >= 5, lambda: os.kill(os.getpid(), signal.SIGTERM))
        code, _ = run_inline(config, uri)
    assert code == 75
    code, second = run_inline(config, uri)
    resumed, saved = second[0], [e["step"] for e in second if e["event"] == "checkpoint"]
    assert code == 0 and resumed["event"] == "resumed"
    assert saved and resumed["step"] not in saved and saved[0] == resumed["step"] + 1


def test_when_a_worker_vanishes_the_leader_saves_the_last_completed_step(tmp_path, capsys):
    config, uri = write_config(tmp_path), tmp_path / "ckpt"

    def kill_rank_1(pids: list[int]) -> None:
        when_progress(uri, lambda p: p["step"] >= 3, lambda: os.kill(pids[1], signal.SIGKILL))

    (code0, events), (code1, _) = run_forked_workers(config, uri, 2, tmp_path, on_start=kill_rank_1)
    assert (code0, code1) == (75, -signal.SIGKILL)
    preempted = events[-1]
    assert preempted["event"] == "preempted" and preempted["reason"].startswith("peer lost: ")
    assert preempted["step"] == max(step_losses(events)) and preempted["checkpoint"] == f"ckpt-{preempted['step']:09d}"

    code, resumed = run_inline(config, uri)
    assert code == 0 and resumed[0]["samples_done"] == preempted["samples_done"]


def test_a_nan_loss_rolls_back_to_the_last_checkpoint_with_a_lower_learning_rate(tmp_path):
    config = write_config(tmp_path, fault_injection={"nan_loss_at_steps": [5]})
    code, events = run_inline(config, tmp_path / "ckpt")
    assert code == 0
    (rollback,) = [e for e in events if e["event"] == "rollback"]
    assert rollback["bad_step"] == 5 and rollback["reason"] == "loss is nan"
    assert rollback["lr_scale"] == 0.5 and rollback["step"] < 5
    assert rollback["checkpoint"] == f"ckpt-{rollback['step']:09d}"
    assert all(e["loss"] == e["loss"] for e in events if e["event"] == "step")  # no NaN was applied
    assert events[-1]["event"] == "done" and events[-1]["rollbacks"] == 1


def test_divergence_beyond_the_allowed_rollbacks_fails_clearly(tmp_path, capsys):
    config = write_config(tmp_path, fault_injection={"nan_loss_at_steps": [3]}, guard={"max_rollbacks": 0})
    code, events = run_inline(config, tmp_path / "ckpt")
    assert code == 1
    assert "training diverged (loss is nan) after 0 rollback(s)" in capsys.readouterr().err
    assert not (tmp_path / "ckpt" / "final").exists()


def test_progress_counts_only_checkpointed_samples_while_steps_run_on(tmp_path):
    # checkpoints a minute apart: steps go on from the initial checkpoint, and progress.json (what the
    # scheduler plans on, and reads as the job's end when it reaches the total) must stay at its samples
    config = write_config(tmp_path, checkpoint={"keep": 3, "min_interval_s": 60.0, "max_interval_s": 120.0},
                          samples_per_second_per_worker=16.0)
    uri, seen = tmp_path / "ckpt", []
    with late_sigterm_ignored():
        when_progress(uri, lambda p: p["step"] >= 4 and not seen.append(p), lambda: os.kill(os.getpid(), signal.SIGTERM))
        code, events = run_inline(config, uri)
    assert code == 75 and seen
    assert seen[0]["samples_done"] == 0 and seen[0]["checkpoint"] == "ckpt-000000000"  # 32 samples run, none stored
    # the stamp of the work stays at its checkpoint while the report's own moves on
    assert seen[0]["checkpointed"] <= seen[0]["resumed"] < seen[0]["updated"] and seen[0]["resumed_samples"] == 0
    stored = [e for e in events if e["event"] == "checkpoint"]
    assert json.loads((uri / "progress.json").read_text())["samples_done"] == stored[-1]["samples_done"]


def test_a_seq_len_beyond_the_models_context_exits_2_before_training(tmp_path, capsys):
    config, uri = write_config(tmp_path, seq_len=300), tmp_path / "ckpt"  # the builtin model has 256 positions
    code, events = run_inline(config, uri)
    assert code == 2 and not [e for e in events if e["event"] in ("step", "checkpoint")]
    assert "seq_len=300 exceeds the model's context of 256 positions" in capsys.readouterr().err


def test_a_resume_under_another_seq_len_exits_2_and_keeps_the_checkpoint(uninterrupted, tmp_path, capsys):
    uri = tmp_path / "ckpt"
    shutil.copytree(uninterrupted[2], uri)
    stored = {path: path.read_bytes() for path in (uri / "checkpoints").rglob("*") if path.is_file()}
    code, events = run_inline(write_config(tmp_path, seq_len=16), uri)  # other chunks: a position names other samples
    assert code == 2 and not [e for e in events if e["event"] in ("resumed", "step", "checkpoint")]
    assert (f"the checkpoint of step 20 under {uri} was made with seq_len=32, and this config has seq_len=16: "
            "its position (samples consumed) would continue over other samples. Restore seq_len=32") in capsys.readouterr().err
    assert {path: path.read_bytes() for path in (uri / "checkpoints").rglob("*") if path.is_file()} == stored


def test_a_resume_under_another_global_batch_goes_on_from_the_checkpoints_samples(tmp_path):
    """The loop's position is samples_done (its data and its learning-rate schedule alike), not a step count:
    a resume with another step batch continues at the sample after the checkpoint's, and progress counts true."""
    checkpoints = {"keep": 3, "min_interval_s": 0, "max_interval_s": 0.001}  # one before every step: 18, 19, 20 kept
    uri = tmp_path / "ckpt"
    assert run_inline(write_config(tmp_path, checkpoint=checkpoints), uri)[0] == 0
    for name in ("ckpt-000000019", "ckpt-000000020"):
        shutil.rmtree(uri / "checkpoints" / name)
    code, events = run_inline(write_config(tmp_path, checkpoint=checkpoints, global_batch_size=4, micro_batch_size=2), uri)
    assert code == 0 and events[0]["event"] == "resumed" and events[0]["samples_done"] == 18 * 8
    steps = [(e["step"], e["samples_done"]) for e in events if e["event"] == "step"]
    assert steps == [(19, 148), (20, 152), (21, 156), (22, 160)]  # the 16 samples left, 4 a step
    assert events[-1]["samples_done"] == 160 and json.loads((uri / "progress.json").read_text())["samples_done"] == 160


@pytest.mark.parametrize("dataset, message", [
    ("missing.txt", "is neither a builtin dataset nor an existing text file: give the path of a UTF-8 text file"),
    ("short.txt", "has 7 tokens, fewer than one sample of seq_len=32: give seq_len <= 7 or a longer dataset"),
    ("latin1.txt", "is not UTF-8 text"),
])
def test_a_dataset_that_cannot_give_one_sample_exits_2_naming_it_before_training(tmp_path, capsys, dataset, message):
    (tmp_path / "short.txt").write_text("one two three")  # 7 tokens of the builtin tokenizer
    (tmp_path / "latin1.txt").write_bytes("caf\u00e9 au lait".encode("latin-1"))
    path = str(tmp_path / dataset)
    code, events = run_inline(write_config(tmp_path, dataset=path), tmp_path / "ckpt")
    assert code == 2 and not [e for e in events if e["event"] in ("started", "step", "checkpoint")]
    assert f"spotsched-train: dataset {path!r} {message}" in capsys.readouterr().err


@pytest.mark.parametrize("lora, message", [
    ({"r": 4}, "was made with lora.r=8, and this config has lora.r=4: its adapter's LoRA layers do not fit this "
               "config's. Restore lora.r=8"),
    ({"target_modules": ["c_attn"]}, "was made with lora.target_modules=None, and this config has "
                                     "lora.target_modules=['c_attn']"),
])
def test_a_resume_under_other_lora_layers_exits_2_naming_the_field_and_keeps_the_checkpoint(
        uninterrupted, tmp_path, capsys, lora, message):
    uri = tmp_path / "ckpt"
    shutil.copytree(uninterrupted[2], uri)
    stored = {path: path.read_bytes() for path in (uri / "checkpoints").rglob("*") if path.is_file()}
    code, events = run_inline(write_config(tmp_path, lora=lora), uri)
    assert code == 2 and not [e for e in events if e["event"] in ("resumed", "step", "checkpoint")]
    assert f"the checkpoint of step 20 under {uri} {message}" in capsys.readouterr().err
    assert {path: path.read_bytes() for path in (uri / "checkpoints").rglob("*") if path.is_file()} == stored


def test_a_checkpoint_made_before_the_lora_fields_were_recorded_is_still_refused_other_layers(
        uninterrupted, tmp_path, capsys):
    loaded = CheckpointStore(str(uninterrupted[2])).load_latest()
    state = {key: value for key, value in loaded.state.items() if not key.startswith("lora.")}
    uri = tmp_path / "ckpt"
    CheckpointStore(str(uri)).save(state["step"], state, samples_done=state["samples_done"], world_size=1, kind="final")
    code, _ = run_inline(write_config(tmp_path, lora={"r": 4}), uri)
    assert code == 2
    assert (f"the checkpoint of step 20 under {uri} has other LoRA layers than this config makes: restore the lora.r "
            "and lora.target_modules it was made with") in capsys.readouterr().err
