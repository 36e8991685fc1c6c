#!/usr/bin/env bash
# What only a GPU can show, measured in one short run (the day a GPU is lent; docs/nccl_evidence.md):
#   the recorder's started/completed states and times with TORCH_NCCL_ENABLE_TIMING=1 (world 1),
#   what timing costs (steps/s of a small all-reduce loop with and without), whether RAS
#   answers on its default port, whether NCCL takes 2 ranks on one GPU, and what a CUDA rank
#   blocked in a collective looks like to `moe-hang diagnose` (CPU, py-spy, RAS) — 2 ranks, one
#   skips an all-reduce, diagnosed, then killed.
#
#   scripts/gpu_check.sh [--dry] [OUT.json]     (default: $OUT/gpu_check.json, else ./gpu_check.json)
#
# Every step runs under `timeout` (the whole run stays under 5 minutes), writes one JSON file,
# prints a short table, and every process it started is killed at the end. Without a GPU (or
# with --dry) it only writes a JSON saying so, and exits 0.
set -u
cd "$(dirname "$0")/.."
DRY=""
DEST=""
for a in "$@"; do
  case "$a" in
    --dry) DRY="--dry given" ;;
    -h|--help) sed -n '2,13p' "$0"; exit 0 ;;
    *) DEST="$a" ;;
  esac
done
if [ -z "$DEST" ]; then DEST="${OUT:-.}/gpu_check.json"; fi
PY=python3
if [ -x .venv/bin/python ]; then PY=.venv/bin/python; fi
WORK="$(mktemp -d "${TMPDIR:-/tmp}/gpu_check.XXXXXX")"
touch "$WORK/pids"

cleanup() {
  # only what the steps recorded: pids they started (never a broad pkill)
  while read -r pid; do
    [ -n "$pid" ] && kill -9 "$pid" 2>/dev/null
  done < "$WORK/pids"
  rm -rf "$WORK"
}
trap cleanup EXIT
trap 'exit 143' TERM
trap 'exit 130' INT

if [ -z "$DRY" ]; then
  if ! command -v nvidia-smi >/dev/null 2>&1; then
    DRY="no nvidia-smi on PATH"
  elif ! timeout -k 5 20 nvidia-smi -L >/dev/null 2>&1; then
    DRY="nvidia-smi lists no GPU"
  elif ! timeout -k 5 40 "$PY" -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)' >/dev/null 2>&1; then
    DRY="torch sees no CUDA device (a CPU build, or no driver)"
  fi
fi
if [ -n "$DRY" ]; then
  "$PY" scripts/gpu_check.py combine "$WORK" "$DEST" --dry "$DRY"
  exit $?
fi

BUDGET=280  # seconds for everything, detection included: the run stays under 5 minutes
step() {  # step NAME SECONDS: at most SECONDS, and never past the budget
  local t=$2 left=$((BUDGET - SECONDS - 15))
  if [ "$left" -lt "$t" ]; then t=$left; fi
  if [ "$t" -lt 10 ]; then echo 125 > "$WORK/$1.rc"; return; fi
  timeout -k 5 "$t" "$PY" scripts/gpu_check.py "$1" "$WORK" >"$WORK/$1.out" 2>"$WORK/$1.err"
  echo $? > "$WORK/$1.rc"
}
step env 25
step single 75
step samegpu 45
step hang 120
"$PY" scripts/gpu_check.py combine "$WORK" "$DEST"
