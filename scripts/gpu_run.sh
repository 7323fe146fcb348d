#!/usr/bin/env bash
# The GPU run of docs/benchmarks.md ("On one GPU"), on one machine with one CUDA GPU and asyncrl installed:
#   bash scripts/gpu_run.sh OUT_DIR [key=value ...]
# 1. `asyncrl train` on the default task (warm start, then GRPO), with GPU-sized batches and a wall-clock
#    budget of MINUTES (default 4.5) minutes: the embedded engine serves bf16 and the learner computes in bf16
#    on the GPU, weights go to the engine as CUDA tensors (transport auto: tensor when colocated);
# 2. `asyncrl eval` of the trained final/ and of the base model on the held-out split (-k 4, seed 0);
# 3. `asyncrl report` of the run (reward curve, summary.md);
# 4. `asyncrl bench engine`, one round, if BENCH=1 (the default); `asyncrl bench e2e` needs no pretrained
#    model and runs on its own (`asyncrl bench e2e --rounds 1`).
# Every stage runs under its own time limit and its output goes under OUT_DIR as it finishes, so a stage
# that fails or runs out of time leaves the ones before it; the exit status is the first failed stage's.
# Extra key=value arguments go to `asyncrl train` (e.g. trainer.weight_sync.transport=disk).
set -uo pipefail
OUT=${1:?usage: bash scripts/gpu_run.sh OUT_DIR [key=value ...]}
shift
MINUTES=${MINUTES:-4.5}
BENCH=${BENCH:-1}
EVAL_ARGS=${EVAL_ARGS:-}  # e.g. "--limit 4" for a quick check of this script on a CPU
PY=${PYTHON:-python3}
mkdir -p "$OUT"
RUN="$OUT/run"
status=0
stage() {  # stage NAME SECONDS CMD...: run CMD under a time limit, logging to OUT/NAME.log
    local name=$1 limit=$2
    shift 2
    local t0=$SECONDS
    echo "== $name (limit ${limit}s): $*"
    timeout --signal=INT --kill-after=30 "$limit" "$@" >"$OUT/$name.log" 2>&1
    local rc=$?
    echo "== $name: exit $rc after $((SECONDS - t0))s"
    tail -n 4 "$OUT/$name.log"
    [ $rc -eq 0 ] || [ $status -ne 0 ] || status=$rc
    return $rc
}
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
"$PY" -c "import torch, transformers; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'transformers', transformers.__version__)"

train_limit=$("$PY" -c "print(int(float('$MINUTES') * 60 + 150))")  # the budget, the last step, export, shutdown
stage train "$train_limit" "$PY" -m asyncrl.cli train trainer.output_dir="$RUN" trainer.wandb=off trainer.progress=false \
    trainer.max_minutes="$MINUTES" trainer.total_steps=1000 trainer.batch_groups=16 algorithm.n_samples=8 \
    engine.max_running_seqs=128 engine.max_running_tokens=65536 trainer.rollout_workers=4 \
    trainer.episodes_per_worker=32 trainer.max_inflight_generations=128 "$@"
if [ -f "$RUN/final/config.json" ]; then
    stage eval_final 150 "$PY" -m asyncrl.cli eval "$RUN" -k 4 $EVAL_ARGS --out "$OUT/eval_final" engine.max_running_seqs=128
fi
stage eval_base 150 "$PY" -m asyncrl.cli eval -k 4 $EVAL_ARGS --out "$OUT/eval_base" engine.max_running_seqs=128
if [ -f "$RUN/warm_start/final/config.json" ]; then
    stage eval_warm_start 150 "$PY" -m asyncrl.cli eval "$RUN/warm_start/final" -k 4 $EVAL_ARGS --out "$OUT/eval_warm_start" \
        engine.max_running_seqs=128
fi
[ -f "$RUN/metrics.jsonl" ] && stage report 120 "$PY" -m asyncrl.cli report "$RUN"
if [ "$BENCH" = 1 ]; then
    stage bench_engine 240 "$PY" -m asyncrl.cli bench engine --rounds 1
fi
exit $status
