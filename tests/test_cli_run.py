"""``spotsched run``: the driver on the command line, a real local run to its end, no Airflow.

The workers are tests/fake_worker.py (the runtime's contract in milliseconds) on the replayed
GCP trace; a second call with the same job re-attaches to the run's state instead of launching.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import sys
from pathlib import Path

import pytest

from airflow_provider_spotsched import GCP_TRACE
from airflow_provider_spotsched.backends.local_processes import marked
from airflow_provider_spotsched.cli import main
from airflow_provider_spotsched.execution.driver import RunDriver
from airflow_provider_spotsched.scheduling.selector import SelectorPolicy

FAKE_WORKER = Path(__file__).with_name("fake_worker.py")
MARKET_START = "2025-10-11T03:10:00Z"


def write_job(tmp_path: Path) -> Path:
    job = tmp_path / "small-job.json"
    job.write_text(json.dumps({"work": 160, "deadline_hours": 6, "max_instances": 2, "throughput": {"alpha": 60, "beta": 0},
                               "value": 100, "hard_deadline_factor": 1.5, "reconfig_overhead_hours": 0.2}))
    return job


def run_args(tmp_path: Path, job: Path, *extra: str) -> list[str]:
    worker = tmp_path / "worker.json"
    worker.write_text(json.dumps({"samples": 160, "step_s": 0.05}))
    command = f"{sys.executable} {FAKE_WORKER} --config {worker} --checkpoint-uri {tmp_path / 'checkpoint'}"
    return ["run", "--job", str(job), "--command", command, "--checkpoint-uri", str(tmp_path / "checkpoint"),
            "--workdir", str(tmp_path / "work"), "--seconds-per-slot", "2", "--market-start", MARKET_START,
            "--pools", "us-east4-a,europe-west1-c", *extra]


def with_flag(args: list[str], flag: str, value: str) -> list[str]:
    """``args`` with ``flag``'s value replaced."""
    args = list(args)
    args[args.index(flag) + 1] = value
    return args


def test_run_drives_a_job_to_its_end_and_a_rerun_re_attaches(tmp_path, capsys):
    job = write_job(tmp_path)
    out = tmp_path / "result.json"
    assert main(run_args(tmp_path, job, "--policy", "uniform-progress", "--out", str(out))) == 0
    printed = capsys.readouterr().out
    result = json.loads(out.read_text())
    assert result["deadline_met"] and result["completion_hours"] is not None
    assert [r["slot"] for r in result["decision_log"]] == list(range(result["slots"]))
    assert "slot 0:" in printed and "deadline met" in printed
    assert (tmp_path / "work" / "runs" / "small-job.json").exists(), "the run's state is kept for a rerun"
    assert not marked(str(tmp_path / "work" / "jobs" / "small-job"))

    assert main(run_args(tmp_path, job, "--policy", "uniform-progress", "--out", str(out))) == 0
    again = capsys.readouterr().out
    assert "re-attaching to job small-job" in again
    assert json.loads(out.read_text())["cost"] == result["cost"], "a finished run is not run or billed again"


def test_the_selector_learns_across_runs_in_its_state_file(tmp_path, capsys):
    job = write_job(tmp_path)
    assert main(run_args(tmp_path, job, "--job-id", "first")) == 0
    state = json.loads((tmp_path / "work" / "selector.json").read_text())
    assert state["runs"] == ["first"] and state["last_round"]["job_id"] == "first"


def test_bad_input_is_one_line_and_exit_2(tmp_path, capsys):
    job = write_job(tmp_path)
    assert main(run_args(tmp_path, job, "--pools", "nowhere-1a")) == 2
    err = capsys.readouterr().err
    assert err.startswith("spotsched run: error: unknown pool(s) ['nowhere-1a']") and len(err.strip().splitlines()) == 1
    assert not (tmp_path / "work" / "runs").exists(), "nothing was started"


def test_a_workdir_that_is_a_file_is_one_line_and_exit_2(tmp_path, capsys):
    (tmp_path / "work").write_text("")  # run_args' --workdir
    assert main(run_args(tmp_path, write_job(tmp_path))) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"spotsched run: error: --workdir {tmp_path / 'work'}: cannot be a directory (File exists)")
    assert len(err.strip().splitlines()) == 1


CHEAP_SELECTOR = ["--param", 'pool=[{"policy": "greedy"}, {"policy": "uniform-progress"}]', "--param", "warm_up_rounds=0"]


@pytest.mark.parametrize("text", ["selector: {oops", "null", "[]", "false", "{}"])
def test_a_selector_state_file_that_holds_no_selector_state_is_refused_and_kept(tmp_path, capsys, text):
    state = tmp_path / "learnt.json"
    state.write_text(text)
    assert main(run_args(tmp_path, write_job(tmp_path), "--selector-state", str(state), *CHEAP_SELECTOR)) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"spotsched run: error: file {state} holds no valid selector state: ")
    assert f"delete file {state} to start learning afresh" in err and len(err.strip().splitlines()) == 1
    assert state.read_text() == text
    assert not (tmp_path / "work" / "runs").exists(), "nothing was started"


def test_selector_params_other_than_the_stored_selectors_are_refused(tmp_path, capsys):
    state = tmp_path / "work" / "selector.json"
    state.parent.mkdir()
    stored = SelectorPolicy(pool=[{"policy": "greedy"}, {"policy": "uniform-progress"}], warm_up_rounds=0).to_state()
    state.write_text(json.dumps({"selector": stored, "runs": []}))
    args = run_args(tmp_path, write_job(tmp_path), *CHEAP_SELECTOR, "--param", "algorithm=exp3", "--param", "seed=7")
    assert main(args) == 2
    err = capsys.readouterr().err
    assert "algorithm: stored 'hedge', asked 'exp3'; seed: stored 0, asked 7" in err and "drop policy_params" in err
    assert not (tmp_path / "work" / "runs").exists(), "nothing was started"


def test_a_selector_state_file_damaged_during_the_run_is_kept_and_a_rerun_closes_the_round(tmp_path, capsys, monkeypatch):
    state = tmp_path / "work" / "selector.json"
    finish = RunDriver.run_to_completion

    def damaged_meanwhile(self, *args, **kwargs):
        run = finish(self, *args, **kwargs)
        state.write_text("[]")
        return run

    monkeypatch.setattr(RunDriver, "run_to_completion", damaged_meanwhile)
    args = run_args(tmp_path, write_job(tmp_path), "--job-id", "late", *CHEAP_SELECTOR)
    assert main(args) == 2
    out, err = capsys.readouterr()
    assert f"selector: {state} does not exist yet; starting a fresh selector" in out
    assert err.startswith(f"spotsched run: error: file {state} holds no valid selector state: it holds []")
    assert "The round of run late was not stored" in err and state.read_text() == "[]"

    monkeypatch.setattr(RunDriver, "run_to_completion", finish)
    state.unlink()  # the fix chosen: learn afresh
    assert main(args) == 0
    assert "re-attaching to job late" in capsys.readouterr().out
    assert json.loads(state.read_text())["runs"] == ["late"]


def test_a_damaged_run_state_is_one_line_and_exit_2_not_a_traceback(tmp_path, capsys):
    job = write_job(tmp_path)
    runs = tmp_path / "work" / "runs"
    runs.mkdir(parents=True)
    for damaged in ("{not json", '{"run": {}}', "[]"):
        (runs / "small-job.json").write_text(damaged)
        assert main(run_args(tmp_path, job, "--policy", "uniform-progress")) == 2
        err = capsys.readouterr().err.strip()
        assert err.startswith("spotsched run: error: ") and "small-job.json" in err and len(err.splitlines()) == 1
    assert not (tmp_path / "work" / "jobs").exists(), "nothing was launched"


def test_a_rerun_with_other_flags_than_the_stored_runs_is_refused_before_anything_runs(tmp_path, capsys):
    job = write_job(tmp_path)
    assert main(run_args(tmp_path, job, "--policy", "uniform-progress")) == 0
    state_file = tmp_path / "work" / "runs" / "small-job.json"
    stored = state_file.read_text()
    capsys.readouterr()
    edited = tmp_path / "edited" / "small-job.json"  # the same job id, one field changed
    edited.parent.mkdir()
    edited.write_text(json.dumps({**json.loads(job.read_text()), "work": 120}))
    cases = [
        (run_args(tmp_path, job, "--policy", "uniform-progress", "--market-start", "2025-10-12T03:10:00Z"),
         "--market-start: stored 2025-10-11T03:10:00Z, given 2025-10-12T03:10:00Z", "give --market-start 2025-10-11T03:10:00Z"),
        (run_args(tmp_path, job, "--policy", "greedy", "--param", "window=3"),
         "--policy: stored uniform-progress, given greedy; --param: stored none, given --param window=3",
         "give --policy uniform-progress no --param"),
        (with_flag(run_args(tmp_path, job, "--policy", "uniform-progress"), "--command", "other"),
         "given other", "give --command "),
        (run_args(tmp_path, edited, "--policy", "uniform-progress"), "--job: stored work=160, given work=120",
         "give a --job file with work=160"),
    ]
    for args, what, fix in cases:
        assert main(args) == 2
        err = capsys.readouterr().err
        assert err.startswith("spotsched run: error: the stored run small-job was started with other flags (") and what in err
        assert f"{fix}" in err and f"or remove {state_file} to start a new run" in err and len(err.strip().splitlines()) == 1
    assert state_file.read_text() == stored, "nothing was decided or stored"

    legacy = json.loads(stored)
    del legacy["flags"]  # a run stored before the flags were: it re-attaches as it always did
    state_file.write_text(json.dumps(legacy))
    assert main(run_args(tmp_path, job, "--policy", "greedy")) == 0
    assert "re-attaching to job small-job" in capsys.readouterr().out
    assert "flags" not in json.loads(state_file.read_text())


def test_a_checkpoint_uri_that_is_a_file_is_one_line_and_exit_2(tmp_path, capsys):
    (tmp_path / "checkpoint").write_text("")  # run_args' --checkpoint-uri
    assert main(run_args(tmp_path, write_job(tmp_path))) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"spotsched run: error: --checkpoint-uri {tmp_path / 'checkpoint'}: is a file; give a directory")
    assert len(err.strip().splitlines()) == 1
    assert not (tmp_path / "work" / "runs").exists(), "nothing was started"


def test_a_training_command_that_cannot_start_is_one_error_line_and_exit_1(tmp_path, capsys):
    args = with_flag(run_args(tmp_path, write_job(tmp_path), "--policy", "greedy"), "--command", str(tmp_path / "no-such-program"))
    assert main(args) == 1
    err = capsys.readouterr().err
    last = err.strip().splitlines()[-1]
    assert last.startswith("spotsched run: error: training of small-job failed: ") and "no-such-program" in last
    assert f"fix the training command and remove {tmp_path / 'work' / 'runs' / 'small-job.json'}" in last
    assert "Traceback" not in err


def test_a_rerun_compares_paths_by_the_file_they_name_not_as_typed(tmp_path, capsys, monkeypatch):
    job = write_job(tmp_path)
    shutil.copy(GCP_TRACE, tmp_path / GCP_TRACE.name)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    shutil.copy(GCP_TRACE, elsewhere / GCP_TRACE.name)  # the same name, another file
    monkeypatch.chdir(tmp_path)
    args = run_args(tmp_path, job, "--policy", "uniform-progress", "--trace", GCP_TRACE.name)
    assert main(with_flag(args, "--checkpoint-uri", "./checkpoint")) == 0
    state_file = tmp_path / "work" / "runs" / "small-job.json"
    stored = json.loads(state_file.read_text())
    assert stored["flags"]["--trace"] == str(tmp_path / GCP_TRACE.name)
    assert stored["flags"]["--checkpoint-uri"] == str(tmp_path / "checkpoint")
    assert stored["job"]["checkpoint_uri"] == str(tmp_path / "checkpoint"), "a relaunch from elsewhere finds the checkpoints"
    capsys.readouterr()

    monkeypatch.chdir(elsewhere)  # the same files, named from another directory: the same run
    same = with_flag(with_flag(args, "--trace", str(tmp_path / GCP_TRACE.name)), "--checkpoint-uri", "../checkpoint")
    assert main(same) == 0
    assert "re-attaching to job small-job" in capsys.readouterr().out
    assert main(with_flag(same, "--checkpoint-uri", f"file://{tmp_path / 'checkpoint'}")) == 0  # a file:// URI of it too
    assert "re-attaching to job small-job" in capsys.readouterr().out

    assert main(with_flag(args, "--checkpoint-uri", "../checkpoint")) == 2  # --trace now names elsewhere's copy
    err = capsys.readouterr().err
    assert f"--trace: stored {tmp_path / GCP_TRACE.name}, given {elsewhere / GCP_TRACE.name}" in err
    assert f"give --trace {tmp_path / GCP_TRACE.name}, or remove {state_file}" in err and len(err.strip().splitlines()) == 1

    legacy = json.loads(state_file.read_text())  # stored before paths were resolved: as typed, read from here
    legacy["flags"]["--trace"] = GCP_TRACE.name
    state_file.write_text(json.dumps(legacy))
    assert main(with_flag(args, "--checkpoint-uri", "../checkpoint")) == 0


def test_a_rerun_compares_the_command_by_the_arguments_it_runs_not_as_typed(tmp_path, capsys):
    """The workers run shlex.split(--command): other spacing or quoting of the same arguments is the same run."""
    job = write_job(tmp_path)
    args = run_args(tmp_path, job, "--policy", "uniform-progress")
    assert main(args) == 0
    capsys.readouterr()
    command = args[args.index("--command") + 1]
    program, rest = command.split(" ", 1)
    retyped = f"'{program}'   " + rest.replace(" --config ", ' "--config" ')
    assert main(with_flag(args, "--command", retyped)) == 0, capsys.readouterr().err
    assert "re-attaching to job small-job" in capsys.readouterr().out

    state_file = tmp_path / "work" / "runs" / "small-job.json"
    stored = state_file.read_text()
    joined = command.replace(" --config ", " '--config x' ")  # one argument where the run has two
    assert main(with_flag(args, "--command", joined)) == 2
    err = capsys.readouterr().err
    assert f"--command: stored {command}, given {joined}" in err and f"give --command '{command}'" in err
    assert len(err.strip().splitlines()) == 1
    assert main(with_flag(args, "--command", command + " 'unclosed")) == 2
    err = capsys.readouterr().err
    assert err == (f"spotsched run: error: --command {command} 'unclosed: cannot be split into arguments "
                   "(No closing quotation); close its quotes\n")
    assert state_file.read_text() == stored, "nothing was decided or stored"


def test_a_rerun_whose_training_config_file_was_edited_is_refused(tmp_path, capsys):
    job = write_job(tmp_path)
    args = run_args(tmp_path, job, "--policy", "uniform-progress")
    assert main(args) == 0
    capsys.readouterr()
    config = tmp_path / "train-config.json"
    config.write_text('{"steps": 10}')
    state_file = tmp_path / "work" / "runs" / "small-job.json"
    state = json.loads(state_file.read_text())  # as if the run had been started with --training-config
    state["flags"].update({"--command": None, "--training-config": str(config),
                           "--training-config content": hashlib.sha256(config.read_bytes()).hexdigest()})
    state_file.write_text(json.dumps(state))
    with_config = args[:args.index("--command")] + ["--training-config", str(config)] + args[args.index("--command") + 2:]
    assert main(with_config) == 0, "the same content re-attaches"
    assert "re-attaching to job small-job" in capsys.readouterr().out

    config.write_text('{"steps": 20}')
    assert main(with_config) == 2
    err = capsys.readouterr().err
    stored, given = (hashlib.sha256(text.encode()).hexdigest()[:12] for text in ('{"steps": 10}', '{"steps": 20}'))
    assert err.startswith("spotsched run: error: the stored run small-job was started with other flags (")
    assert f"--training-config content: stored sha256 {stored}, given sha256 {given}" in err
    assert f"give the --training-config file as it was when the run started (sha256 {stored}), or remove {state_file}" in err
    assert len(err.strip().splitlines()) == 1

    config.unlink()  # a temporary config, removed since: the run goes on with its own copy
    assert main(with_config) == 0, capsys.readouterr().err

    config.write_text('{"steps": 20}')
    del state["flags"]["--training-config content"]  # a run stored before the digest was: re-attaches unchecked
    state_file.write_text(json.dumps(state))
    assert main(with_config) == 0
    assert "--training-config content" not in json.loads(state_file.read_text())["flags"]


def test_ctrl_c_is_one_line_that_says_what_the_run_was_left_in_and_exit_130(tmp_path, capsys, monkeypatch):
    job = write_job(tmp_path)
    args = run_args(tmp_path, job, "--policy", "uniform-progress")
    state_file = tmp_path / "work" / "runs" / "small-job.json"

    def interrupt(*args, **kwargs):
        raise KeyboardInterrupt

    with monkeypatch.context() as patched:  # before the first step stored anything
        patched.setattr(RunDriver, "step", interrupt)
        assert main(args) == 130
    err = capsys.readouterr().err
    assert err == "spotsched run: interrupted; nothing of job small-job was launched or stored; run the same command again to start it\n"

    with monkeypatch.context() as patched:  # Ctrl-C while the first slot's workers run
        patched.setattr("airflow_provider_spotsched.execution.driver.wait_for_wake", interrupt)
        assert main(args) == 130
    err = capsys.readouterr().err
    assert err.startswith("spotsched run: interrupted; every instance of job small-job was released (its checkpoints stay)")
    assert f"run the same command again to resume it from the last checkpoint, or remove {state_file} to drop it" in err
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err
    assert not marked(str(tmp_path / "work" / "jobs" / "small-job")), "no worker left running"
    assert json.loads(state_file.read_text())["run"]["records"], "the run is kept"

    assert main(args) == 0
    assert "re-attaching to job small-job" in capsys.readouterr().out
