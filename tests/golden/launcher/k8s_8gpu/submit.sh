#!/usr/bin/env bash
# shellcheck disable=SC2016
# Applies this job's PyTorchJob manifest to the current kubectl context.
# Written by launcher_scripts/main.py; re-run the launcher rather than editing it.

set -euo pipefail
kubectl apply -f /shared/jobs/train-golden/pytorchjob.yaml
