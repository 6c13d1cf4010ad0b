#!/usr/bin/env bash
# Prints the Kubernetes manifest for an lm run on N pods: launch/k8s/job.yaml, filled in.
#   launch/k8s/render.sh --image IMAGE [--pods N] [--gpus G] [--name NAME] [VERB] [lm args...]
#   launch/k8s/render.sh --image ghcr.io/you/lm:latest --pods 4 sft --config ... --workdir /shared/runs/sft
# VERB (train, sft, dpo, rl, eval, ...) defaults to train; pods 2, GPUs per pod 8, name lm-train.
# --plan prints each pod's process settings instead (launch/k8s/apply.sh shows both).
set -euo pipefail
# shellcheck source-path=SCRIPTDIR
source "$(dirname "$0")/../lib.sh"

usage() {
  echo "usage: $0 [--plan] --image IMAGE [--pods N] [--gpus G] [--name NAME] [VERB] [lm args...]" >&2
  exit 2
}

# A YAML double-quoted string (JSON's escapes), so any argument survives.
yaml_str() {
  local s=${1//\\/\\\\}
  s=${s//\"/\\\"}
  printf '"%s"' "${s//$'\n'/\\n}"
}

PLAN="" IMAGE="" PODS=2 GPUS=8 NAME=lm-train
while [[ $# -gt 0 ]]; do
  case $1 in
    --plan) PLAN=1; shift; continue ;;
    --image | --pods | --gpus | --name) [[ $# -ge 2 ]] || usage ;;
    *) break ;;
  esac
  case $1 in
    --image) IMAGE=$2 ;;
    --pods) PODS=$2 ;;
    --gpus) GPUS=$2 ;;
    --name) NAME=$2 ;;
  esac
  shift 2
done
[[ -n $IMAGE ]] || usage
[[ $PODS =~ ^[1-9][0-9]*$ ]] || die "--pods takes a positive integer, not '$PODS'"
[[ $GPUS =~ ^[0-9]+$ ]] || die "--gpus takes an integer, not '$GPUS'"
[[ $NAME =~ ^[a-z]([-a-z0-9]*[a-z0-9])?$ ]] || die "--name must be a DNS label (a-z, 0-9, -), not '$NAME'"
[[ $IMAGE =~ ^[^[:space:]\"\\]+$ ]] || die "--image has spaces or quotes: '$IMAGE'"
VERB=train
if [[ $# -gt 0 && $1 != -* ]]; then VERB=$1; shift; fi
COORD=$NAME-0.$NAME:1234

if [[ -n $PLAN ]]; then
  for ((i = 0; i < PODS; i++)); do
    echo "process $i/$PODS on pod $NAME-$i: coordinator=$COORD process_id=$i num_processes=$PODS" \
      "JOB_COMPLETION_INDEX=$i gpus=$GPUS"
  done
  exit 0
fi

ARGS="[$(yaml_str "$VERB")"
for a in --distributed --coordinator "$COORD" --num-processes "$PODS" "$@"; do ARGS+=", $(yaml_str "$a")"; done
ARGS+="]"
shopt -u patsub_replacement 2>/dev/null || true  # bash 5.2: "&" in a replacement is literal again
manifest=$(<"$(dirname "$0")/job.yaml")
manifest=${manifest//__NAME__/$NAME}
manifest=${manifest//__PODS__/$PODS}
manifest=${manifest//__GPUS__/$GPUS}
manifest=${manifest//__IMAGE__/$IMAGE}
manifest=${manifest//__ARGS__/$ARGS}
printf '%s\n' "$manifest"
