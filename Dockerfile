# The training image: the official PyTorch CUDA runtime (torch comes from it, pinned by the tag),
# this project and its pinned dependencies (requirements.lock) at /workspace, run as a non-root user.
#   docker build -t registry.example/org/train:1.0 .
# launcher_scripts/ runs it with container.image=<that tag> (container.workdir=/workspace).
FROM pytorch/pytorch:2.13.0-cuda12.8-cudnn9-runtime

ENV PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1

# RDMA user-space libraries: NCCL's InfiniBand/RoCE transport loads libibverbs and the device
# providers (mlx5 and the other verbs drivers) from the image; without them it falls back to TCP
# sockets. The pods or containers still need the devices (cluster.ib_resources on Kubernetes,
# IPC_LOCK). AWS EFA is not covered: NCCL reaches it through the aws-ofi-nccl plugin (and
# libfabric), which this image does not install; build on an EFA-enabled base image for it.
# Versions follow the base image's Ubuntu release (pinned by its tag), hence no apt pins here.
# hadolint ignore=DL3008
RUN apt-get update \
    && apt-get install -y --no-install-recommends ibverbs-providers libibverbs1 librdmacm1 rdma-core \
    && rm -rf /var/lib/apt/lists/*

WORKDIR /workspace
RUN useradd --create-home --uid 1000 --shell /bin/bash trainer \
    && chown trainer:trainer /workspace

# Dependencies first, so a code change does not reinstall them: the runtime lock and the users'
# tools (trackers, datasets, lm-eval); the test and bench locks stay out of the image. torch is in
# neither lock file: the base image's build (with its CUDA libraries) is the one used.
COPY requirements.lock requirements-tools.lock ./
RUN pip install --no-cache-dir -r requirements.lock -r requirements-tools.lock

COPY --chown=trainer:trainer . .
# --no-deps: everything is installed above; never let pip replace the base image's torch.
RUN pip install --no-cache-dir --no-deps . \
    && rm -rf build ./*.egg-info

USER 1000:1000

# The default job; launcher_scripts/ replaces the command with torchrun and the job's overrides.
CMD ["python", "main.py"]
