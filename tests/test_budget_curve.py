"""The block adapter's budget curve table (kvboost_rag.app.bench.budget_curve): points from adapter
directories, warm starts counted on top of their init, the base weights as the origin, clear errors."""

from __future__ import annotations

import json

import pytest

from kvboost_rag.app.bench import budget_curve as bc

DEV = {"split": "dev", "k": 12, "questions": 64, "full_acc": 0.2}


def _adapter(path, trained, dev_eval=None):
    path.mkdir()
    (path / "block.json").write_text(json.dumps({"trained": trained}))
    if dev_eval is not None:
        (path / "dev_eval.json").write_text(json.dumps(dev_eval))
    return str(path)


def _scores(acc, kl):
    return {"acc": acc, "diff": acc - 0.2, "ci": [acc - 0.25, acc - 0.15], "p": 0.5, "same_answer": 0.3,
            "answer_kl": kl}


def test_points_table_and_plot(tmp_path):
    shipped = _adapter(tmp_path / "shipped", {"train_s": 600, "threads": 2, "steps": 200},
                       {**DEV, "adapted": _scores(0.15, 0.07), "base": _scores(0.05, 0.19)})
    arm = _adapter(tmp_path / "arm", {"recipe": "b", "cpu_min": 20.0, "steps": 50, "init": shipped,
                                      "dev": {**DEV, "adapted": _scores(0.18, 0.05)}})
    out = tmp_path / "curve.json"
    assert bc.main([shipped, arm, "--json", str(out), "--plot", str(tmp_path / "c.png")]) == 0
    points = json.loads(out.read_text())["points"]
    assert [(p["adapter"], p["cpu_min"]) for p in points] == [("base weights", 0.0), ("shipped", 20.0),
                                                              ("arm", 40.0)]  # 20 on top of the init's 20
    assert "| arm | b | 40.0 | 50 | 18.0% | -2.0 [-7.0, +3.0]" in bc.table(points)
    assert (tmp_path / "c.png").stat().st_size > 0


def test_a_directory_without_scores_is_one_line(tmp_path, capsys):
    bare = _adapter(tmp_path / "bare", {"steps": 3})
    with pytest.raises(SystemExit) as e:
        bc.main([bare])
    assert e.value.code == 2 and "no dev scores" in capsys.readouterr().err
