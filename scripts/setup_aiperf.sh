#!/usr/bin/env bash
# The venv `make bench-aiperf` takes NVIDIA's AIPerf from: aiperf 0.13.0 from PyPI, its own pins
# apart from the shared venv (benchmarks/aiperf_trace.py runs its `aiperf` command).
set -euo pipefail
venv=${1:-$HOME/.cache/mooncake-vllm/aiperf-venv}
version=0.13.0
stamp="$venv/.mooncake-vllm-aiperf-setup"
[ -f "$stamp" ] && [ "$(cat "$stamp")" = "$version" ] && exit 0
[ -x "$venv/bin/python" ] || python3 -m venv "$venv"
"$venv/bin/pip" install -q --disable-pip-version-check "aiperf==$version"
"$venv/bin/aiperf" --help >/dev/null
echo "$version" > "$stamp"
