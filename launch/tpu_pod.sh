#!/usr/bin/env bash
# Cloud TPU pod slice: run the same command on every host; jax.distributed.initialize()
# auto-detects the TPU topology. The workdir must be a path all hosts share (e.g. gs://...).
#   launch/tpu_pod.sh my-tpu us-central2-b --config configs/llama3_70b.py --workdir gs://bucket/runs/70b
set -euo pipefail
TPU_NAME=$1; ZONE=$2; shift 2
ARGS=$(printf ' %q' "$@")
gcloud compute tpus tpu-vm ssh "$TPU_NAME" --zone "$ZONE" --worker=all --command \
  "cd ~/lm && make install >/dev/null && .venv/bin/lm train --distributed $ARGS"
