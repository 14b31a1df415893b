"""Another vLLM release's Python sources, for the contract test and by hand.

vLLM's PyPI wheels are CUDA builds that do not install on a CPU host, so a release is read as
files: ``pip download vllm==X --no-deps`` into a cache outside the repository
(``$MOONCAKE_VLLM_WHEEL_CACHE``, default ``~/.cache/mooncake-vllm/wheels``), and only its ``.py``
files and ``dist-info`` unpacked beside it. ``vllm_glue.probe_files`` then reads them.

    python -m harness.vllm_release 0.33.0   # the probes' verdict on that release
"""

from __future__ import annotations

import os
import subprocess
import sys
import zipfile
from pathlib import Path

from mooncake_vllm.vllm_glue import VllmFiles, probe_files

DOWNLOAD_TIMEOUT_S = 600


class ReleaseUnavailable(RuntimeError):
    """The wheel is neither cached nor downloadable (no index reachable)."""


def cache_dir() -> Path:
    default = Path.home() / ".cache" / "mooncake-vllm" / "wheels"
    return Path(os.environ.get("MOONCAKE_VLLM_WHEEL_CACHE", default))


def release_files(version: str) -> VllmFiles:
    """The release's sources, unpacked once into ``cache_dir()/vllm-<version>``; downloads the
    wheel (~340 MB) if it is not cached. Raises ``ReleaseUnavailable`` naming pip's answer."""
    root = cache_dir() / f"vllm-{version}"
    if not (root / "vllm" / "__init__.py").is_file():
        wheel = _wheel(version)
        tmp = root.with_name(root.name + ".partial")
        with zipfile.ZipFile(wheel) as zf:
            names = [
                n
                for n in zf.namelist()
                if (n.startswith("vllm/") and n.endswith(".py")) or ".dist-info/" in n
            ]
            zf.extractall(tmp, names)
        tmp.rename(root)  # complete or absent: an interrupted unpack is redone
    return VllmFiles(root)


def _wheel(version: str) -> Path:
    cache = cache_dir()
    cache.mkdir(parents=True, exist_ok=True)
    found = sorted(cache.glob(f"vllm-{version}-*.whl"))
    if found:
        return found[0]
    cmd = [sys.executable, "-m", "pip", "download", f"vllm=={version}", "--no-deps"]
    cmd += ["--only-binary", ":all:", "-d", str(cache)]
    try:
        done = subprocess.run(
            cmd, capture_output=True, text=True, timeout=DOWNLOAD_TIMEOUT_S, cwd=cache
        )
    except subprocess.TimeoutExpired as e:
        raise ReleaseUnavailable(f"pip download vllm=={version} took over {e.timeout} s") from e
    found = sorted(cache.glob(f"vllm-{version}-*.whl"))
    if done.returncode != 0 or not found:
        last = (done.stderr or done.stdout).strip().splitlines()[-1:] or ["no output"]
        raise ReleaseUnavailable(f"pip download vllm=={version} failed: {last[0]}")
    return found[0]


def main() -> int:
    version = sys.argv[1] if len(sys.argv) > 1 else "0.33.0"
    files = release_files(version)
    found = probe_files(files)
    print(f"vLLM {found.version} at {files.root}")
    for name, why in found.failures.items():
        print(f"  {name}: {why}")
    print("every probe passed" if not found.failures else f"{len(found.failures)} failed")
    return 1 if found.failures else 0


if __name__ == "__main__":
    raise SystemExit(main())
