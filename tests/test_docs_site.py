"""The built docs site: every API reference entry says something, no Sphinx role shows as literal text.

Builds the site once (``mkdocs build --strict``, a few seconds) into a temporary directory and reads the HTML.
"""

from __future__ import annotations

import html
import importlib.util
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
ROLE = re.compile(r":(?:py:)?(?:mod|class|func|meth|attr|data|exc|obj):\s*[\w~.]")
ROOT_ENTRY = re.compile(r'<h2 id="([\w.]+)" class="doc doc-heading">')


def _text(fragment: str) -> str:
    return html.unescape(re.sub(r"\s+", " ", re.sub(r"<[^>]+>", " ", fragment))).strip()


def _extension():
    spec = importlib.util.spec_from_file_location("griffe_docs", ROOT / "scripts" / "griffe_docs.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def site(tmp_path_factory):
    pytest.importorskip("mkdocs")
    pytest.importorskip("mkdocstrings_handlers.python")
    out = tmp_path_factory.mktemp("site")
    proc = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--quiet", "-d", str(out)],
                          cwd=ROOT, capture_output=True, text=True, timeout=300,
                          env={**__import__("os").environ, "NO_MKDOCS_2_WARNING": "1"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    return out


def _entries(page: str) -> dict[str, str]:
    """Each top-level API entry's HTML after its heading, up to the next top-level entry."""
    marks = list(ROOT_ENTRY.finditer(page))
    ends = [m.start() for m in marks[1:]] + [len(page)]
    return {m.group(1): page[page.index("</h2>", m.end()) + 5:end] for m, end in zip(marks, ends)}


def test_every_api_entry_has_a_docstring_or_documented_members(site):
    page = (site / "api" / "index.html").read_text(encoding="utf-8")
    entries = _entries(page)
    listed = re.findall(r"^::: ([\w.]+)", (ROOT / "docs" / "api.md").read_text(), re.M)
    assert sorted(entries) == sorted(listed)
    empty = [name for name, body in entries.items() if len(_text(body)) < 20]
    assert not empty, f"API entries with nothing but a heading: {empty}"
    for name in ("kvboost_core.EngineConfig", "kvboost_core.GenerationResult", "kvboost_core.WarmResult",
                 "kvboost_rag.PromptPlan", "kvboost_rag.WarmReport", "kvboost_rag.RegisteredDoc"):
        fields = re.findall(rf'<h3 id="{re.escape(name)}\.(\w+)"', entries[name])
        assert fields, f"{name} shows no documented field"
    # a field documented by a comment in the source is shown with it
    assert 'id="kvboost_core.EngineConfig.recompute_mass"' in entries["kvboost_core.EngineConfig"]
    for store in ("MemoryStore", "DiskStore", "RedisStore", "TieredStore", "build_store"):
        body = _text(entries[f"kvboost_core.store.{store}"])
        assert len(body) > 80, f"{store}: {body!r}"


def test_no_sphinx_role_renders_as_literal_text(site):
    for page in sorted(site.rglob("*.html")):
        text = _text(page.read_text(encoding="utf-8"))
        hits = [text[max(0, m.start() - 40):m.end() + 40] for m in ROLE.finditer(text)]
        assert not hits, f"{page.relative_to(site)}: literal Sphinx roles {hits[:5]}"


def test_the_extension_turns_roles_into_code_and_comments_into_field_docs():
    ext = _extension()
    assert ext.strip_roles("see :class:`~kvboost_core.CacheCounts` and :func:`doc_stats`") == \
        "see `CacheCounts` and `doc_stats`"
    assert ext.strip_roles(":param x: the x") == ":param x: the x"  # a field list is not a role
    lines = ["class C:", "    # the budget,", "    # in bytes", "    n: int = 1  # never negative",
             "    m: int = 2  # noqa: E501"]
    assert ext.field_comment(lines, 4) == "the budget, in bytes; never negative"
    assert ext.field_comment(lines, 5) == ""


def test_wide_tables_and_code_wrap_to_fit_1280_px(site):
    """The figures and LangChain pages had 8-column tables and 110-character code lines cut at 1280 px: every
    page loads the stylesheet that wraps table cells and code lines instead of hiding them behind a scrollbar."""
    css = (site / "stylesheets" / "extra.css").read_text(encoding="utf-8")
    rules = {sel.strip(): body for sel, body in re.findall(r"([^{}]+)\{([^{}]*)\}", re.sub(r"/\*.*?\*/", "", css,
                                                                                          flags=re.S))}
    assert "pre-wrap" in rules[".md-typeset pre > code"]
    cells = next(body for sel, body in rules.items() if sel.endswith("table:not([class]) td"))
    assert "overflow-wrap: anywhere" in cells
    assert "min-width: 0" in rules[".md-typeset table:not([class]) th"]  # Material's 5rem x 8 columns = 800 px
    for page in ("figures", "langchain"):
        assert "stylesheets/extra.css" in (site / page / "index.html").read_text(encoding="utf-8")
