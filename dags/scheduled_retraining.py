"""Weekly retraining of the support-ticket assistant's LoRA adapter on EC2 spot instances.

Every Friday at 18:00 UTC this pipeline retrains on the week's tickets and must have a new model
version registered by Monday 08:00 UTC, when the support team starts the week:

1. ``prepare_dataset`` reads the week's raw tickets from S3, keeps the valid ones, writes the
   training text and the training runtime's CONFIG.json next to it, and skips a week with
   too little data (retraining on it would only add noise);
2. ``fine_tune`` (:class:`DeadlineSpotFineTuneOperator`) trains on ``g5.xlarge`` instances over
   the weekend, on spot in three us-east-1 availability zones while spot is cheap and
   available, on on-demand when the Monday deadline needs it; checkpoints go to S3, so a
   preempted instance costs minutes, not the run;
3. ``evaluate`` reads the operator's result (cost, deadline met) and the final adapter, and
   gates registration on the final training loss the runtime reported;
4. ``register`` appends the model version to the registry (a JSON-lines file on S3).

It needs AWS: an ``aws_default`` connection (market data and EC2), an AMI with the provider and
its training runtime installed, a subnet per zone and an instance profile that may read and write
the bucket. Nothing here opens a connection while the DAG file is parsed.
"""

from __future__ import annotations

import json
from datetime import datetime, timedelta

from airflow.sdk import DAG, ObjectStoragePath, task
from airflow.sdk.exceptions import AirflowSkipException

from airflow_provider_spotsched.hooks.market_spec import MarketSpec
from airflow_provider_spotsched.operators.fine_tune import DeadlineSpotFineTuneOperator
from airflow_provider_spotsched.runtime.contract import PROGRESS_FILE, Progress

BUCKET = "s3://acme-ml"
RAW_TICKETS = f"{BUCKET}/support/raw"  # one JSON-lines file per day: {"question": ..., "answer": ...}
WORK_ROOT = f"{BUCKET}/support/retraining"
REGISTRY = f"{BUCKET}/model-registry/support-assistant.jsonl"
ZONES = ["us-east-1a", "us-east-1b", "us-east-1d"]
SUBNETS = {"us-east-1a": "subnet-0a1b2c3d4e5f60001", "us-east-1b": "subnet-0a1b2c3d4e5f60002", "us-east-1d": "subnet-0a1b2c3d4e5f60003"}
INSTANCE_TYPE = "g5.xlarge"
ON_DEMAND_PRICE = 1.006  # USD per hour, g5.xlarge in us-east-1
EPOCH_SAMPLES = 120_000  # the global samples one retraining consumes
MIN_TICKETS = 2_000  # fewer valid tickets in a week: skip the retraining
MAX_EVAL_LOSS = 2.5  # a worse adapter is not registered
RUN_DIR = WORK_ROOT + "/{{ ds }}"


with DAG(
    dag_id="scheduled_retraining",
    schedule="0 18 * * 5",  # Friday 18:00 UTC
    start_date=datetime(2025, 9, 5),
    catchup=False,
    max_active_runs=1,
    default_args={"retries": 1, "retry_delay": timedelta(minutes=10)},
    tags=["spotsched", "retraining"],
    doc_md=__doc__,
) as dag:

    @task
    def prepare_dataset(data_interval_end=None, ds=None) -> dict:
        """The week's valid tickets as training text, and the runtime's CONFIG.json beside it.

        The week is the seven days before the run's ``data_interval_end``: under Airflow 3's cron
        schedules (``CronTriggerTimetable``) a run's data interval is empty, so its start says nothing.
        """
        raw = ObjectStoragePath(RAW_TICKETS, conn_id="aws_default")
        seen, lines = set(), []
        week_start = data_interval_end - timedelta(days=7)
        day = week_start
        while day < data_interval_end:
            part = raw / f"{day:%Y-%m-%d}.jsonl"
            if part.exists():
                for row in part.read_text().splitlines():
                    ticket = json.loads(row) if row.strip() else {}
                    question, answer = str(ticket.get("question", "")).strip(), str(ticket.get("answer", "")).strip()
                    if question and answer and (question, answer) not in seen:
                        seen.add((question, answer))
                        lines.append(f"Question: {question}\nAnswer: {answer}\n")
            day += timedelta(days=1)
        if len(lines) < MIN_TICKETS:
            raise AirflowSkipException(  # the week's run is skipped, fine-tuning included: nothing to retry
                f"only {len(lines)} valid tickets between {week_start} and {data_interval_end}; need {MIN_TICKETS}"
            )
        run_dir = ObjectStoragePath(f"{WORK_ROOT}/{ds}", conn_id="aws_default")
        (run_dir / "train.txt").write_text("\n".join(lines))
        config = {
            "runtime": "loop",  # plain-text tickets: the builtin loop's data
            "samples": EPOCH_SAMPLES,
            "model": "Qwen/Qwen2.5-0.5B",
            "dataset": "/opt/spotsched/train.txt",  # where the command below copies it
            "global_batch_size": 32,
            "batch_size": 8,
            "seq_len": 512,
            "lr": 2e-4,
            "lora": {"r": 16, "alpha": 32.0},
            "checkpoint": {"min_interval_s": 300.0, "max_interval_s": 900.0},
        }
        (run_dir / "config.json").write_text(json.dumps(config, indent=1))
        return {"tickets": len(lines), "train": str(run_dir / "train.txt"), "config": str(run_dir / "config.json")}

    prepared = prepare_dataset()

    fine_tune = DeadlineSpotFineTuneOperator(
        task_id="fine_tune",
        backend="ec2",
        compute_conn_id="aws_default",
        instance_type=INSTANCE_TYPE,
        pools=ZONES,
        regions=["us-east-1"],
        market_source=MarketSpec(
            "aws",
            conn_id="aws_default",
            options={"instance_type": INSTANCE_TYPE, "availability_zones": ZONES, "on_demand_price": ON_DEMAND_PRICE},
        ),
        backend_options={
            "image_id": "ami-0123456789abcdef0",
            "pools": SUBNETS,
            "on_demand": SUBNETS["us-east-1a"],
            "iam_instance_profile": "spotsched-trainer",
            "security_group_ids": ["sg-0123456789abcdef0"],
        },
        command=(
            f"bash -c 'aws s3 cp {RUN_DIR}/train.txt /opt/spotsched/train.txt && "
            f"exec python3 -m airflow_provider_spotsched.runtime --config {RUN_DIR}/config.json "
            f"--checkpoint-uri {RUN_DIR}/checkpoints'"
        ),
        checkpoint_uri=f"{RUN_DIR}/checkpoints",
        work=EPOCH_SAMPLES,
        throughput={"alpha": 9_000.0, "beta": 0.0},  # samples per hour per g5.xlarge, measured
        min_instances=1,
        max_instances=4,
        reconfig_overhead_hours=0.25,
        # Monday 08:00 UTC after the Friday 18:00 run: 2 days 14 hours after the interval's end
        deadline="{{ (data_interval_end + macros.timedelta(days=2, hours=14)).isoformat() }}",
        hard_deadline_factor=1.1,
        value=400.0,  # USD the support team values a fresh model by Monday at
        budget=150.0,
        policy="selector",
        deferrable=True,  # a run lasts days: wait in the triggerer, not in a worker slot
    )
    prepared >> fine_tune

    @task
    def evaluate(result: dict, ds=None) -> dict:
        """Gate on the run: a final adapter exists, and the last training loss the runtime reported."""
        checkpoints = ObjectStoragePath(f"{WORK_ROOT}/{ds}/checkpoints", conn_id="aws_default")
        adapter = checkpoints / "final"
        if not (adapter / "adapter_config.json").exists():
            raise FileNotFoundError(f"no final adapter under {adapter}; the run ended without one")
        loss = Progress.from_dict(json.loads((checkpoints / PROGRESS_FILE).read_text())).loss
        if loss is None or loss > MAX_EVAL_LOSS:
            raise ValueError(f"final loss {loss} is above {MAX_EVAL_LOSS}: not registering this adapter")
        return {
            "adapter": str(adapter),
            "loss": loss,
            "cost_usd": round(result["cost"], 2),
            "savings_usd": round(result["savings"], 2),
            "deadline_met": result["deadline_met"],
            "preemptions": result["preemptions"],
        }

    @task
    def register(evaluation: dict, prepared: dict, ds=None, run_id=None) -> str:
        """Append the new version to the registry (JSON lines on S3; the serving side reads the last)."""
        registry = ObjectStoragePath(REGISTRY, conn_id="aws_default")
        history = registry.read_text().splitlines() if registry.exists() else []
        version = f"{ds}.{len(history) + 1}"
        entry = {"version": version, "run_id": run_id, "tickets": prepared["tickets"], **evaluation}
        registry.write_text("\n".join([*history, json.dumps(entry, sort_keys=True)]) + "\n")
        return version

    register(evaluate(fine_tune.output), prepared)
