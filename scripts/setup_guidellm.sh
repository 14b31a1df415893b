#!/usr/bin/env bash
# The venv `make bench-guidellm` takes guidellm from: guidellm 0.8.1 from PyPI, its own pins
# apart from the shared venv (benchmarks/guidellm_sweep.py runs its `guidellm` command).
set -euo pipefail
venv=${1:-$HOME/.cache/mooncake-vllm/guidellm-venv}
version=0.8.1
stamp="$venv/.mooncake-vllm-guidellm-setup"
[ -f "$stamp" ] && [ "$(cat "$stamp")" = "$version" ] && exit 0
[ -x "$venv/bin/python" ] || python3 -m venv "$venv"
"$venv/bin/pip" install -q --disable-pip-version-check "guidellm==$version"
"$venv/bin/guidellm" --version >/dev/null
echo "$version" > "$stamp"
