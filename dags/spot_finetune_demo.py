"""Fine-tune a tiny GPT-2 by a deadline on a replayed GCP H100 spot market, on this machine.

``make demo`` runs this DAG with ``airflow dags test``; ``make ui`` starts Airflow to watch it.

- Market: the shipped trace of 13 GCP zones (October 2025), replayed from 2025-10-11 04:10 UTC,
  one hourly slot every ``SECONDS_PER_SLOT`` seconds. Three pools: ``us-east4-a`` is the
  cheapest and loses all its capacity in slot 1, so the run is preempted there and moves on.
- Backend: the local one (one worker process per instance, the embedded default: no
  connection to create); checkpoints under ``$AIRFLOW_HOME/spotsched/checkpoints``.
- Training: the project's default runtime (TRL ``SFTTrainer``, LoRA on a tiny GPT-2 built from
  scratch, on the shipped prompt/response JSONL with the prompts masked out of the loss) for
  ``SAMPLES`` samples, paced at ``SAMPLES_PER_SECOND`` per worker so that it takes as many market
  hours as the planning model says on any CPU (an instance of fixed speed); a preempted worker
  saves an emergency checkpoint and the next one resumes from it. A worker's start (importing
  torch, transformers, TRL and datasets, building the model) takes about 10-15 s on a loaded
  2-core machine, under the ``reconfig_overhead_hours`` of 0.75 (15 s) the plan allows.
- Policy: the selector, which learns across runs in the Variable ``spotsched_selector_state``.

The last task prints the run's summary from the operator's XCom.
"""

from __future__ import annotations

from datetime import datetime

from airflow.sdk import DAG, task

from airflow_provider_spotsched.operators.fine_tune import DeadlineSpotFineTuneOperator

SECONDS_PER_SLOT = 20.0
SAMPLES_PER_SECOND = 15.0  # per worker: 300 samples per market hour
SAMPLES = 1200  # four market hours on one instance
POOLS = ["us-east4-a", "europe-west1-c", "us-central1-a"]


def describe(allocation: dict | None) -> str:
    """``2xus-east4-a+1xOD`` for two spot instances in us-east4-a and one on-demand; ``-`` idle."""
    if not allocation:
        return "-"
    parts = [f"{n}x{pool}" for pool, n in allocation.get("spot", {}).items()]
    if allocation.get("on_demand"):
        parts.append(f"{allocation['on_demand']}xOD")
    return "+".join(parts) or "-"


with DAG(
    dag_id="spot_finetune_demo",
    schedule=None,
    start_date=datetime(2025, 10, 1),
    catchup=False,
    tags=["spotsched", "demo"],
    doc_md=__doc__,
) as dag:
    fine_tune = DeadlineSpotFineTuneOperator(
        task_id="fine_tune",
        pools=POOLS,
        training_config={
            "samples": SAMPLES,
            "batch_size": 8,
            "seq_len": 32,
            "threads": 1,
            "samples_per_second_per_worker": SAMPLES_PER_SECOND,
            "log_every_steps": 10,
            "checkpoint": {"min_interval_s": 1.0, "max_interval_s": 3.0},
        },
        # planning model: samples per market hour (SECONDS_PER_SLOT of wall time) per instance
        throughput={"alpha": SAMPLES_PER_SECOND * SECONDS_PER_SLOT, "beta": 0.0},
        # 10 h for 4 h of work: the scripted preemption and slow worker starts on a loaded machine
        # (each restart costs most of a market hour, and the measured throughput is noisy over so
        # few slots) still leave the policy spot to finish on, instead of the on-demand fallback.
        deadline=10.0,
        hard_deadline_factor=1.5,
        min_instances=1,
        max_instances=1,
        reconfig_overhead_hours=0.75,
        value=100.0,
        backend="local",
        backend_options={
            "trace": "gcp",
            "seconds_per_slot": SECONDS_PER_SLOT,
            "market_start": "2025-10-11T04:10:00Z",
        },
        forecaster="seasonal-naive",
        poll_interval=1.0,
        deferrable=True,  # between slots the task waits in the triggerer, holding no worker slot
    )

    @task
    def summary(result: dict, ti=None) -> str:
        """The run in a few lines, from the operator's return value and its decision log."""
        log = ti.xcom_pull(task_ids="fine_tune", key="decision_log") or []
        lines = [
            f"policy              {result['policy']}",
            f"cost                {result['cost']:.2f} USD",
            f"on-demand cost      {result['on_demand_cost']:.2f} USD (N_max on-demand instances)",
            f"savings             {result['savings']:.2f} USD ({100 * result['savings_fraction']:.0f}%)",
            f"completion          {result['completion_hours']:.2f} h of deadline {result['deadline_hours']:g} h"
            f" ({'met' if result['deadline_met'] else 'MISSED'})",
            f"preemptions         {result['preemptions']}",
            f"utility             {result['utility']:.2f} USD",
            "slots               " + "  ".join(f"{r['slot']}:{describe(r['applied'])}" for r in log),
        ]
        text = "\n".join(lines)
        print("=== spot fine-tune summary ===\n" + text)
        return text

    summary(fine_tune.output)


if __name__ == "__main__":
    dag.test()
