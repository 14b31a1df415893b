"""Ray Serve LLM's P/D app (``build_pd_openai_app``, its default connector backend) serving our
MooncakeConnector on a two-node local Ray cluster: token-equal to a plain vLLM, every prompt by
transfer, no pull failure. Needs ``ray[serve]`` (``make test-ray`` runs it in its own venv); skipped
where Ray Serve LLM is not installed, so ``make test`` does not pay its ~4 minutes.
"""

from __future__ import annotations

import pytest

pytest.importorskip("ray.serve.llm")

from harness import ray_pd

pytestmark = pytest.mark.servers


def test_ray_serve_pd_app_serves_the_pair_token_equal():
    s = ray_pd.main(["--requests", "16", "--concurrency", "8"])
    assert "error" not in s, s
    assert s["requests"] == 16 and s["token_equal"] == 16, s["unequal"]
    assert s["pull_failures"] == 0 and s["pulls"] >= 16, s
    assert s["tokens_by_transfer"] >= 0.99 * s["prompt_tokens"] > 0, s
