"""Fault injection for tests, kept out of the connector's code.

``freeze_after_grant_env`` gives a producer vLLM the environment under which its lease server
(``mooncake_vllm.p2p.leases.process``) freezes the producer's worker (SIGSTOP) right after granting
a lease and before the ``Granted`` reply leaves, once the test arms it by creating the trigger file:
a producer stopped mid-pull, with no race against the consumer's read. The injection is this
directory's ``sitecustomize.py``, which Python imports at the start of every process that has the
directory on its ``PYTHONPATH``; it acts only in the lease server.
"""

from __future__ import annotations

import os
from pathlib import Path

FAULTS_DIR = Path(__file__).resolve().parent
# Read by sitecustomize.py (which cannot import this package: the harness is not on its path).
FREEZE_TRIGGER_ENV = "MOONCAKE_VLLM_TEST_FREEZE_TRIGGER"


def freeze_after_grant_env(trigger: Path) -> dict[str, str]:
    """Environment for a producer vLLM: the first lease granted after ``trigger`` is created
    freezes that rank's worker, and the file is deleted (armed again by creating it again).
    The test sends SIGCONT to the frozen worker (``ManagedProcess.group_pids``, state ``T``)."""
    path = [str(FAULTS_DIR), *filter(None, [os.environ.get("PYTHONPATH")])]
    return {"PYTHONPATH": os.pathsep.join(path), FREEZE_TRIGGER_ENV: str(trigger)}
