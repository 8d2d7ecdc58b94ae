"""The LangChain skins' async calls (``ainvoke`` -> ``_agenerate``) run the model at the configured torch thread
count, as every other worker thread does (issue 26: worker threads start at OpenMP's default, so a threaded call
summed in another order than the same call made sequentially). ``_agenerate`` went through langchain_core's
``run_in_executor``, which does not apply it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

SCRIPT = r"""
import asyncio, ctypes, json, os
import torch
omp = ctypes.CDLL(os.path.join(os.path.dirname(torch.__file__), "lib", "libgomp.so.1"))  # torch's own OpenMP
from kvboost_core.engine import KVEngine
from kvboost_rag.app import demo_data as dd
from langchain_kvboost import ChatKVBoost, KVBoostLLM

torch.set_num_threads(1)  # the configured count; OMP_NUM_THREADS=4 is every new thread's default
engine = KVEngine.from_pretrained(str(dd.DEMO_MODEL_DIR), device="cpu")
seen = {}
for name, cls in (("chat", ChatKVBoost), ("llm", KVBoostLLM)):
    model = cls(engine=engine, max_tokens=2)
    real = model.rag.generate

    def generate(*a, _real=real, _name=name, **kw):
        seen[_name] = omp.omp_get_max_threads()  # what OpenMP uses in the thread running the model
        return _real(*a, **kw)

    model.rag.generate = generate
    asyncio.run(model.ainvoke("Hello"))
print(json.dumps(seen))
"""


@pytest.mark.timeout(600)
def test_langchain_async_calls_run_at_the_configured_thread_count():
    pytest.importorskip("langchain_core")
    from kvboost_rag.app import demo_data as dd

    if not dd.demo_model_available():
        pytest.skip("the embedded demo model is missing")
    env = dict(os.environ, OMP_NUM_THREADS="4", PYTHONPATH=os.pathsep.join([str(ROOT), str(ROOT / "integrations")]))
    res = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, env=env, timeout=600)
    assert res.returncode == 0, res.stderr[-3000:]
    assert json.loads(res.stdout.strip().splitlines()[-1]) == {"chat": 1, "llm": 1}
