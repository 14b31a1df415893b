"""Runtime workaround for vLLM's built-in MooncakeConnector on CPU-only torch (benchmark only).

vLLM 0.32's built-in connector calls ``torch.accelerator.current_device_index()`` when its worker
starts; on a CPU-only torch that raises "Cannot access accelerator device when none is
available". This module is put on ``PYTHONPATH`` of the built-in connector's servers only (by
``benchmarks.serving``), so Python imports it at startup; it makes that one call answer device 0
when torch has no accelerator. vLLM's installed files are not touched, and nothing else changes:
``current_platform.set_device(0)`` is a no-op on vLLM's CPU platform.
"""

import torch

if not torch.accelerator.is_available():
    torch.accelerator.current_device_index = lambda: 0
