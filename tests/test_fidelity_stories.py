"""Fidelity on the trained stories260K model (skips when ../shared is absent): reordered warmed documents,
every strategy against a full prefill of the same ids."""

from __future__ import annotations

import random

import pytest
from conftest import STORY_CUES, STORY_DOCS

from kvboost_core import Segment
from kvboost_core.engine import KVEngine

QUESTIONS = [" Question: Who had a dog called Max? Answer:", " Question: Where did Sam and Mia go? Answer:",
             " Question: What did the bird do every morning? Answer:", " Question: What did Ben want? Answer:"]


@pytest.fixture(scope="module")
def eng(stories):
    model, tok = stories
    e = KVEngine(model, tok, chunk_size=32, boundary_window=4, sink_tokens=4)
    e.warm(STORY_DOCS)
    return e


def _story_prompts(n=20, seed=0):
    rng = random.Random(seed)
    return [[Segment(text=d, cacheable=True) for d in rng.sample(STORY_DOCS, rng.choice([3, 4]))]
            + [Segment(text=rng.choice(STORY_CUES))] for _ in range(n)]


def _qa_prompts(n=20, seed=1):
    rng = random.Random(seed)
    return [[Segment(text="Read the stories and answer.")]
            + [Segment(text=d, cacheable=True) for d in rng.sample(STORY_DOCS, rng.choice([3, 4]))]
            + [Segment(text=rng.choice(QUESTIONS))] for _ in range(n)]


def test_story_continuation_fidelity(eng, report):
    rep = eng.verify(_story_prompts(), repairs=("none", "selective", "cacheblend", "full"), max_new_tokens=8)
    s = rep.summary()
    report.append("stories260K, 20 prompts of 3-4 reordered docs + a short cue (vs full prefill):")
    report.extend("  " + line for line in rep.table().splitlines())
    assert s["full"]["max_abs_diff"] < 1e-4
    assert s["selective"]["mean_kl"] < s["none"]["mean_kl"]
    assert s["cacheblend"]["mean_kl"] < s["none"]["mean_kl"]
    assert s["cacheblend"]["top1_agree"] >= s["none"]["top1_agree"]
    # the goal the issue set: mean KL <= 0.01 with top-1 >= 95% at ratio 0.15
    assert s["cacheblend"]["mean_kl"] <= 0.01 and s["cacheblend"]["top1_agree"] >= 0.95


def test_question_after_documents_fidelity(eng, report):
    rep = eng.verify(_qa_prompts(), repairs=("none", "cacheblend"), max_new_tokens=8)
    plain = eng.verify(_qa_prompts(), repairs=("cacheblend",), max_new_tokens=8, select="deviation")
    s, p = rep.summary(), plain.summary()
    report.append("stories260K, 20 prompts: instruction + 3-4 reordered docs + a question:")
    report.extend("  " + line for line in rep.table().splitlines())
    report.append(f"  plain CacheBlend (select=deviation): mean KL {p['cacheblend']['mean_kl']:.4f}, "
                  f"top-1 {p['cacheblend']['top1_agree']:.0%}")
    assert s["cacheblend"]["mean_kl"] < s["none"]["mean_kl"]
    # the default selection must beat plain deviation here too, or it should not be the default
    assert s["cacheblend"]["mean_kl"] <= p["cacheblend"]["mean_kl"]


def test_exact_prefix_hit_on_trained_model(eng, report):
    prompt = STORY_DOCS[0] + " " + STORY_DOCS[1]
    eng.prefill(prompt)
    hit = eng.prefill(prompt)
    diff = (eng.full_prefill_logits(hit.token_ids) - hit.last_logits).abs().max().item()
    report.append(f"stories260K exact-prefix hit: reused {hit.stats['reused_exact']}/{hit.stats['prompt_tokens']} "
                  f"tokens, max |Δlogit| vs full prefill = {diff:.2e}")
    assert hit.stats["reused_exact"] >= hit.stats["prompt_tokens"] - 1
    assert diff < 1e-4


def test_heldout_stories_at_defaults(stories, report):
    """Stories written for this figure and never tuned on, at engine defaults (the issue's goal: KL <= 0.01 and
    top-1 >= 95% at <= 20% recompute; the floors leave one prompt of margin on 24)."""
    import json

    from kvboost_rag.app.bench.quality import STORIES_HELDOUT, story_prompts

    model, tok = stories
    data = json.loads(STORIES_HELDOUT.read_text())
    e = KVEngine(model, tok)
    e.warm(data["documents"])
    rep = e.verify(story_prompts(data["documents"], data["cues"], 24), repairs=("none", "cacheblend"),
                   max_new_tokens=8)
    s = rep.summary()
    report.append("stories260K, 24 prompts over 8 held-out stories, engine defaults (vs full prefill):")
    report.extend("  " + line for line in rep.table().splitlines())
    cb = s["cacheblend"]
    assert cb["recomputed_share"] <= 0.20
    assert cb["mean_kl"] <= 0.015 and cb["top1_agree"] >= 22 / 24
    assert cb["mean_kl"] < s["none"]["mean_kl"]
