# Sourced by the launchers. DRY_RUN=1 (anything but empty or 0) prints what would run and runs
# nothing; otherwise the same lines are printed, then run, so a job's log shows them too.
# shellcheck shell=bash

dry_run() { [[ -n ${DRY_RUN:-} && $DRY_RUN != 0 ]]; }

# One shell-quoted line per command, "+ " first: copy-pasteable, and stable for grep.
show() {
  local out="+" a sq="'" esc="'\\''"
  for a in "$@"; do
    if [[ $a =~ ^[A-Za-z0-9_./:=,@%+-]+$ ]]; then out+=" $a"; else out+=" '${a//$sq/$esc}'"; fi
  done
  printf '%s\n' "$out"
}

run() { show "$@"; dry_run || "$@"; }

# The last command: exec'd, so signals (preemption, Ctrl-C) reach it directly.
run_last() {
  show "$@"
  if dry_run; then exit 0; fi
  exec "$@"
}

die() { printf '%s: %s\n' "$(basename "$0")" "$1" >&2; exit 2; }
