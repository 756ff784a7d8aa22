#!/usr/bin/env bash
# GPU readiness check of the sharded engine, in one command on a CUDA machine (at most 13 minutes
# by its steps' time limits, not yet timed in this form; GPU_CHECK_STEPS picks some steps, to split
# it over two calls):
#   engine_tests_nccl   the FSDP2-behaviour tests on NCCL, one rank per visible GPU (largest of 1/2/4/8 that fits)
#   torch_contract_cuda torch's own clip_grad_norm_ and AdamW (for-loop, foreach, fused) on our
#                       sharded model equal one process on the same GPU(s), each shard-boundary policy
#   bench_1b_bf16       bench/engine.py --device cuda on the ~1B GPT in bf16: ours, ours with
#                       torch.compile on each block, torch FSDP2, FSDP2 + compile: tokens/s, MFU,
#                       peak memory, exposed comm
#   main_llama_1b_bf16  the main job (python main.py), model=llama_1b, 20 steps on every visible GPU, bf16
#   main_llama_1b_float8  the same with parallelism.float8=true (torchao's float8 matmuls)
# and writes one report (default bench/gpu_report.txt; first argument to change it).
#
#   bash bench/gpu_check.sh [REPORT]        # PYTHON=... to use another interpreter than .venv/bin/python
#                                           # GPU_CHECK_LOGS=DIR keeps each step's full log there
#   GPU_CHECK_STEPS="torch_contract_cuda bench_1b_bf16" bash bench/gpu_check.sh   # some steps only
#
# Exit status: 0 all steps passed, 1 a step failed (the report says which), 2 no GPU visible.
set -uo pipefail

cd "$(dirname "$0")/.." || exit 1
PY=${PYTHON:-.venv/bin/python}
REPORT=${1:-bench/gpu_report.txt}

if ! command -v nvidia-smi >/dev/null 2>&1; then
  echo "error: bench/gpu_check.sh needs a CUDA GPU: nvidia-smi not found; run it on a GPU machine" >&2
  exit 2
fi
NGPU=$("$PY" -c 'import torch; print(torch.cuda.device_count() if torch.cuda.is_available() else 0)' 2>/dev/null || echo 0)
if [[ "$NGPU" -lt 1 ]]; then
  echo "error: bench/gpu_check.sh needs a CUDA GPU: torch.cuda.is_available() is false under $PY" >&2
  exit 2
fi
WORLD=1
for n in 2 4 8; do
  if [[ "$NGPU" -ge "$n" ]]; then WORLD=$n; fi
done

RUN_DIR=$(mktemp -d /tmp/gpu_check_run.XXXXXX)
LOG_DIR=${GPU_CHECK_LOGS:-$(mktemp -d /tmp/gpu_check_logs.XXXXXX)}
mkdir -p "$LOG_DIR"
T0=$(date +%s)
FAILED=0
{
  echo "# GPU check of the sharded engine"
  echo "date: $(date -u '+%Y-%m-%d %H:%M UTC')   commit: ${GPU_CHECK_COMMIT:-$(git rev-parse --short HEAD 2>/dev/null || echo unknown)}"
  echo "torch: $("$PY" -c 'import torch; print(torch.__version__, "cuda", torch.version.cuda)')"
  nvidia-smi -L
  echo "GPUs visible: $NGPU; engine-test world size: $WORLD; steps: ${GPU_CHECK_STEPS:-all}"
} >"$REPORT"

# run_step NAME SECONDS COMMAND...: runs the command under a time limit, keeps its log, and puts
# its status and the last lines of its output into the report.
run_step() {
  local name=$1 limit=$2 start rc
  shift 2
  start=$(date +%s)
  timeout --kill-after=10 "$limit" "$@" >"$LOG_DIR/$name.log" 2>&1
  rc=$?
  local status=PASS
  if [[ $rc -ne 0 ]]; then
    status="FAIL (exit $rc$([[ $rc -eq 124 ]] && echo ", over ${limit}s"))"
    FAILED=1
  fi
  {
    echo
    echo "## $name: $status in $(($(date +%s) - start)) s"
    echo "\$ $*"
    tail -n 15 "$LOG_DIR/$name.log"
  } >>"$REPORT"
}

STEPS=${GPU_CHECK_STEPS:-engine_tests_nccl torch_contract_cuda bench_1b_bf16 main_llama_1b_bf16 main_llama_1b_float8}
wanted() { [[ " $STEPS " == *" $1 "* ]]; }

if wanted engine_tests_nccl; then
  run_step engine_tests_nccl 90 env FSDP_TEST_DEVICE=cuda TEST_DIST_BACKEND=cpu:gloo,cuda:nccl \
    FSDP_TEST_WORLD="$WORLD" "$PY" -m pytest -q -p no:cacheprovider tests/distributed/test_fsdp2_behaviours.py
fi

if wanted torch_contract_cuda; then
  run_step torch_contract_cuda 90 env FSDP_TEST_DEVICE=cuda TEST_DIST_BACKEND=cpu:gloo,cuda:nccl \
    FSDP_TEST_WORLD="$WORLD" "$PY" -m pytest -q -p no:cacheprovider tests/distributed/test_torch_contract.py \
    -k "not dcp"
fi

if wanted bench_1b_bf16; then
  run_step bench_1b_bf16 300 "$PY" bench/engine.py --device cuda --model-size 1b --ranks "$NGPU" --steps 8 \
    --gpu-engines ours ours+compile fsdp2 fsdp2+compile --out "$LOG_DIR/engine_gpu.json"
fi

# main_job NAME EXTRA...: the main job on llama_1b, 20 steps, bf16 compute; its last metrics record goes
# into the report (tokens/s and MFU: float8 against bf16 on the same machine).
main_job() {
  local name=$1
  shift
  run_step "$name" 150 "$PY" main.py model=llama_1b data=synthetic cluster.nproc_per_node="$NGPU" \
    trainer.device=cuda trainer.max_steps=20 trainer.log_interval=5 trainer.eval_interval=0 \
    parallelism.param_dtype=bfloat16 trainer.progress_bar=false "hydra.run.dir=$RUN_DIR/$name" "$@"
  if [[ -f "$RUN_DIR/$name/metrics.jsonl" ]]; then
    {
      echo "last metrics record of $name:"
      grep '"tokens_per_s"' "$RUN_DIR/$name/metrics.jsonl" | tail -n 1
    } >>"$REPORT"
  fi
}
if wanted main_llama_1b_bf16; then main_job main_llama_1b_bf16; fi
if wanted main_llama_1b_float8; then main_job main_llama_1b_float8 parallelism.float8=true; fi

{
  echo
  echo "total: $(($(date +%s) - T0)) s; logs in $LOG_DIR; result: $([[ $FAILED -eq 0 ]] && echo PASS || echo FAIL)"
} >>"$REPORT"
echo "wrote $REPORT"
exit "$FAILED"
