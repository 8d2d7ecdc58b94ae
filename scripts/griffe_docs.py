"""A griffe extension for the API reference (mkdocs.yml loads it): what the source says, shown on the page.

- **Sphinx roles.** Docstrings cross-reference with ``:class:`X```, ``:func:`X```, ``:mod:`X``` and friends;
  mkdocstrings renders those as literal text. Each becomes inline code of the name (``~`` keeps the last part).
- **Field comments.** Dataclass fields and class attributes are documented by ``#`` comments (the block right
  above a field, or a trailing one on its line), which griffe does not read, so ``EngineConfig`` or
  ``WarmReport`` rendered as empty entries. A field without a docstring takes its comment as one.
- **One-concept modules.** A class or function without a docstring of its own, in a module whose docstring
  describes it (``store/memory.py`` and ``MemoryStore``), takes the module's docstring when mkdocs.yml names it
  in ``module_docs`` (its defining path). Named, not guessed: a module about several things keeps its docstring.

Nothing is invented: every text on the page is in the source. ``tests/test_docs.py`` builds the site and fails
on an empty entry or a literal role.
"""

from __future__ import annotations

import io
import re
import tokenize
from collections.abc import Iterator
from typing import Any

import griffe

ROLE = re.compile(r":(?:py:)?(?:mod|class|func|meth|attr|data|exc|obj|const|term|ref):`~?([^`<]+?)(?:\s*<[^>]*>)?`")
# comments that are tool directives, not documentation
DIRECTIVE = re.compile(r"^(noqa|type:|pragma|fmt:|pyright:|mypy:)")


def strip_roles(text: str) -> str:
    """``:class:`~a.b.C``` -> ```C```, ``:func:`f``` -> ```f```."""
    def code(m: re.Match[str]) -> str:
        whole = m.group(0)
        name = m.group(1).strip()
        return f"`{name.rsplit('.', 1)[-1] if '`~' in whole else name}`"

    return ROLE.sub(code, text)


def _inline_comment(line: str) -> str:
    try:
        tokens = list(tokenize.generate_tokens(io.StringIO(line).readline))
    except (tokenize.TokenError, IndentationError, SyntaxError):
        return ""
    for tok in tokens:
        if tok.type == tokenize.COMMENT:
            return tok.string.lstrip("#").strip()
    return ""


def field_comment(lines: list[str], lineno: int) -> str:
    """The comment block right above line ``lineno`` (1-based) and its trailing comment, directives left out."""
    above: list[str] = []
    i = lineno - 2
    while i >= 0 and lines[i].strip().startswith("#"):
        above.insert(0, lines[i].strip().lstrip("#").strip())
        i -= 1
    parts = [" ".join(p for p in above if p)] + [_inline_comment(lines[lineno - 1])]
    parts = [p for p in parts if p and not DIRECTIVE.match(p)]
    return "; ".join(parts)


def _walk(obj: Any) -> Iterator[Any]:
    for member in list(obj.members.values()):
        if member.is_alias:
            continue
        yield member
        if member.is_module or member.is_class:
            yield from _walk(member)


class SourceDocs(griffe.Extension):
    """Roles to code, field comments to docstrings, module docstrings to the objects named in ``module_docs``."""

    def __init__(self, module_docs: list[str] | None = None) -> None:
        super().__init__()
        self.module_docs = set(module_docs or ())

    def on_package(self, *, pkg: Any, **kwargs: Any) -> None:
        for obj in [pkg, *_walk(pkg)]:
            if obj.path in self.module_docs and obj.docstring is None and obj.module.docstring is not None:
                obj.docstring = griffe.Docstring(obj.module.docstring.value, lineno=obj.lineno, parent=obj)
            if obj.is_attribute and obj.parent is not None and obj.parent.is_class and obj.docstring is None:
                self._comment_docstring(obj)
        for obj in [pkg, *_walk(pkg)]:
            if obj.docstring is not None and ":" in obj.docstring.value:
                obj.docstring.value = strip_roles(obj.docstring.value)

    @staticmethod
    def _comment_docstring(attr: Any) -> None:
        if attr.name.startswith("_") or attr.lineno is None or attr.filepath is None:
            return
        try:
            lines = attr.lines_collection[attr.filepath]
        except KeyError:
            return
        text = field_comment(lines, attr.lineno)
        if text:
            attr.docstring = griffe.Docstring(text, lineno=attr.lineno, parent=attr)
