"""kvboost_core's boundary, read from the source with ``ast`` (nothing heavy is imported):

- code outside kvboost_core (the RAG library, the app, the integrations, benchmarks, examples) never touches a
  private attribute of an engine: what it needs is public (``eos_token_ids``, ``warm_prefix_ids``, ``encode``);
- every kvboost_core module stays under the size one concept takes (exemptions carry a reason and a cap);
- the names ``kvboost_core`` exports resolve.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
OUTSIDE = ("kvboost_rag", "integrations", "benchmarks", "examples")
ENGINE_NAMES = {"engine", "eng", "kv_engine"}  # how code outside kvboost_core names a KVEngine
MAX_LINES = 420
# the package KVEngine is assembled from (kvboost_core/engine: base, prefill, warming, generation, exact_history,
# kvengine): the only modules that read its private state
ENGINE = ROOT / "kvboost_core" / "engine"
# module -> (cap, why). A cap is the module's size when it was exempted: it may shrink, never grow.
EXEMPT: dict[str, tuple[int, str]] = {}  # none today (store/disk.py and redis_tier.py were split)


def _engine_private_names() -> set[str]:
    """Private attributes and methods KVEngine defines, in any of the modules it is assembled from."""
    names = set()
    for path in sorted(ENGINE.glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "self":
                attr = node.attr
            elif isinstance(node, (ast.FunctionDef, ast.AnnAssign)):
                attr = node.name if isinstance(node, ast.FunctionDef) else getattr(node.target, "id", "")
            else:
                continue
            if attr.startswith("_") and not attr.startswith("__"):
                names.add(attr)
    return names


def private_engine_uses(source: str, private: set[str]) -> list[tuple[int, str]]:
    """(line, expression) of every ``<engine>._x``: ``_x`` read on a name or attribute called engine/eng, or any
    of KVEngine's own private names read on anything but ``self``/``cls``."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if not isinstance(node, ast.Attribute) or not node.attr.startswith("_") or node.attr.startswith("__"):
            continue
        base = node.value
        base_name = base.id if isinstance(base, ast.Name) else base.attr if isinstance(base, ast.Attribute) else ""
        if base_name in ENGINE_NAMES or (node.attr in private and base_name not in ("self", "cls")):
            found.append((node.lineno, ast.unparse(node)))
    return found


def _outside_files() -> list[Path]:
    return [p for top in OUTSIDE if (ROOT / top).is_dir() for p in sorted((ROOT / top).rglob("*.py"))]


def test_the_engine_private_names_are_found():
    private = _engine_private_names()
    assert {"_eos", "_warm_prefix", "_counters", "_prefill", "_run", "_tok_lock"} <= private
    assert len(_outside_files()) > 50


def test_nothing_outside_kvboost_core_reads_an_engine_private():
    private = _engine_private_names()
    bad = [f"{p.relative_to(ROOT)}:{line}: {expr}" for p in _outside_files()
           for line, expr in private_engine_uses(p.read_text(), private)]
    assert bad == [], "use KVEngine's public API (add a read-only property if one is missing):\n" + "\n".join(bad)


def test_kvboost_core_drives_the_engine_through_its_declared_stages():
    """Inside kvboost_core too, only the engine's own modules read its private state: canonical, batch,
    fidelity, autocalib and the rest use the public names kvboost_core.stages.EngineStages declares."""
    private = _engine_private_names()
    files = [p for p in sorted((ROOT / "kvboost_core").rglob("*.py")) if ENGINE not in p.parents]
    bad = [f"{p.relative_to(ROOT)}:{line}: {expr}" for p in files
           for line, expr in private_engine_uses(p.read_text(), private)]
    assert len(files) > 30 and bad == [], "use kvboost_core.stages.EngineStages:\n" + "\n".join(bad)


@pytest.mark.parametrize(("source", "expected"), [
    ("x = engine._eos\n", ["engine._eos"]),
    ("x = set(rag.engine._encode(t))\n", ["rag.engine._encode"]),
    ("x = self.engine._counters.snapshot()\n", ["self.engine._counters"]),
    ("x = llm._kv._warm_prefix\n", ["llm._kv._warm_prefix"]),  # a KVEngine private under another name
    ("x = self._warm_prefix\n", []),  # a class's own attribute
    ("x = engine.eos_token_ids\ny = rag._encode_doc\nz = engine.__class__\n", []),
])
def test_the_check_catches_what_it_forbids(source, expected):
    assert [e for _, e in private_engine_uses(source, {"_eos", "_warm_prefix", "_counters", "_encode"})] == expected


def test_every_kvboost_core_module_is_under_the_line_limit():
    over = []
    for path in sorted((ROOT / "kvboost_core").rglob("*.py")):
        rel = path.relative_to(ROOT / "kvboost_core").as_posix()
        n = len(path.read_text().splitlines())
        cap = EXEMPT[rel][0] if rel in EXEMPT else MAX_LINES
        if n > cap:
            over.append(f"kvboost_core/{rel}: {n} lines (limit {cap})")
    assert over == [], "split by concept:\n" + "\n".join(over)


def test_every_library_app_and_integration_module_is_under_the_line_limit():
    """The same size rule for the RAG library, its application layer and the two integrations."""
    over = []
    for top in ("kvboost_rag", "integrations"):
        for path in sorted((ROOT / top).rglob("*.py")):
            n = len(path.read_text().splitlines())
            if n > MAX_LINES:
                over.append(f"{path.relative_to(ROOT).as_posix()}: {n} lines (limit {MAX_LINES})")
    assert over == [], "split by concept:\n" + "\n".join(over)


def test_the_exemptions_are_still_needed():
    for rel, (cap, why) in EXEMPT.items():
        n = len((ROOT / "kvboost_core" / rel).read_text().splitlines())
        assert MAX_LINES < n <= cap and why, f"{rel} is {n} lines: drop or lower its exemption"


def test_the_public_names_resolve():
    import kvboost_core

    for name in kvboost_core.__all__:
        assert getattr(kvboost_core, name) is not None, name
    from kvboost_core.engine import KVEngine

    assert kvboost_core.KVEngine is KVEngine
    for prop in ("eos_token_ids", "warm_prefix_ids", "tokenizer_lock"):
        assert isinstance(getattr(KVEngine, prop), property), prop
