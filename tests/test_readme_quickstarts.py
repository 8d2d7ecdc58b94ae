"""The README's Python quick starts run as written, each in a fresh interpreter (what a newcomer pastes).

The tiny-model ones always run; the real chat model's one (test id ``real_model``: ``make test-fast`` leaves it
out) runs where SmolLM2-135M-Instruct is installed."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from kvboost_core import zoo

ROOT = Path(__file__).resolve().parents[1]
BLOCKS = re.findall(r"```python\n(.*?)```", (ROOT / "README.md").read_text(), flags=re.S)


def _name(code: str) -> str:
    return "real_model" if "smollm2" in code else re.sub(r"\W+", "-", code.splitlines()[0])[:48]


def test_the_readme_has_its_quick_starts():
    assert len(BLOCKS) >= 4 and sum("smollm2" in b for b in BLOCKS) == 1


@pytest.mark.parametrize("code", BLOCKS, ids=[_name(b) for b in BLOCKS])
def test_quick_start_runs_as_written(code, tmp_path):
    if "smollm2" in code and not zoo.available("smollm2-135m-instruct"):
        pytest.skip(f"smollm2-135m-instruct is not installed ({zoo.SMOLLM2.install_hint})")
    env = dict(os.environ, HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1")
    out = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=env, capture_output=True, text=True,
                         timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.strip(), "a quick start prints its result"
