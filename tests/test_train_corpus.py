"""The block adapter's training chats (kvboost_rag.app.train_corpus): real prose and entity documents, five
question kinds, deterministic, gold answers where they are known."""

from __future__ import annotations

from collections import Counter

import pytest

from kvboost_rag.app import train_corpus as tc


@pytest.fixture(scope="module")
def pool():
    return tc.training_pool(240, 0)


def test_pool_holds_real_prose_and_entities(pool):
    groups = Counter(d.group.split(":")[0] for d in pool)
    assert groups["entity"] == 240 and groups["py"] >= 200  # stdlib docstrings are always there
    for d in pool:
        assert d.title and d.text and d.render().startswith(d.title + "\n")
    prose = [d for d in pool if not d.group.startswith("entity")]
    assert all(tc.MIN_WORDS <= len(d.text.split()) <= tc.MAX_WORDS for d in prose)
    assert len({d.title for d in pool}) == len(pool)


def test_chats_are_deterministic_varied_and_their_golds_are_in_the_documents(pool):
    a, b = tc.make_chats(pool, 60, 3), tc.make_chats(pool, 60, 3)
    assert a == b and tc.make_chats(pool, 30, 3) == a[:30]  # a larger run extends a smaller one
    assert a != tc.make_chats(pool, 60, 4)
    assert Counter(c.kind for c in a) == {k: 12 for k in tc.KINDS}
    assert any(len(c.messages) == 4 for c in a)  # some with an earlier turn
    for c in a:
        assert c.messages[0]["role"] == "system" and c.messages[-1]["role"] == "user"
        prompt = "\n".join(m["content"] for m in c.messages)
        assert all(d in prompt for d in c.docs)
        if c.kind in ("lookup", "complete", "which"):
            assert c.gold and c.gold in "\n".join(c.docs), (c.kind, c.gold)
        if c.kind == "two":
            assert all(part in "\n".join(c.docs) for part in c.gold.split("; "))
        if c.kind == "about":
            assert c.gold is None


def test_bad_arguments(pool):
    with pytest.raises(ValueError, match="kinds"):
        tc.make_chats(pool, 3, 0, kinds=("trivia",))
    with pytest.raises(ValueError, match="n must be"):
        tc.make_chats(pool, -1, 0)
