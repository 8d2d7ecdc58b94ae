"""Answer quality beside the timings of ``kvboost-rag bench``: what each reuse method does to the answers.

* Demo-model accuracy: the embedded demo model answers held-out questions over its bundled corpus (warmed),
  once per method, exact match against the gold answer (``demo_data.evaluate``). Exact-prefix caching and an
  exact repeat reuse KV computed for the very same ids, so their answers are those of full prefill and of the
  stored cacheblend pass by construction; they are not re-run.
* stories260K fidelity: with a trained model present (``../shared/models/stories260K`` in a checkout), the
  ``verify`` report (KL, top-1, greedy match against full prefill) over prompts of reordered warmed documents.

Each part returns a JSON-ready dict, or ``{"skipped": reason}`` when its model is absent.
"""

from __future__ import annotations

import statistics
import time
from pathlib import Path
from typing import Any

from kvboost_rag.app import demo_data as dd

QUALITY_METHODS = ("full", "none", "selective", "cacheblend")
STORIES_DEFAULT = Path("..") / "shared" / "models" / "stories260K"


def demo_accuracy(n_questions: int, model_dir: Path | str = dd.DEMO_MODEL_DIR,
                  methods: tuple[str, ...] = QUALITY_METHODS) -> dict[str, Any]:
    """Held-out exact-match accuracy of the demo model per method (first ``n_questions`` questions)."""
    if n_questions < 1:
        raise ValueError(f"n_questions must be >= 1, got {n_questions}")
    if not dd.demo_model_available(model_dir):
        return {"skipped": f"no demo model in {model_dir} (train one with scripts/train_demo_model.py)"}
    from kvboost_core import KVEngine
    from kvboost_rag import KVBoostRAG

    t0 = time.perf_counter()
    corpus = {d["id"]: d["text"] for d in dd.load_corpus(model_dir)}
    qs = dd.load_heldout(model_dir)[:n_questions]
    rag = KVBoostRAG(KVEngine.from_pretrained(str(model_dir), device="cpu"))
    rag.warm_documents(list(corpus.values()), progress=False)
    cfg = rag.engine.config  # includes the model's calibrated kvboost.json, when it has one
    out: dict[str, Any] = {"model": str(model_dir), "questions": len(qs), "methods": {},
                           "cacheblend_setting": {"recompute_ratio": cfg.recompute_ratio,
                                                  "check_layer": cfg.check_layer}}
    answers: dict[str, list[str]] = {}
    for m in methods:
        rows = dd.evaluate(rag, qs, corpus, repair=m)
        answers[m] = [dd.normalize_answer(r.generated) for r in rows]
        out["methods"][m] = {"accuracy": dd.accuracy(rows), "single_hop": dd.accuracy(rows, 1),
                             "two_hop": dd.accuracy(rows, 2),
                             "reuse_ratio": statistics.fmean(r.reuse_ratio for r in rows),
                             "ttft_median_s": statistics.median(r.ttft_s for r in rows),
                             "by_template": _by_template(qs, rows)}
    if "full" in answers:  # how often a method changes the answer at all, right or wrong
        for m, a in answers.items():
            same = sum(x == y for x, y in zip(a, answers["full"], strict=True))
            out["methods"][m]["agreement_with_full"] = same / len(qs)
    out["closed_book_accuracy"] = dd.accuracy(dd.evaluate_closed_book(rag, qs))
    out["seconds"] = time.perf_counter() - t0
    return out


def _by_template(questions: list[dict[str, Any]], rows: list[dd.EvalResult]) -> dict[str, list[int]]:
    """[right, asked] per question template: which lookups a model really does, and which it only guesses."""
    by: dict[str, list[bool]] = {}
    for q, r in zip(questions, rows, strict=True):
        by.setdefault(q["template"], []).append(r.correct)
    return {t: [sum(v), len(v)] for t, v in sorted(by.items())}


def stories_fidelity(path: Path | str | None, n_prompts: int,
                     repairs: tuple[str, ...] = ("none", "selective", "cacheblend")) -> dict[str, Any]:
    """``verify`` summary of a trained model at ``path`` over reordered warmed documents."""
    p = Path(path) if path is not None else STORIES_DEFAULT
    if not (p / "config.json").exists():
        return {"skipped": f"no model at {p} (pass --stories DIR)"}
    from kvboost_rag.app.loading import fidelity_prompts, load_engine

    loaded = load_engine(str(p))
    docs, prompts = fidelity_prompts(loaded, n_prompts)
    loaded.engine.warm(docs)
    rep = loaded.engine.verify(prompts, repairs=repairs, max_new_tokens=8)
    return {"model": str(p), "prompts": len(prompts), "summary": rep.summary()}


STORIES_HELDOUT = Path(__file__).resolve().parents[1] / "assets" / "stories_eval" / "heldout.json"


def story_prompts(docs: list[str], cues: list[str], n: int, seed: int = 7) -> list[Any]:
    """``n`` prompts of 3-4 of ``docs`` in a new order (re-placed KV), each followed by a cue (cycled)."""
    import random

    from kvboost_core import Segment

    rng = random.Random(seed)
    return [[Segment(text=d, cacheable=True) for d in rng.sample(docs, rng.choice([3, 4]))]
            + [Segment(text=cues[i % len(cues)])] for i in range(n)]


def stories_heldout(path: Path | str | None, n_prompts: int = 24,
                    repairs: tuple[str, ...] = ("none", "selective", "cacheblend"), **repair_kw: Any) -> dict[str, Any]:
    """``verify`` at engine defaults over held-out stories (``assets/stories_eval/heldout.json``, never used to
    tune a setting): the figure that shows whether the defaults carry over to documents nobody tuned on."""
    import json

    p = Path(path) if path is not None else STORIES_DEFAULT
    if not (p / "config.json").exists():
        return {"skipped": f"no model at {p} (pass --stories DIR)"}
    from kvboost_rag.app.loading import load_engine

    data = json.loads(STORIES_HELDOUT.read_text())
    engine = load_engine(str(p)).engine
    engine.warm(data["documents"])
    rep = engine.verify(story_prompts(data["documents"], data["cues"], n_prompts), repairs=repairs,
                        max_new_tokens=8, **repair_kw)
    return {"model": str(p), "prompts": n_prompts, "documents": len(data["documents"]), "summary": rep.summary()}
