"""Packaging promises: light top-level imports, the names users reach for, warning-free metadata."""

from __future__ import annotations

import subprocess
import sys


def _modules_after(code: str) -> str:
    out = subprocess.run([sys.executable, "-c", code + "\nimport sys\nprint(sorted(m for m in ('torch', "
                          "'transformers', 'langchain_core', 'llama_index.core') if m in sys.modules))"],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    return out.stdout.strip().splitlines()[-1]


def test_import_kvboost_core_and_rag_is_light():
    assert _modules_after("import kvboost_core, kvboost_rag") == "[]"


def test_kvengine_from_the_top_level_package():
    import kvboost_core
    from kvboost_core import KVEngine
    from kvboost_core.engine import KVEngine as Direct

    assert KVEngine is Direct
    assert "KVEngine" in dir(kvboost_core) and "KVEngine" in kvboost_core.__all__
    from kvboost_rag import KVBoostRAG
    from kvboost_rag.adapter import KVBoostRAG as OldPath  # the module's former name keeps working
    from kvboost_rag.rag import KVBoostRAG as DirectRAG

    assert KVBoostRAG is DirectRAG is OldPath


def test_unknown_attribute_is_an_attribute_error():
    import pytest

    import kvboost_core
    import kvboost_rag

    with pytest.raises(AttributeError, match="Nope"):
        kvboost_core.Nope  # noqa: B018
    with pytest.raises(AttributeError, match="Nope"):
        kvboost_rag.Nope  # noqa: B018
