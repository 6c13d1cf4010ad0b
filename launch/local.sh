#!/usr/bin/env bash
# One machine, all local devices (CPU or GPUs), one process: any lm verb with its arguments.
#   launch/local.sh [VERB] [lm args...]        (VERB defaults to train)
#   launch/local.sh --config configs/tiny.py --workdir runs/local
# DRY_RUN=1 prints the commands and runs nothing.
set -euo pipefail
cd "$(dirname "$0")/.."
# shellcheck source-path=SCRIPTDIR/..
source launch/lib.sh

VERB=train
if [[ $# -gt 0 && $1 != -* ]]; then VERB=$1; shift; fi
echo "process 0/1 on this machine: single process, all local devices"
run make -s install
run_last .venv/bin/lm "$VERB" "$@"
