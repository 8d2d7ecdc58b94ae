"""Importing an integration package is light: no torch, no transformers until an engine is built or loaded.

Run in a fresh interpreter each (the test process has torch loaded already), with the repository and its
``integrations/`` folder on the path as an installed wheel would put them.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
HEAVY = ("torch", "transformers")


def _heavy_after(statement: str) -> list[str]:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT / "integrations")])}
    code = f"{statement}\nimport sys\nprint(sorted(m for m in {HEAVY!r} if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=180, env=env,
                         cwd=ROOT)
    assert out.returncode == 0, out.stderr
    return eval(out.stdout.strip().splitlines()[-1])  # a list literal printed by the child


@pytest.mark.parametrize("statement", [
    "import langchain_kvboost",
    "from langchain_kvboost import ChatKVBoost, KVBoostLLM, KVWarmTransformer, KVHashEmbeddings",
])
def test_import_langchain_kvboost_loads_no_torch(statement):
    pytest.importorskip("langchain_core")
    assert _heavy_after(statement) == []


@pytest.mark.parametrize("statement", [
    "import llama_index.llms.kvboost",
    "from llama_index.llms.kvboost import KVBoostLLM, KVHashEmbedding, KVWarmer, StableOrderPostprocessor",
    "import llama_index.llms.kvboost.embeddings",
])
def test_import_llama_index_kvboost_loads_no_torch(statement):
    pytest.importorskip("llama_index.core")
    assert _heavy_after(statement) == []
