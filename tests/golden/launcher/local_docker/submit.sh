#!/usr/bin/env bash
# shellcheck disable=SC2016
# train-golden: runs on this machine; agents 1.. of a multi-node run log to logs/.
# Written by launcher_scripts/main.py; re-run the launcher rather than editing it.

set -uo pipefail

# Environment (secrets by reference only).
export HF_TOKEN="${MY_HF_TOKEN:?set MY_HF_TOKEN in the environment you submit from}"

# Stage: training
mkdir -p /shared/jobs/train-golden/run /shared/jobs/train-golden/logs
docker run --rm --network=host --ipc=host --workdir /workspace --gpus all --volume /shared/jobs/train-golden:/shared/jobs/train-golden --volume /data:/data --env HF_TOKEN registry.example/org/train:1.0 \
    python -m torch.distributed.run --standalone --nproc-per-node=2 --max-restarts=0 \
    /workspace/main.py \
    cluster=local \
    container.runtime=docker \
    container.image=registry.example/org/train:1.0 \
    cluster.gpus_per_node=2 \
    'container.mounts=[/data:/data]' \
    +cluster.secret_env.HF_TOKEN=MY_HF_TOKEN \
    model=debug \
    data=synthetic \
    trainer.progress_bar=false \
    logging.tensorboard=false \
    trainer.sample_tokens=0 \
    checkpoint.resume=auto \
    hydra.run.dir=/shared/jobs/train-golden/run
status=$?
if [ "$status" != 0 ]; then
    echo "stage training failed ($status)" >&2
    exit "$status"
fi
