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

# Stage: data_preparation
mkdir -p /shared/jobs/train-golden/data_preparation /shared/jobs/train-golden/logs
/opt/venv/bin/python \
    /opt/repo/main.py \
    cluster=local \
    data=indexed \
    'data.paths=[/shared/data/corpus_text_document]' \
    'data.raw_inputs=[/shared/raw]' \
    data.output_prefix=/shared/data/corpus \
    model=debug \
    data.seq_len=64 \
    trainer.max_steps=4 \
    stage=data_preparation \
    hydra.run.dir=/shared/jobs/train-golden/data_preparation
status=$?
if [ "$status" != 0 ]; then
    echo "stage data_preparation failed ($status)" >&2
    exit "$status"
fi

# Stage: training
mkdir -p /shared/jobs/train-golden/run /shared/jobs/train-golden/logs
/opt/venv/bin/python -m torch.distributed.run --standalone --nproc-per-node=2 --max-restarts=3 --shutdown-timeout=100 \
    /opt/repo/main.py \
    cluster=local \
    data=indexed \
    'data.paths=[/shared/data/corpus_text_document]' \
    'data.raw_inputs=[/shared/raw]' \
    data.output_prefix=/shared/data/corpus \
    model=debug \
    data.seq_len=64 \
    trainer.max_steps=4 \
    checkpoint.resume=auto \
    stage=training \
    hydra.run.dir=/shared/jobs/train-golden/run
status=$?
if [ "$status" != 0 ]; then
    echo "stage training failed ($status)" >&2
    exit "$status"
fi
