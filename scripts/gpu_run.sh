#!/usr/bin/env bash
# The GPU run of docs/benchmarks.md ("On one GPU"), on one machine with one CUDA GPU and asyncrl installed:
#   bash scripts/gpu_run.sh OUT_DIR [key=value ...]
# 0. the host's cost of one small CUDA op (where it is tens of microseconds, the host sets the engine's speed);
#    then the tests marked gpu of the engine (tests/engine/test_gpu.py, test_graphs.py: CUDA graphs captured
#    and replayed give transformers' greedy tokens), stage `gpu_tests`;
# 1. `asyncrl bench engine` on the GPU at 16 and at 128 running rows (sampled at T = 1, one round each):
#    at 16 rows against the same engine with every step eager (engine.cuda_graphs=false), at 128 against
#    `model.generate` on static batches of the same size, on the long-tailed workload and on one where every
#    request wants 256 tokens (decode alone), if BENCH=1 (the default); BENCH_MODEL=DIR benches that
#    checkpoint instead of the default model (a random one of its shape serves: EOS is banned until each
#    request's length, so the weights do not change the work);
# 2. `asyncrl train` on the default task (warm start, then GRPO), with GPU-sized batches and a wall-clock
#    budget of MINUTES (default 4) minutes: the embedded engine serves bf16 and the learner computes in bf16
#    on the GPU, weights go to the engine as CUDA tensors (transport auto: tensor when colocated);
# 3. `asyncrl eval` of the warm start and of the trained final/ on the held-out split (-k 4, seed 0), the
#    second paired with the first (`--against`: the episodes RL moved up and down, and their sign test),
#    and of the base model if EVAL_BASE=1 (the default; it scored 0.4% on the CPU);
# 4. `asyncrl report` of the run (reward curve, summary.md);
# 5. SGLang, where `sglang` imports in this Python (SGLANG=1, the default): a short `asyncrl train` on it
#    (engine.type=sglang: the weight names checked through /get_weights_by_name before the first sync and
#    one tensor read back after each, liveness through /health, buckets in the dtype it serves), then the
#    contract tests against its real HTTP app (pytest -m sglang tests/sglang); where it does not import,
#    the stage says so plainly (OUT/sglang.log) and runs nothing.
# Every stage runs under its own time limit and its output goes under OUT_DIR as it finishes, so a stage
# that fails or runs out of time leaves the ones before it; the exit status is the first failed stage's.
# Extra key=value arguments go to `asyncrl train` (e.g. trainer.weight_sync.transport=disk).
# STAGES picks what runs, comma-separated from gpu_tests,bench,train,eval,sglang (default: all), so one lent
# GPU can run them over two calls (the second carrying the default model's weights).
# DRY_RUN=1 checks the wiring on any machine in seconds: `asyncrl train --dry-run` and `asyncrl eval
# --dry-run` with the same arguments (config, preflight, model and dataset found), and prints the benches'
# command lines; nothing is trained or generated (tests/core/test_gpu_script.py).
set -uo pipefail
OUT=${1:?usage: bash scripts/gpu_run.sh OUT_DIR [key=value ...]}
shift
MINUTES=${MINUTES:-4}
BENCH=${BENCH:-1}
EVAL_BASE=${EVAL_BASE:-1}
SGLANG=${SGLANG:-1}
DRY_RUN=${DRY_RUN:-0}
STAGES=${STAGES:-gpu_tests,bench,train,eval,sglang}
BENCH_MODEL=${BENCH_MODEL:-}
EVAL_ARGS=${EVAL_ARGS:-}  # e.g. "--limit 4"
PY=${PYTHON:-python3}
mkdir -p "$OUT"
RUN="$OUT/run"
status=0
want() { [[ ",$STAGES," == *",$1,"* ]]; }
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
bench() {  # bench NAME SECONDS ARGS...: a bench stage (printed, not run, under DRY_RUN)
    local name=$1 limit=$2
    shift 2
    local model=()
    [ -n "$BENCH_MODEL" ] && model=(--model-path "$BENCH_MODEL")
    if [ "$DRY_RUN" = 1 ]; then echo "== $name (dry run): $PY -m asyncrl.cli bench engine $* ${model[*]}"; return 0; fi
    stage "$name" "$limit" "$PY" -m asyncrl.cli bench engine "$@" "${model[@]}"
}
dry=()
[ "$DRY_RUN" = 1 ] && dry=(--dry-run)
sglang_stages() {  # 5: a short run on SGLang and its contract tests, or why they cannot run here
    [ "$SGLANG" = 1 ] && want sglang || return 0
    local why
    if ! why=$("$PY" -c "import sglang" 2>&1); then
        echo "== sglang: not run: sglang does not import in $PY ($(echo "$why" | tail -n 1))" | tee "$OUT/sglang.log"
        return 0
    fi
    stage sglang_train 600 "$PY" -m asyncrl.cli train "${dry[@]}" engine.type=sglang trainer.output_dir="$OUT/run_sglang" \
        trainer.wandb=off trainer.progress=false trainer.total_steps=3 warm_start.mode=off "$@"
    [ "$DRY_RUN" = 1 ] || stage sglang_contract 300 "$PY" -m pytest -q -p no:randomly -m sglang tests/sglang
}
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>/dev/null || echo "no nvidia-smi"
[ "$DRY_RUN" = 1 ] || "$PY" -c "import torch, transformers; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'transformers', transformers.__version__)"
echo "kernel $(uname -r), $(nproc) CPUs"
# the host's cost of one small GPU op (launch + PyTorch's dispatch): a decode step of the 135M model is ~1,700 of
# them on transformers' path, so where this is tens of microseconds the host, not the GPU, sets tokens/s
[ "$DRY_RUN" = 1 ] || "$PY" -c "
import time, torch
if torch.cuda.is_available():
    x = torch.zeros(16, device='cuda')
    for n in (200, 2000):
        torch.cuda.synchronize(); t = time.perf_counter()
        for _ in range(n): x.add_(1)
        torch.cuda.synchronize(); dt = time.perf_counter() - t
    print(f'one small CUDA op: {dt / n * 1e6:.1f} us (2000 in-place adds, synchronized at the end)')
"

if want gpu_tests && [ "$DRY_RUN" != 1 ]; then
    stage gpu_tests 240 "$PY" -m pytest -q -p no:randomly -p no:cacheprovider -m gpu tests/engine/test_gpu.py \
        tests/engine/test_graphs.py
fi

if [ "$BENCH" = 1 ] && want bench; then  # tokens/s at 16 and 128 rows; prompts of 32..256 tokens
    common=(--rounds 1 --max-new-tokens 256 --temperature 1.0 --skip-cb)
    # one request in 8 long (256 tokens), the others 16-32: rows end and join nearly every step
    bench bench_engine_16 180 "${common[@]}" --batch 16 --requests 64 --skip-static --eager-engine
    bench bench_engine_128 180 "${common[@]}" --batch 128 --requests 512
    # every request 256 tokens: decode steps alone, rows join in waves
    bench bench_engine_128_decode 180 "${common[@]}" --batch 128 --requests 512 --long-every 1
fi
want train || { sglang_stages "$@"; exit $status; }

train_limit=$("$PY" -c "print(int(float('$MINUTES') * 60 + 150))")  # the budget, the last step, export, shutdown
stage train "$train_limit" "$PY" -m asyncrl.cli train "${dry[@]}" trainer.output_dir="$RUN" trainer.wandb=off \
    trainer.progress=false trainer.max_minutes="$MINUTES" trainer.total_steps=1000 trainer.batch_groups=16 \
    algorithm.n_samples=8 engine.max_running_seqs=128 engine.max_running_tokens=65536 trainer.rollout_workers=4 \
    trainer.episodes_per_worker=32 trainer.max_inflight_generations=128 "$@"
if [ "$DRY_RUN" = 1 ]; then  # no run dir: the evals check themselves against the base model
    stage eval_base 120 "$PY" -m asyncrl.cli eval --dry-run -k 4 $EVAL_ARGS --out "$OUT/eval_base" \
        engine.max_running_seqs=128
    sglang_stages "$@"
    exit $status
fi
want eval || { [ -f "$RUN/metrics.jsonl" ] && stage report 120 "$PY" -m asyncrl.cli report "$RUN"; sglang_stages "$@"; exit $status; }
if [ -f "$RUN/warm_start/final/config.json" ]; then
    stage eval_warm_start 150 "$PY" -m asyncrl.cli eval "$RUN/warm_start/final" -k 4 $EVAL_ARGS \
        --out "$OUT/eval_warm_start" engine.max_running_seqs=128
fi
if [ -f "$RUN/final/config.json" ]; then
    against=()
    [ -f "$OUT/eval_warm_start/episodes.jsonl" ] && against=(--against "$OUT/eval_warm_start")
    stage eval_final 150 "$PY" -m asyncrl.cli eval "$RUN" -k 4 $EVAL_ARGS "${against[@]}" --out "$OUT/eval_final" \
        engine.max_running_seqs=128
fi
[ -f "$RUN/metrics.jsonl" ] && stage report 120 "$PY" -m asyncrl.cli report "$RUN"
if [ "$EVAL_BASE" = 1 ]; then
    stage eval_base 150 "$PY" -m asyncrl.cli eval -k 4 $EVAL_ARGS --out "$OUT/eval_base" engine.max_running_seqs=128
fi
sglang_stages "$@"
exit $status
