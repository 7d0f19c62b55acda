"""``python -m airflow_provider_spotsched.runtime --config CONFIG.json --checkpoint-uri URI``.

One process per instance; the config's ``runtime`` picks the trainer (``hf``, the default:
:mod:`.hf_runtime`; ``loop``: :mod:`.train`). Exit codes (the contract with the backends,
:mod:`.contract`): 0 the work is done and the final adapter is under ``URI/final/``; 75 stopped by
SIGTERM or a preemption notice after an emergency checkpoint (restart to resume); 2 bad arguments
or config; 1 any other failure. Every failure prints its reason on stderr.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence
from typing import TYPE_CHECKING

from airflow_provider_spotsched.runtime.contract import EXIT_FAILURE, EXIT_USAGE, PROGRESS_FILE

if TYPE_CHECKING:
    from airflow_provider_spotsched.runtime.config import TrainConfig
    from airflow_provider_spotsched.runtime.preemption import NoticeSource, StopFlag

NOTICE_POLL_S = 1.0


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="spotsched-train", description=__doc__.splitlines()[0])
    parser.add_argument("--config", required=True, help="path to CONFIG.json (see docs/runtime.md)")
    parser.add_argument("--checkpoint-uri", required=True,
                        help=f"where checkpoints, {PROGRESS_FILE} and the final adapter go: "
                             "a directory, s3:// or gs://")
    return parser.parse_args(argv)


def configure_threads(threads: int | None) -> None:
    """Few torch threads per CPU worker, so that several workers can share a machine's cores."""
    import torch

    if torch.cuda.is_available() and threads is None:
        return
    torch.set_num_threads(threads or int(os.environ.get("SPOTSCHED_THREADS") or 1))


def quiet_libraries() -> None:
    """No progress bars or advisory warnings in the JSON-lines stdout the backends parse."""
    import warnings

    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    import datasets

    datasets.disable_progress_bars()
    datasets.logging.set_verbosity_error()
    warnings.filterwarnings("ignore", category=FutureWarning)
    warnings.filterwarnings("ignore", category=UserWarning, module="peft")


def run_hf(config: TrainConfig, checkpoint_uri: str, stop: StopFlag, notice: NoticeSource | None) -> int:
    """The default runtime (:mod:`.hf_runtime`): SFTTrainer + LoRA under the spot contract."""
    from airflow_provider_spotsched.runtime.config import ConfigError
    from airflow_provider_spotsched.runtime.hf_runtime import check_launch, run

    try:
        check_launch(config, checkpoint_uri, os.environ)
    except ConfigError as error:
        print(f"spotsched-train: {error}", file=sys.stderr)
        return EXIT_USAGE
    try:
        return run(config, checkpoint_uri, stop, notice, NOTICE_POLL_S)
    except ConfigError as error:  # found only once the data or tokenizer is read (a missing dataset, no template)
        print(f"spotsched-train: {error}", file=sys.stderr, flush=True)
        return EXIT_USAGE
    except Exception as error:  # the contract: any failure is a non-0/75 code with its reason on stderr
        print(f"spotsched-train: failed: {type(error).__name__}: {error}", file=sys.stderr, flush=True)
        return EXIT_FAILURE


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    from airflow_provider_spotsched.runtime.config import ConfigError, TrainConfig
    from airflow_provider_spotsched.runtime.preemption import NoticeSource, NoticeWatcher, StopFlag, install_sigterm_handler

    stop = StopFlag()
    restore_sigterm = install_sigterm_handler(stop)  # first: a SIGTERM during start-up still counts
    try:
        try:
            config = TrainConfig.from_file(args.config)
            notice = NoticeSource.from_env(os.environ)
        except (ConfigError, ValueError) as error:
            print(f"spotsched-train: {error}", file=sys.stderr)
            return EXIT_USAGE
        configure_threads(config.threads)
        quiet_libraries()
        if config.runtime == "hf":
            return run_hf(config, args.checkpoint_uri, stop, notice)
        from airflow_provider_spotsched.runtime.distributed import join_workers
        from airflow_provider_spotsched.runtime.train import Trainer, warn

        watcher = NoticeWatcher(notice, stop, NOTICE_POLL_S, on_error=warn).start() if notice else None
        workers = None
        try:
            workers = join_workers()
            return Trainer(config, args.checkpoint_uri, workers, stop,
                           notice_window_s=notice.window_s if notice else None).run()
        except ConfigError as error:  # found once the model is read (a seq_len beyond its context)
            print(f"spotsched-train: {error}", file=sys.stderr, flush=True)
            return EXIT_USAGE
        except Exception as error:  # the contract: any failure is a non-0/75 code with its reason on stderr
            print(f"spotsched-train: failed: {type(error).__name__}: {error}", file=sys.stderr, flush=True)
            return EXIT_FAILURE
        finally:
            if watcher:
                watcher.stop()
            if workers:
                workers.close()
    finally:
        restore_sigterm()


if __name__ == "__main__":
    sys.exit(main())
