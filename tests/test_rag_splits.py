"""The hand-written evaluation splits (issues #24, #32): heldout, dev and test.

What makes them usable for paired accuracy CIs (:mod:`kvboost_rag.app.corpus_check`): enough questions, each with
one answer that its gold document states verbatim and no other document of the split contains; no id, title,
answer, sentence or name shared with another split or with anything an adapter trains on (tune, eval, the
synthetic corpus, the block adapter's training pool); not templated. The dev split is for every choice of
issue #32, the test split is read once, by the final benchmark; nothing is trained or tuned on either.
"""

from __future__ import annotations

import pytest

from kvboost_rag.app import corpus_check as cc
from kvboost_rag.app import rag_corpus as rc

SHAPES = {  # (documents, questions, kinds) exactly: a split that loses or gains a question fails here
    "heldout": (144, 288, 18),
    "dev": (64, 128, 8),
    "test": (160, 320, 20),
    # written after "test" was read (issue #32): 8 parts x 10 kinds, kinds 1, 4 and 7 of each part in dev2
    "dev2": (384, 768, 24),
    "test2": (896, 1792, 56),
}


@pytest.mark.parametrize("split", sorted(SHAPES))
def test_split_is_usable(split):
    assert split in rc.SPLITS and rc.split_exists(split)
    c = rc.load_corpus(split)
    n_docs, n_q, n_kinds = SHAPES[split]
    assert (len(c.documents), len(c.questions), len({d.kind for d in c.documents})) == (n_docs, n_q, n_kinds)
    others = [rc.load_corpus(s) for s in rc.SPLITS if s != split]
    problems = cc.check_split(c, others, cc.Shape(n_docs, n_q, n_kinds))
    assert not problems, problems[:20]


@pytest.mark.parametrize("split", sorted(SHAPES))
def test_retrieval_sets_at_k12(split):
    c = rc.load_corpus(split)
    sets = rc.retrieval_sets(c, 12, seed=0)
    assert [q for q, _ in sets] == list(c.questions)
    for q, docs in sets:
        gold = c.doc(q.doc_id)
        assert len({d.id for d in docs}) == 12 and gold in docs
        assert sum(d.kind == gold.kind for d in docs if d.id != gold.id) >= rc.SAME_KIND_DISTRACTORS
        assert [d.id for d in docs if cc.contains(q.answer, rc.doc_text(d))] == [gold.id], q.id


def test_the_checker_can_fail():
    """eval predates the synthetic-corpus rule: the checker finds its clashes (it is not vacuous)."""
    ev = rc.load_corpus("eval")
    assert any("synthetic-corpus value" in p for p in cc.check_not_synthetic(ev))
    held = rc.load_corpus("heldout")
    assert cc.check_disjoint(held, [held])  # a split is never disjoint from itself
    doubled = rc.RagCorpus(held.documents, held.questions + held.questions[:1])
    assert any("duplicate question ids" in p for p in cc.check_shape(doubled, cc.Shape()))


def test_block_training_pool_shares_nothing_with_the_splits():
    """The block adapter's training documents (kvboost_rag.app.train_corpus) never name an evaluation
    entity: no split's title appears in them."""
    from kvboost_rag.app import train_corpus as tc

    pool = tc.training_pool(240, 0)
    text = "\n".join(d.render().lower() for d in pool)
    for split in ("heldout", "dev", "test", "eval", "dev2", "test2"):
        for d in rc.load_corpus(split).documents:
            assert d.title.lower() not in text, (split, d.id)


@pytest.mark.parametrize("split", sorted(rc.READ_ONCE))
def test_the_trainer_refuses_a_test_split(split):
    from kvboost_rag.app.adapt_block import dev_targets

    assert split in rc.SPLITS
    with pytest.raises(ValueError, match="read once"):
        dev_targets(None, "/nonexistent", 16, split=split)


@pytest.mark.parametrize("split", sorted(rc.READ_ONCE))
def test_bench_rag_reads_a_test_split_only_with_final(split, capsys):
    from kvboost_rag.app.bench import rag as bench_rag

    with pytest.raises(SystemExit) as e:
        bench_rag.main(["--split", split, "--model", "/nonexistent"])  # refused before any model loads
    assert e.value.code == 2 and "--final" in capsys.readouterr().err


def test_bench_rag_refuses_an_unknown_device(capsys):
    from kvboost_rag.app.bench import rag as bench_rag

    with pytest.raises(SystemExit) as e:
        bench_rag.main(["--split", "dev2", "--device", "gpu0", "--model", "/nonexistent"])
    assert e.value.code == 2 and "--device" in capsys.readouterr().err
