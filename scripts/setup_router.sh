#!/usr/bin/env bash
# The venv `make test-router` takes vLLM's Rust router from: vllm-router 0.1.17 from PyPI (a
# binary wheel; its Python side pins fastapi/uvicorn of its own), never the shared venv.
set -euo pipefail
venv=${1:-$HOME/.cache/mooncake-vllm/router-venv}
version=0.1.17
stamp="$venv/.mooncake-vllm-router-setup"
[ -f "$stamp" ] && [ "$(cat "$stamp")" = "$version" ] && exit 0
[ -x "$venv/bin/python" ] || python3 -m venv "$venv"
"$venv/bin/pip" install -q --disable-pip-version-check "vllm-router==$version"
"$venv/bin/vllm-router" --help >/dev/null
echo "$version" > "$stamp"
