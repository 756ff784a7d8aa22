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
/opt/venv/bin/python -m torch.distributed.run --standalone --nproc-per-node=2 --max-restarts=3 --shutdown-timeout=100 \
    /opt/repo/main.py \
    cluster=local \
    model=debug \
    data=synthetic \
    trainer.progress_bar=false \
    logging.tensorboard=false \
    trainer.sample_tokens=0 \
    trainer.max_steps=4 \
    'checkpoint.dir='"'"'x; rm -rf ~; touch PWNED $(touch PWNED2) `touch PWNED3`'"'"'' \
    checkpoint.resume=auto \
    hydra.run.dir=/shared/jobs/train-golden/run
status=$?
if [ "$status" != 0 ]; then
    echo "stage training failed ($status)" >&2
    exit "$status"
fi
