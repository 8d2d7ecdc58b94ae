"""The layering, read from the source with ``ast`` (nothing is imported, so it takes well under a second).

kvboost_core <- kvboost_rag (library) <- integrations <- kvboost_rag.app (CLI, demos, benches, server): each
imports only what is to its left. Lazy imports inside functions count, and so does a string naming a module
(``importlib.import_module("...")``, a lazy-exports table). Separately, no two modules import each other, even
lazily; imports of a package's ``__init__`` are left out of that check (a package face that hands names on).
Inside kvboost_core its groups import one way too: model/ <- the flat modules (with store/, kernels/) <- lora/ <-
serving/, tuning/ <- the engine shell, engine/ (``test_kvboost_core_groups_import_one_way``).
"""

from __future__ import annotations

import ast
import re
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
INTEGRATIONS = ("langchain_kvboost", "llama_index.llms.kvboost")
APP = "kvboost_rag.app"


def _modules() -> dict[str, Path]:
    """Dotted module name -> file, for kvboost_core, kvboost_rag and the two integrations."""
    out = {}
    for root, tops in ((ROOT, ("kvboost_core", "kvboost_rag")),
                       (ROOT / "integrations", ("langchain_kvboost", "llama_index"))):
        for top in tops:
            for path in sorted((root / top).rglob("*.py")):
                parts = list(path.relative_to(root).with_suffix("").parts)
                out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return out


def _is_type_checking(node: ast.If) -> bool:
    t = node.test
    return getattr(t, "id", None) == "TYPE_CHECKING" or getattr(t, "attr", None) == "TYPE_CHECKING"


def imported_names(source: str, module: str, is_package: bool = False, *,
                   type_checking: bool = True) -> Iterator[str]:
    """Every module path ``source`` may load: ``import a.b``, ``from a import b`` (as a and a.b), relative
    imports resolved against ``module``, and string constants that are a whole dotted name."""
    package = module if is_package else module.rpartition(".")[0]

    def visit(node: ast.AST) -> Iterator[str]:
        if isinstance(node, ast.If) and _is_type_checking(node) and not type_checking:
            for child in node.orelse:
                yield from visit(child)
            return
        if isinstance(node, ast.Import):
            yield from (a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")
                base = ".".join(parts[: len(parts) - node.level + 1] + ([node.module] if node.module else []))
            yield base
            yield from (f"{base}.{a.name}" for a in node.names)
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and re.fullmatch(
                r"[A-Za-z_]\w*(\.\w+)+", node.value):
            yield node.value
        for child in ast.iter_child_nodes(node):
            yield from visit(child)

    yield from visit(ast.parse(source))


def _under(name: str, prefix: str) -> bool:
    return name == prefix or name.startswith(prefix + ".")


def violations(modules: dict[str, Path]) -> list[str]:
    bad = []
    for mod, path in modules.items():
        if _under(mod, "kvboost_core"):
            banned: tuple[str, ...] = ("kvboost_rag", *INTEGRATIONS)
        elif _under(mod, APP):
            continue
        elif _under(mod, "kvboost_rag"):
            banned = (APP, *INTEGRATIONS)
        else:  # the integrations
            banned = (APP,)
        names = imported_names(path.read_text(), mod, path.name == "__init__.py")
        bad += sorted({f"{mod} -> {n}" for n in names if any(_under(n, b) for b in banned)})
    return bad


def cycles(modules: dict[str, Path]) -> list[list[str]]:
    """Strongly connected groups of more than one module (Tarjan), over every import but TYPE_CHECKING ones."""
    def resolve(name: str) -> str:
        while name and name not in modules:
            name = name.rpartition(".")[0]
        return name

    graph = {m: {r for n in imported_names(p.read_text(), m, p.name == "__init__.py", type_checking=False)
                 if (r := resolve(n)) and r != m and modules[r].name != "__init__.py"}
             for m, p in modules.items()}
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found = []

    def connect(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in graph[v]:
            if w not in index:
                connect(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = [stack.pop()]
            while group[-1] != v:
                group.append(stack.pop())
            if len(group) > 1:
                found.append(sorted(group))

    for v in sorted(graph):
        if v not in index:
            connect(v)
    return found


def test_the_tree_is_found():
    mods = _modules()
    for name in ("kvboost_core.engine", "kvboost_rag.rag", "kvboost_rag.app.cli", "langchain_kvboost",
                 "llama_index.llms.kvboost.base"):
        assert name in mods


def test_imports_run_one_way():
    assert violations(_modules()) == []


def test_no_import_cycles():
    assert cycles(_modules()) == []


# kvboost_core's groups: what each may not import (the package face kvboost_core/__init__.py hands names on and is
# left out). The flat modules, store/ and kernels/ are "core"; model/ stands on two of its leaves alone.
CORE_GROUPS = ("engine", "serving", "model", "lora", "tuning")
MODEL_LEAVES = ("kvboost_core.rope", "kvboost_core.config")
FORBIDDEN = {
    "core": {"engine", "serving", "lora", "tuning"},
    "model": {"core", "engine", "serving", "lora", "tuning"},  # but MODEL_LEAVES
    "lora": {"engine", "serving", "tuning"},
    "tuning": {"engine", "serving"},
    "serving": {"engine", "lora", "tuning"},
    "engine": set(),
}


def core_group(name: str) -> str:
    """The group of a kvboost_core module path: a subpackage of CORE_GROUPS, else "core"."""
    return next((g for g in CORE_GROUPS if _under(name, f"kvboost_core.{g}")), "core")


def _group_allows(mod: str, name: str) -> bool:
    if not _under(name, "kvboost_core") or name == "kvboost_core":
        return True
    if core_group(mod) == "model" and any(_under(name, leaf) for leaf in MODEL_LEAVES):
        return True
    return core_group(name) not in FORBIDDEN[core_group(mod)]


def group_violations(modules: dict[str, Path]) -> list[str]:
    bad = []
    for mod, path in modules.items():
        if _under(mod, "kvboost_core") and mod != "kvboost_core":
            names = imported_names(path.read_text(), mod, path.name == "__init__.py")
            bad += sorted({f"{mod} -> {n}" for n in names if not _group_allows(mod, n)})
    return bad


def test_kvboost_core_groups_import_one_way():
    """kvboost_core's groups, bottom up: model/ (the decoder driven layer by layer: driver, attention, forward,
    replay, slices, weights) imports of kvboost_core only the leaves rope and config; the flat modules (the cache
    pipeline and the shared values) with store/ and kernels/ may import model/; lora/ (adapter weights and the
    block prefill) imports neither the engine shell nor serving nor tuning; serving/ (batch, invariant, canonical,
    backfill) and tuning/ (fidelity, calibration) read the engine only as stages.EngineStages and import neither
    each other nor the shell; the engine shell (engine/: base, prefill, warming, generation, exact_history,
    kvengine) sits on top, and nothing in kvboost_core imports it, serving or tuning but the shell itself."""
    mods = _modules()
    assert {"kvboost_core.engine.kvengine", "kvboost_core.serving.batch", "kvboost_core.model.forward",
            "kvboost_core.lora.block_adapter", "kvboost_core.tuning.fidelity", "kvboost_core.assembly"} <= set(mods)
    assert group_violations(mods) == []


@pytest.mark.parametrize(("module", "source", "expected"), [
    ("kvboost_core.model.forward", "from kvboost_core.serving import slices\n",
     ["kvboost_core.model.forward -> kvboost_core.serving", "kvboost_core.model.forward -> kvboost_core.serving.slices"]),
    ("kvboost_core.model.driver", "from kvboost_core.rope import rotate\nfrom kvboost_core.model import attention\n",
     []),
    ("kvboost_core.model.driver", "from kvboost_core.keys import Fingerprint\n",
     ["kvboost_core.model.driver -> kvboost_core.keys", "kvboost_core.model.driver -> kvboost_core.keys.Fingerprint"]),
    ("kvboost_core.serving.batch", "def f():\n    from kvboost_core.engine import KVEngine\n",
     ["kvboost_core.serving.batch -> kvboost_core.engine",
      "kvboost_core.serving.batch -> kvboost_core.engine.KVEngine"]),
    ("kvboost_core.repair", "from kvboost_core.model.forward import Schedule\n", []),
    ("kvboost_core.assembly", "import kvboost_core.tuning.fidelity\n",
     ["kvboost_core.assembly -> kvboost_core.tuning.fidelity"]),
    ("kvboost_core", "_LAZY = {'KVEngine': 'kvboost_core.engine'}\n", []),
    ("kvboost_core.engine.prefill", "from kvboost_core.serving.canonical import CanonicalJob\n", []),
])
def test_the_group_check_catches_what_it_forbids(tmp_path, module, source, expected):
    path = tmp_path / "m.py"
    path.write_text(source)
    assert group_violations({module: path}) == expected


def test_the_cli_is_imported_by_no_other_module():
    """The CLI imports the benches and the server; what they share with it lives in app.loading."""
    mods = _modules()
    # runs `python -m kvboost_rag.app.cli serve` in a subprocess (the server tests and benchmarks): not an import
    launchers = {f"{APP}.server.launch"}
    users = [m for m, p in mods.items() if m != f"{APP}.cli" and m not in launchers
             and any(_under(n, f"{APP}.cli") and not _under(n, f"{APP}.cli_")
                     for n in imported_names(p.read_text(), m, p.name == "__init__.py"))]
    assert users == []


@pytest.mark.parametrize(("module", "source", "expected"), [
    ("kvboost_rag.documents", "def f():\n    from langchain_kvboost import ChatKVBoost\n",
     ["kvboost_rag.documents -> langchain_kvboost", "kvboost_rag.documents -> langchain_kvboost.ChatKVBoost"]),
    ("kvboost_rag.x", "from .app import cli\n", ["kvboost_rag.x -> kvboost_rag.app", "kvboost_rag.x -> kvboost_rag.app.cli"]),
    ("kvboost_rag.x", "import importlib\nimportlib.import_module('llama_index.llms.kvboost')\n",
     ["kvboost_rag.x -> llama_index.llms.kvboost"]),
    ("kvboost_core.y", "if TYPE_CHECKING:\n    from kvboost_rag.rag import KVBoostRAG\n",
     ["kvboost_core.y -> kvboost_rag.rag", "kvboost_core.y -> kvboost_rag.rag.KVBoostRAG"]),
    ("kvboost_rag.app.z", "from langchain_kvboost import ChatKVBoost\n", []),
    ("langchain_kvboost.w", "from kvboost_rag.app.cli import main\n",
     ["langchain_kvboost.w -> kvboost_rag.app.cli", "langchain_kvboost.w -> kvboost_rag.app.cli.main"]),
])
def test_the_checks_catch_what_they_forbid(tmp_path, module, source, expected):
    path = tmp_path / "m.py"
    path.write_text(source)
    assert violations({module: path}) == expected


def test_the_cycle_check_finds_a_lazy_cycle(tmp_path):
    (tmp_path / "a.py").write_text("from kvboost_core import b\n")
    (tmp_path / "b.py").write_text("def f():\n    import kvboost_core.a\n")
    (tmp_path / "c.py").write_text("if TYPE_CHECKING:\n    from kvboost_core.a import x\nimport kvboost_core.b\n")
    mods = {f"kvboost_core.{n}": tmp_path / f"{n}.py" for n in "abc"}
    assert cycles(mods) == [["kvboost_core.a", "kvboost_core.b"]]


def test_the_payload_kinds_import_one_way():
    """The serializer imports the quantized payload at load time (payload <- quant <- store.serialize), so quant
    must not import the store package: its ``__init__`` imports the serializer, a cycle that passes through a
    package face and so escapes ``test_no_import_cycles``."""
    mods = _modules()
    quant = set(imported_names(mods["kvboost_core.quant"].read_text(), "kvboost_core.quant"))
    assert not any(_under(n, "kvboost_core.store") for n in quant)
    assert not any(_under(n, "kvboost_core.store") for n in
                   imported_names(mods["kvboost_core.payload"].read_text(), "kvboost_core.payload"))
