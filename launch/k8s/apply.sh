#!/usr/bin/env bash
# Renders the manifest (launch/k8s/render.sh, same arguments) and applies it with kubectl.
#   launch/k8s/apply.sh --image ghcr.io/you/lm:latest --pods 4 sft --config ... --workdir /shared/runs/sft
# DRY_RUN=1 prints each pod's settings, the kubectl command and the manifest it reads; runs nothing.
set -euo pipefail
here=$(dirname "$0")
# shellcheck source-path=SCRIPTDIR
source "$here/../lib.sh"

manifest=$(bash "$here/render.sh" "$@")
bash "$here/render.sh" --plan "$@"
echo "$(show kubectl apply -f -) <<'EOF'"
printf '%s\nEOF\n' "$manifest"
if dry_run; then exit 0; fi
exec kubectl apply -f - <<<"$manifest"
