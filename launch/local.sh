#!/usr/bin/env bash
# One machine, all local devices (CPU or GPUs): lm train with any extra arguments.
#   launch/local.sh --config configs/tiny.py --workdir runs/local
set -euo pipefail
cd "$(dirname "$0")/.."
make install >/dev/null
exec .venv/bin/lm train "$@"
