"""Exact history on the real chat model: a turn served from re-placed documents, then a follow-up whose history
(prompt and answer) the backfill thread made exact, answered as plain HF answers the same ids.

Skips where SmolLM2-135M-Instruct's package is absent (``make install`` installs it)."""

from __future__ import annotations

import pytest

from kvboost_core import zoo
from kvboost_rag.app import rag_corpus as rc
from kvboost_rag.app.bench.rag import SYSTEM, hf_greedy

MODEL = "smollm2-135m-instruct"
NEW_TOKENS = 16

pytestmark = pytest.mark.skipif(not zoo.available(MODEL),
                                reason=f"{MODEL} is not installed ({zoo.SMOLLM2.install_hint})")


def test_follow_up_reuses_the_backfilled_history_exactly():
    from kvboost_rag import KVBoostRAG

    rag = KVBoostRAG.from_model_id(MODEL, device="cpu", backfill=True)
    corpus = rc.load_corpus("tune")
    docs = [rc.doc_text(d) for d in corpus.documents[:4]]
    rag.warm_documents(docs, progress=False)
    messages = [{"role": "system", "content": SYSTEM},
                {"role": "user", "content": "Documents:\n\n" + "\n\n".join(docs[::-1])
                 + f"\n\nQuestion: {corpus.questions[0].question}"}]
    prompt = rag.chat_prompt(messages)
    first = rag.generate(prompt, max_new_tokens=NEW_TOKENS, add_special_tokens=rag.chat_add_special_tokens(prompt))
    assert first.stats["reused_approx"] > 0  # documents were re-placed: turn 1 is approximate
    assert rag.engine.wait_backfill(timeout=300)

    messages += [{"role": "assistant", "content": first.text},
                 {"role": "user", "content": f"Question: {corpus.questions[1].question}"}]
    prompt = rag.chat_prompt(messages)
    special = rag.chat_add_special_tokens(prompt)
    second = rag.generate(prompt, max_new_tokens=NEW_TOKENS, add_special_tokens=special, store_prefix=False)
    assert second.stats["reused_approx"] == 0 and second.stats["reused_repaired"] == 0
    assert second.stats["reused_exact"] >= len(first.prompt_token_ids) + 1  # the history, answer included
    eng = rag.engine
    ref = hf_greedy(eng.model, eng.tokenizer, rag.encode(prompt, special), NEW_TOKENS, set(eng.eos_token_ids))
    assert second.token_ids == ref.tokens
