"""Run the proxy from a checkout: ``python proxy/proxy_server.py --prefill URL --decode URL``.

Same as the ``mooncake-vllm-proxy`` command; see ``--help``.
"""

import sys
from pathlib import Path

try:
    import mooncake_vllm  # noqa: F401
except ImportError:  # not installed: use the checkout this script lives in
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from mooncake_vllm.proxy.server import main

if __name__ == "__main__":
    main()
