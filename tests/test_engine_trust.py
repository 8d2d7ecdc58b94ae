"""Trust in what the cache serves: forced key collisions are misses, answers do not depend on request history,
and approximate KV is never reported as exact."""

from __future__ import annotations

import random
import types
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
import xxhash
from conftest import CORPUS, STORY_CUES, STORY_DOCS
from helpers import docs_prompt, engine_for, full_logits

import kvboost_core.keys as keys_mod
from kvboost_core import Segment


class _CollidingHash:
    """An ``xxh3_128`` stand-in for :mod:`kvboost_core.keys` that hashes only what ``pick`` keeps of the
    updates, so different inputs share a key (a forced collision)."""

    def __init__(self, pick) -> None:
        self._parts: list[bytes] = []
        self._pick = pick

    def update(self, data: bytes) -> None:
        self._parts.append(bytes(data))

    def digest(self) -> bytes:
        return xxhash.xxh3_128(b"".join(self._pick(self._parts))).digest()

    def hexdigest(self) -> str:
        return self.digest().hex()


def _collide(monkeypatch, pick) -> None:
    monkeypatch.setattr(keys_mod, "xxhash", types.SimpleNamespace(xxh3_128=lambda: _CollidingHash(pick)))


def _prefix_ignores_parent(parts: list[bytes]) -> list[bytes]:
    # prefix_key(parent, ids) updates (b"P", parent, ids): drop the parent, so a chunk's key no longer says
    # what came before it
    return [parts[0], parts[-1]] if parts[0] == b"P" else parts


def _content_by_length(parts: list[bytes]) -> list[bytes]:
    # content_key updates (b"C", namespace, fingerprint, ids): keep only the run's length
    return [parts[0], len(parts[-1]).to_bytes(8, "little")] if parts[0] == b"C" else parts


def _ids(tokenizer, text: str, n: int) -> list[int]:
    ids = tokenizer(text, add_special_tokens=False)["input_ids"][:n]
    assert len(ids) == n, text
    return ids


def test_forced_prefix_key_collision_is_a_miss(tiny_llama, tokenizer, monkeypatch):
    p_a, p_b = _ids(tokenizer, CORPUS[0], 8), _ids(tokenizer, CORPUS[1], 8)
    c, d = _ids(tokenizer, CORPUS[2], 8), _ids(tokenizer, CORPUS[4], 8)
    q = _ids(tokenizer, CORPUS[5], 3)
    assert c[0] != d[0]

    def prompt(*runs):  # one segment per run: one chunk per run (chunk_size 16)
        return [Segment(token_ids=r) for r in runs]

    def build(with_colliding_entry: bool):
        eng = engine_for(tiny_llama, tokenizer)
        _collide(monkeypatch, _prefix_ignores_parent)
        eng.prefill(prompt(p_b, d, q))  # stores BOS, p_b, d: the request's real prefix
        if with_colliding_entry:
            eng.prefill(prompt(p_a, c, q))  # c after p_a: under the same key as c after p_b
        return eng

    target = prompt(p_b, c, q[:2])
    eng = build(with_colliding_entry=True)
    full = eng.prefill(target, repair="full", store_prefix=False)
    assert full.stats["reused_exact"] == 1 + len(p_b)  # BOS and p_b only: c after p_a was refused
    assert (full_logits(tiny_llama, full.token_ids) - full.last_logits).abs().max().item() < 1e-4
    default = eng.prefill(target, store_prefix=False)
    clean = build(with_colliding_entry=False).prefill(target, store_prefix=False)
    assert default.stats["reused_exact"] == clean.stats["reused_exact"] == 1 + len(p_b)
    assert torch.equal(default.last_logits, clean.last_logits)


def test_forced_prefix_collisions_never_serve_a_foreign_prefix(tiny_llama, tokenizer, monkeypatch):
    """Prefix keys that ignore the prefix: a run at a given position has one key whatever came before it, so
    most lookups after the first chunk collide with an entry computed after other runs. Every answer is exact."""
    eng = engine_for(tiny_llama, tokenizer)
    _collide(monkeypatch, _prefix_ignores_parent)
    runs = [_ids(tokenizer, t, 6) for t in CORPUS[:4]]
    rng = random.Random(3)
    for _ in range(12):
        pick = [Segment(token_ids=runs[i]) for i in rng.sample(range(4), 3)]
        res = eng.prefill(pick, repair="full")
        assert (full_logits(tiny_llama, res.token_ids) - res.last_logits).abs().max().item() < 1e-4


def test_forced_content_key_collision_is_a_miss(tiny_llama, tokenizer, monkeypatch):
    head = _ids(tokenizer, CORPUS[6], 6)
    doc1, doc2 = _ids(tokenizer, CORPUS[1], 12), _ids(tokenizer, CORPUS[2], 12)
    q = _ids(tokenizer, CORPUS[5], 4)

    def prompt(doc):
        return [Segment(token_ids=head), Segment(token_ids=doc, cacheable=True), Segment(token_ids=q)]

    cold = engine_for(tiny_llama, tokenizer).prefill(prompt(doc2), store_prefix=False)
    eng = engine_for(tiny_llama, tokenizer)
    _collide(monkeypatch, _content_by_length)
    assert eng.warm([Segment(token_ids=doc1)]).warmed == 1
    res = eng.prefill(prompt(doc2), store_prefix=False)  # doc2's key holds doc1's KV
    assert res.stats["hits_content"] == 0
    assert torch.equal(res.last_logits, cold.last_logits)  # the default repair: as if nothing were cached
    full = eng.prefill(prompt(doc2), repair="full", store_prefix=False)
    assert (full_logits(tiny_llama, full.token_ids) - full.last_logits).abs().max().item() < 1e-4
    # warm() compares tokens before saying "already warm": doc2 is computed, replacing doc1 under the key
    second = eng.warm([Segment(token_ids=doc2)])
    assert (second.warmed, second.already_warm) == (1, 0)
    assert eng.warm([Segment(token_ids=doc2)]).already_warm == 1
    assert eng.prefill(prompt(doc2), store_prefix=False).stats["hits_content"] == len(doc2)


def test_repeated_cacheblend_prompt_never_reports_approximate_kv_as_exact(tiny_llama, tokenizer):
    eng = engine_for(tiny_llama, tokenizer, sink_tokens=2)
    eng.warm(CORPUS)
    prompt = docs_prompt([CORPUS[3], CORPUS[1], CORPUS[4]], " Where was Alice born?")
    runs = [eng.prefill(prompt, repair="cacheblend") for _ in range(3)]
    for r in runs:
        s = r.stats
        assert s["reused_exact"] <= 1  # the BOS alone: documents are re-placed, not exact
        assert s["reused_approx"] > 0 and s["reused_repaired"] == 0
        ref = full_logits(tiny_llama, r.token_ids)
        assert (ref - r.last_logits).abs().max().item() > 1e-3  # it is an approximation ...
    assert all(torch.equal(runs[0].last_logits, r.last_logits) for r in runs)  # ... the same one every time
    assert eng.stats()["hits_repaired"] == 0


def _story_prompts(n: int) -> list[list[Segment]]:
    rng = random.Random(11)
    head = Segment(text="Here are some stories for you.\n")
    prompts = []
    for i in range(n):
        docs = rng.sample(STORY_DOCS, 3)
        if i % 3 == 0:  # some prompts share a first document after the head: longer exact prefixes
            docs[0] = STORY_DOCS[0]
        prompts.append([head, *(Segment(text=d, cacheable=True) for d in docs),
                        Segment(text=STORY_CUES[i % len(STORY_CUES)])])
    return prompts


@pytest.fixture(scope="module", params=["tiny_llama", "stories260K"])
def story_engine_factory(request, tokenizer):
    if request.param == "stories260K":
        model, tok = request.getfixturevalue("stories")  # skips when ../shared/models/stories260K is absent
    else:
        model, tok = request.getfixturevalue("tiny_llama"), tokenizer

    def build():
        eng = engine_for(model, tok, sink_tokens=4)
        eng.warm(STORY_DOCS)
        return eng

    return build


def _answers(eng, prompts, order, threads: int = 1) -> dict[int, list[int]]:
    def one(i):
        return i, eng.generate(prompts[i], max_new_tokens=8).token_ids

    if threads == 1:
        return dict(one(i) for i in order)
    with ThreadPoolExecutor(threads) as pool:
        return dict(pool.map(one, order))


def test_greedy_answers_do_not_depend_on_request_history(story_engine_factory, report):
    prompts = _story_prompts(12)
    # the reference: each prompt on its own, in an engine that keeps no prefix from other requests
    ref_eng = story_engine_factory()
    ref = {i: ref_eng.generate(p, max_new_tokens=8, store_prefix=False).token_ids for i, p in enumerate(prompts)}
    rng = random.Random(5)
    for _ in range(2):
        order = rng.sample(range(len(prompts)), len(prompts))
        assert _answers(story_engine_factory(), prompts, order) == ref, f"single thread, order {order}"
    order = rng.sample(range(len(prompts)), len(prompts))
    eng = story_engine_factory()
    assert _answers(eng, prompts, order, threads=8) == ref, f"8 threads, order {order}"
    assert eng.stats()["hits_exact"] > 0  # later prompts did hit prefixes stored by earlier ones
    report.append(f"history: 12 prompts, 2 single-thread orders + 8 threads: identical greedy "
                  f"answers; exact-prefix hits {eng.stats()['hits_exact']} tokens")


def test_prefix_hits_survive_the_disk_tier(tiny_llama, tokenizer, tmp_path):
    """The context digest is stored with the block: a second engine on the same disk store hits the prefix."""
    prompt = [Segment(text=CORPUS[6]), Segment(text=CORPUS[0]), Segment(text=" Why?")]
    first = engine_for(tiny_llama, tokenizer, store=f"disk:{tmp_path}").prefill(prompt)
    assert first.stats["reused_exact"] == 0
    second = engine_for(tiny_llama, tokenizer, store=f"disk:{tmp_path}").prefill(prompt)
    assert second.stats["reused_exact"] >= second.stats["prompt_tokens"] - 16
    assert (first.last_logits - second.last_logits).abs().max().item() < 1e-4


def test_warm_does_not_report_documents_a_full_budget_refused(tiny_llama, tokenizer, caplog):
    """A budget full of pinned entries stores nothing: warm() says so instead of counting the documents warmed."""
    eng = engine_for(tiny_llama, tokenizer, max_cache_bytes=2_000_000)
    eng.warm(CORPUS[:1])
    store = eng.store.tiers[0] if hasattr(eng.store, "tiers") else eng.store
    filler = next(iter(store._blocks.values()))
    eng.clear()
    for i in range(eng.config.max_cache_bytes // filler.nbytes):  # the whole budget pinned
        assert store.put(keys_mod.content_key(eng.config.namespace, eng.fingerprint, [10_000 + i], precision="model"), filler,
                         pin=True)
    with caplog.at_level("WARNING", logger="kvboost_core.engine.warming"):
        res = eng.warm(CORPUS[1:3])
    assert res.warmed == 0 and res.not_stored == 2 and res.chunks == 0 and res.tokens == 0
    assert "not stored" in caplog.text
