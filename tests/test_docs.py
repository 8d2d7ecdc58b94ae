"""The README and the docs: figures rendered from the results files, the README's size, and the speedup wording.

The docs site itself is built with ``mkdocs build --strict`` by ``make docs`` (part of ``make test``), which
fails on a broken link, anchor or API reference.
"""

from __future__ import annotations

import importlib.util
import json
import re
import shutil
import sys
from pathlib import Path

import pytest

from kvboost_rag.app.fmt import ratio_speedup, speedup

ROOT = Path(__file__).resolve().parents[1]


def _renderer():
    spec = importlib.util.spec_from_file_location("render_figures", ROOT / "scripts" / "render_figures.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["render_figures"] = module  # dataclasses resolve their annotations through sys.modules
    spec.loader.exec_module(module)
    return module


rf = _renderer()


def test_committed_figures_match_their_results_files():
    """Every figure block in README.md and docs/ is what scripts/render_figures.py renders from the JSON."""
    assert rf.stale() == [], "run: python scripts/render_figures.py"


def test_every_marker_names_a_table_and_every_table_is_on_a_page():
    names = {t.name for t in rf.TABLES}
    used = set()
    for page in rf.pages():
        for m in rf.BLOCK.finditer(page.read_text()):
            assert m.group("name") in names, f"{page}: unknown block {m.group('name')}"
            used.add(m.group("name"))
    assert names == used, f"tables on no page: {sorted(names - used)}"
    # a marker that opens and never closes would swallow nothing and go unnoticed
    for page in rf.pages():
        text = page.read_text()
        assert text.count("<!-- figures:") == text.count("<!-- /figures -->"), page


def test_readme_headline_is_rendered_and_short():
    readme = (ROOT / "README.md").read_text()
    assert len(readme.splitlines()) <= 200
    block = re.search(r"<!-- figures:headline -->\n(.*?)<!-- /figures -->", readme, re.S)
    assert block and "95% CI" in block.group(1) and "SmolLM2-135M-Instruct" in block.group(1)
    assert "pip install kvboost-rag" not in readme  # not published on PyPI: install from a clone or git URL


def test_a_changed_result_makes_the_page_stale(tmp_path):
    """The check can fail: editing one figure in a copy of the results makes its page differ."""
    for rel in ("README.md", "docs", "benchmarks/results"):
        src = ROOT / rel
        (shutil.copytree if src.is_dir() else shutil.copyfile)(src, tmp_path / rel)
    assert rf.stale(tmp_path) == []
    path = tmp_path / "benchmarks/results/rag_eval.json"
    data = json.loads(path.read_text())
    data["summary"]["cacheblend-0.7"]["kl_mean"] = 0.5
    path.write_text(json.dumps(data))
    assert "docs/figures.md" in rf.stale(tmp_path)
    (tmp_path / "docs/figures/ttft.png").write_bytes(b"not the plot")
    assert "docs/figures/ttft.png" in rf.stale(tmp_path)


def test_a_missing_results_file_renders_an_empty_block(tmp_path):
    page = "<!-- figures:serve -->\nold\n<!-- /figures -->\n"
    assert rf.render_page(page, tmp_path) == "<!-- figures:serve -->\n<!-- /figures -->\n"
    with pytest.raises(SystemExit, match="names no table"):
        rf.render_page("<!-- figures:nope -->\n<!-- /figures -->\n", tmp_path)


def test_bootstrap_intervals_are_deterministic_and_cover_the_estimate():
    flags = [True] * 49 + [False] * 51
    rate, lo, hi = rf.rate_ci(flags)
    assert rate == 0.49 and lo < rate < hi and (lo, hi) == rf.rate_ci(flags)[1:]
    assert 0.08 < hi - lo < 0.25  # about +-10 points for 100 questions
    diff, dlo, dhi = rf.paired_diff_ci(flags, flags)
    assert diff == dlo == dhi == 0.0  # identical answers: no uncertainty in the difference
    point, slo, shi = rf.paired_speedup_ci([2.0] * 10, [1.0] * 10)
    assert point == slo == shi == 2.0


@pytest.mark.parametrize(("full", "reuse", "text"), [
    (1.27, 1.0, "1.27x faster"), (1.0, 1.27, "1.27x slower"), (1.0, 1.0, "1.00x faster"),
    (10.0866, 10.4193, "1.03x slower"), (1.0, 1.004, "1.00x faster"),
])
def test_speedup_wording(full, reuse, text):
    assert speedup(full, reuse) == text


def test_speedup_never_prints_a_ratio_below_one():
    for r in (0.5, 0.79, 0.97, 0.999, 1.0, 1.5):
        value = float(ratio_speedup(r).split("x")[0])
        assert value >= 1.0


@pytest.mark.parametrize(("args", "exc"), [((0, 1), ValueError), ((1, -1), ValueError),
                                           ((float("nan"), 1), ValueError), (("1", 1), TypeError),
                                           ((True, 1), TypeError)])
def test_speedup_rejects_bad_durations(args, exc):
    with pytest.raises(exc, match="full_s|reuse_s"):
        speedup(*args)
