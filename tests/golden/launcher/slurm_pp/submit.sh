#!/usr/bin/env bash
# shellcheck disable=SC2016
# train-golden: submits the job's stages to Slurm; the job ids go to job_ids.
# Written by launcher_scripts/main.py; re-run the launcher rather than editing it.

set -euo pipefail
ids=/shared/jobs/train-golden/job_ids

id=$(sbatch --parsable --dependency=singleton /shared/jobs/train-golden/training.sbatch)
id=${id%%;*}
echo "training: ${id}"
echo "$id" >> "$ids"
