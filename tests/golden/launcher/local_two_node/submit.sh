#!/usr/bin/env bash
# shellcheck disable=SC2016
# train-golden: runs on this machine; agents 1.. of a multi-node run log to logs/.
# Written by launcher_scripts/main.py; re-run the launcher rather than editing it.

set -uo pipefail
cd /opt/repo || exit 1
# One run of this job at a time: the lock goes with the process (never stale after a crash).
mkdir -p /shared/jobs/train-golden
exec 9>>/shared/jobs/train-golden/job.lock || exit 1
if ! flock -n 9; then
    echo 'error: this job is already running (lock /shared/jobs/train-golden/job.lock); wait for it to end' >&2
    exit 2
fi

# Stage: training
mkdir -p /shared/jobs/train-golden/run /shared/jobs/train-golden/logs
pids=()
# agent 1 of 2
/opt/venv/bin/python -m torch.distributed.run --nnodes=2 --nproc-per-node=1 --rdzv-backend=static --master-addr=127.0.0.1 --master-port=29400 --node-rank=1 --max-restarts=3 --shutdown-timeout=100 \
    /opt/repo/main.py \
    cluster=local \
    cluster.nodes=2 \
    cluster.nproc_per_node=1 \
    model=debug \
    data=synthetic \
    trainer.progress_bar=false \
    logging.tensorboard=false \
    trainer.sample_tokens=0 \
    trainer.max_steps=4 \
    checkpoint.resume=auto \
    hydra.run.dir=/shared/jobs/train-golden/run \
    > /shared/jobs/train-golden/logs/training-node1.log 2>&1 &
pids+=("$!")
# agent 0 of 2
/opt/venv/bin/python -m torch.distributed.run --nnodes=2 --nproc-per-node=1 --rdzv-backend=static --master-addr=127.0.0.1 --master-port=29400 --node-rank=0 --max-restarts=3 --shutdown-timeout=100 \
    /opt/repo/main.py \
    cluster=local \
    cluster.nodes=2 \
    cluster.nproc_per_node=1 \
    model=debug \
    data=synthetic \
    trainer.progress_bar=false \
    logging.tensorboard=false \
    trainer.sample_tokens=0 \
    trainer.max_steps=4 \
    checkpoint.resume=auto \
    hydra.run.dir=/shared/jobs/train-golden/run &
pids+=("$!")
status=0
for _ in "${pids[@]}"; do
    wait -n
    rc=$?
    if [ "$rc" != 0 ] && [ "$status" = 0 ]; then
        status=$rc
        echo "an agent failed ($rc); stopping the others" >&2
        kill -TERM "${pids[@]}" 2>/dev/null
    fi
done
if [ "$status" != 0 ]; then
    echo "stage training failed ($status)" >&2
    exit "$status"
fi
