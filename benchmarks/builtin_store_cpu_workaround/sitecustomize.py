"""Runtime workaround for vLLM's own MooncakeStoreConnector on CPU-only torch (benchmark only).

vLLM 0.32's store connector marks each step's saves with ``torch.cuda.Event()`` in its worker's
``wait_for_save`` (and its send thread calls ``synchronize()`` on it before the put); on a
CPU-only torch constructing that event raises "Tried to instantiate dummy base class Event" and
the worker dies at the first prefill. This module is put on ``PYTHONPATH`` of that connector's
servers only (by ``benchmarks.pool``), so Python imports it at startup; without CUDA it makes
``torch.cuda.Event`` an event that is always complete. That is what the event means on CPU: the
forward pass has finished writing the KV cache when vLLM calls ``wait_for_save``. vLLM's installed
files are not touched.
"""

import torch

if not torch.cuda.is_available():

    class _CompletedEvent:
        def __init__(self, *args, **kwargs) -> None:
            pass

        def record(self, stream=None) -> None:
            pass

        def synchronize(self) -> None:
            pass

        def wait(self, stream=None) -> None:
            pass

        def query(self) -> bool:
            return True

    torch.cuda.Event = _CompletedEvent
