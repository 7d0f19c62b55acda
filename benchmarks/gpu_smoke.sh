#!/usr/bin/env bash
# GPU smoke test of the spot contract on the Hugging Face stack: bf16 LoRA on the builtin tiny
# model through docs/examples/hf_trainer_lora.py (spot_train), 2 processes under torchrun with
# NCCL where 2 GPUs exist (1 process otherwise), a file:// preemption notice mid-run, then:
#   - the run stops with exit 75 (each worker's, as torchrun reports it) and progress.json
#     status "preempted" at a checkpointed step > 0;
#   - the same command resumes from that checkpoint and ends with exit 0, status "done" and the
#     adapter under ckpt/final/.
# Meant to finish in well under 5 minutes on one GPU machine. Without a GPU (no nvidia-smi, or
# torch.cuda.is_available() false) it says so and exits 0 having run nothing.
# Usage: benchmarks/gpu_smoke.sh [WORKDIR]   (PYTHON=... picks the interpreter; default python3)
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if ! command -v nvidia-smi >/dev/null 2>&1 \
  || ! "$PY" -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)' 2>/dev/null; then
  echo "gpu_smoke: needs a GPU (nvidia-smi and torch.cuda.is_available()); none here, so nothing was run"
  exit 0
fi
gpus=$("$PY" -c 'import torch; print(torch.cuda.device_count())')
nproc=$(( gpus >= 2 ? 2 : 1 ))
work=${1:-$(mktemp -d)}
mkdir -p "$work"
ckpt=$work/ckpt notice=$work/notice log=$work/run.log
export SPOTSCHED_NOTICE=file://$notice SPOTSCHED_NOTICE_POLL_S=0.2
export SPOTSCHED_CHECKPOINT='{"min_interval_s": 2, "max_interval_s": 5}' HF_HUB_OFFLINE=1
args=(docs/examples/hf_trainer_lora.py --checkpoint-uri "$ckpt" --bf16 --max-steps "${SMOKE_STEPS:-3000}" --batch-size 16)
limit=${SMOKE_TIMEOUT_S:-240}  # per run: a hang fails the smoke instead of holding the machine
launch() {
  if [ "$nproc" -gt 1 ]; then timeout "$limit" "$PY" -m torch.distributed.run --standalone --nproc-per-node "$nproc" "${args[@]}"
  else timeout "$limit" "$PY" "${args[@]}"; fi
}
status() { "$PY" -c 'import json, sys; p = json.load(open(sys.argv[1])); print(p["status"], p["step"])' "$ckpt/progress.json" 2>/dev/null; }
fail() { echo "gpu_smoke: FAILED: $*"; tail -n 30 "$log"; exit 1; }

echo "gpu_smoke: $gpus GPU(s), $nproc process(es), workdir $work"
start=$SECONDS
launch >"$log" 2>&1 &
pid=$!
until [ -f "$ckpt/progress.json" ]; do  # the first periodic checkpoint: the run is mid-way
  kill -0 "$pid" 2>/dev/null || fail "the run ended before its first checkpoint"
  [ $((SECONDS - start)) -lt 180 ] || { kill "$pid"; fail "no checkpoint within 180 s"; }
  sleep 0.5
done
touch "$notice"
wait "$pid"; rc=$?
rm -f "$notice"
read -r state step <<<"$(status)"
echo "gpu_smoke: after the notice: exit $rc, progress $state at step $step ($((SECONDS - start)) s)"
if [ "$nproc" -gt 1 ]; then
  grep -Eq "exitcode *: *75" "$log" || fail "torchrun did not report a worker's exit 75 (exit $rc)"
else
  [ "$rc" -eq 75 ] || fail "exit $rc, not 75"
fi
[ "$state" = preempted ] && [ "$step" -gt 0 ] || fail "progress.json says $state at step $step, not preempted at a step > 0"

launch >>"$log" 2>&1; rc=$?
read -r state final_step <<<"$(status)"
echo "gpu_smoke: resumed: exit $rc, progress $state at step $final_step ($((SECONDS - start)) s in all)"
[ "$rc" -eq 0 ] && [ "$state" = done ] && [ -d "$ckpt/final" ] || fail "the resumed run did not finish with its adapter"
echo "gpu_smoke: OK"
