#!/usr/bin/env bash
# A tool that runs in a venv of its own, apart from the shared one (its pins clash with ours):
#   setup_tool.sh VENV REQUIREMENT COMMAND [ARGS...]
# installs REQUIREMENT from PyPI into VENV, checks that VENV/bin/COMMAND ARGS runs, and stamps
# VENV so the next call returns at once. Used by `make test-router` (vllm-router),
# `make bench-aiperf` (aiperf) and `make bench-guidellm` (guidellm).
set -euo pipefail
venv=${1:?venv}
requirement=${2:?requirement}
shift 2
stamp="$venv/.mooncake-vllm-tool-setup"
[ -f "$stamp" ] && [ "$(cat "$stamp")" = "$requirement" ] && exit 0
[ -x "$venv/bin/python" ] || python3 -m venv "$venv"
"$venv/bin/pip" install -q --disable-pip-version-check "$requirement"
"$venv/bin/$1" "${@:2}" >/dev/null
echo "$requirement" > "$stamp"
