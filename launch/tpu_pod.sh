#!/usr/bin/env bash
# Cloud TPU pod slice: run the same command on every host (worker) of the slice. On each,
# jax.distributed.initialize() reads the coordinator (worker 0), the process count and its own
# index (the worker number) from the TPU metadata. The workdir must be shared (e.g. gs://...).
#   launch/tpu_pod.sh [--type TYPE] [--hosts N] TPU_NAME ZONE [VERB] [lm args...]
#   launch/tpu_pod.sh --type v5p-64 my-tpu us-central2-b train \
#     --config configs/llama3_70b.py --workdir gs://bucket/runs/70b
# VERB (train, sft, dpo, rl, eval, ...) defaults to train. --type, the slice's accelerator type,
# lists the processes; --hosts N overrides the host count it implies. DRY_RUN=1 runs nothing.
set -euo pipefail
# shellcheck source-path=SCRIPTDIR
source "$(dirname "$0")/lib.sh"

usage() {
  echo "usage: [DRY_RUN=1] $0 [--type TYPE] [--hosts N] TPU_NAME ZONE [VERB] [lm args...]" >&2
  exit 2
}

# Hosts in a slice. v2/v3/v4/v5p names count TensorCores (2 a chip, 4 chips a host); v5e
# (v5litepod) and v6e names count chips: up to 8 on one host, 4 a host in larger slices.
tpu_hosts() {
  local family=${1%-*} n=${1##*-}
  [[ $1 == *-* && $n =~ ^[1-9][0-9]*$ ]] || return 1
  case $family in
    v2 | v3 | v4 | v5p) echo $(((n + 7) / 8)) ;;
    v5litepod | v5e | v6e) if ((n <= 8)); then echo 1; else echo $((n / 4)); fi ;;
    *) return 1 ;;
  esac
}

TYPE="" HOSTS=""
while [[ $# -gt 0 ]]; do
  case $1 in
    --type) [[ $# -ge 2 ]] || usage; TYPE=$2; shift 2 ;;
    --hosts) [[ $# -ge 2 && $2 =~ ^[1-9][0-9]*$ ]] || usage; HOSTS=$2; shift 2 ;;
    -*) usage ;;
    *) break ;;
  esac
done
[[ $# -ge 2 ]] || usage
TPU_NAME=$1 ZONE=$2
shift 2
VERB=train
if [[ $# -gt 0 && $1 != -* ]]; then VERB=$1; shift; fi

if [[ -n $TYPE && -z $HOSTS ]]; then
  HOSTS=$(tpu_hosts "$TYPE") ||
    die "unknown TPU type '$TYPE' (expected v2-N, v3-N, v4-N, v5p-N, v5litepod-N, v5e-N or v6e-N; or give --hosts N)"
fi
if [[ -n $HOSTS ]]; then
  # What jax.distributed.initialize() reads from the TPU metadata: worker 0's address, the host
  # count, this host's worker number; 8482 is its default coordinator port.
  echo "slice ${TYPE:-?}: $HOSTS hosts, one process each"
  for ((i = 0; i < HOSTS; i++)); do
    echo "process $i/$HOSTS on worker $i: coordinator=worker-0:8482 process_id=$i num_processes=$HOSTS"
  done
else
  echo "processes: one per host of the slice (pass --type TYPE to list them)"
fi

# The remote shell parses --command, so each lm argument is quoted for it.
LM=".venv/bin/lm $(printf '%q' "$VERB") --distributed"
if [[ $# -gt 0 ]]; then LM+=$(printf ' %q' "$@"); fi
run_last gcloud compute tpus tpu-vm ssh "$TPU_NAME" --zone "$ZONE" --worker=all --command \
  "cd ~/lm && make install >/dev/null && $LM"
