#!/bin/sh
# The prepared GPU check (scripts/gpu_check.py): e.g. scripts/gpu_check.sh --wheels gpu_wheels
exec python3 "$(dirname "$0")/gpu_check.py" "$@"
