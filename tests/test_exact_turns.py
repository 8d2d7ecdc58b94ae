"""``RAGOptions.exact_turns`` (issue 33): every chat turn computed exactly, nothing re-placed. Turn 1's answer is
the full prefill's, it stores its canonical chunks as it computes them, so the backfill after it has only the
answer left and a follow-up with no think time waits for almost nothing. The default re-places turn 1's
documents (faster) and backfills the whole prompt afterwards."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from kvboost_core.engine import KVEngine
from kvboost_rag import KVBoostRAG, RAGOptions
from kvboost_rag.app import demo_data as dd

pytestmark = pytest.mark.skipif(not dd.demo_model_available(), reason="the embedded demo model is missing")

NEW = 6


@pytest.fixture(scope="module")
def demo() -> Any:
    from kvboost_rag.app.loading import load_engine

    return load_engine("demo").engine


def _rag(demo: Any, **options: Any) -> KVBoostRAG:
    rag = KVBoostRAG(KVEngine(demo.model, demo.tokenizer, demo.config), RAGOptions(**options))
    records = [d["text"] for d in dd.load_corpus()]
    rag.warm_documents([" ".join(records[i:i + 8]) for i in range(0, 32, 8)], progress=False)
    return rag


def _turns(rag: KVBoostRAG, n: int) -> list[Any]:
    records = [d["text"] for d in dd.load_corpus()]
    docs = [" ".join(records[i:i + 8]) for i in range(0, 32, 8)]
    messages = [{"role": "system", "content": "Answer from the documents."},
                {"role": "user", "content": dd.build_prompt(docs[::-1], "What is the country of Dethik?")}]
    out = []
    for i in range(n):
        prompt = rag.chat_prompt(messages)
        res = rag.generate(prompt, chat_history=rag.chat_history(messages), max_new_tokens=NEW,
                           add_special_tokens=rag.chat_add_special_tokens(prompt))
        assert rag.engine.wait_backfill(timeout=120)
        out.append((res, rag.engine.backfill_results[-1]))
        messages += [{"role": "assistant", "content": res.text}, {"role": "user", "content": f"And {i}?"}]
    return out


@torch.inference_mode()
def _full_logits(model: Any, ids: list[int]) -> torch.Tensor:
    return model(input_ids=torch.tensor([ids])).logits[0, -1].float()


def test_exact_turns_compute_turn_one_exactly_and_leave_the_backfill_only_the_answer(demo: Any) -> None:
    (first, job1), (second, _), (third, _) = _turns(_rag(demo, exact_turns=True), 3)
    n = len(first.prompt_token_ids)
    assert first.stats["reused_approx"] == 0 and first.stats["chat_history_tokens"] == n
    ref = _full_logits(demo.model, first.prompt_token_ids)
    assert float((ref - first.first_logits).abs().max()) < 1e-4
    # the call stored its canonical chunks: the backfill computes the answer and at most the prompt's last chunk
    assert job1.reused_exact > 0 and job1.computed <= len(first.token_ids) + 1 + demo.config.chunk_size
    assert job1.computed < n // 4
    for res in (second, third):
        assert res.stats["reused_approx"] == 0 and res.stats["reused_exact"] >= len(first.prompt_token_ids)
        ref = _full_logits(demo.model, res.prompt_token_ids)
        assert float((ref - res.first_logits).abs().max()) < 1e-4


def test_by_default_turn_one_re_places_and_its_backfill_computes_the_prompt(demo: Any) -> None:
    """The check above can fail: without exact_turns turn 1 re-places its documents, and its backfill computes
    nearly the whole prompt."""
    (first, job1), = _turns(_rag(demo), 1)
    assert first.stats["reused_approx"] > 0 and first.stats["chat_history_tokens"] == 0
    assert job1.computed > len(first.prompt_token_ids) // 2


def test_exact_turns_must_be_a_bool() -> None:
    with pytest.raises(TypeError, match="exact_turns"):
        RAGOptions(exact_turns="yes")  # type: ignore[arg-type]


def test_the_server_serves_exact_turns_and_every_tenant_inherits_them(demo: Any) -> None:
    """Through the scheduler (as ``serve --exact-turns`` builds it), turn 1 re-places nothing; a tenant's own
    RAG object (``ServerState.rag``) carries the same options."""
    from test_server_history import _turn

    from kvboost_rag.app.server.scheduler import Scheduler
    from kvboost_rag.app.server.state import default_state

    rag = _rag(demo, exact_turns=True)
    records = [d["text"] for d in dd.load_corpus()]
    docs = [" ".join(records[i:i + 8]) for i in range(0, 32, 8)]
    messages = [{"role": "user", "content": dd.build_prompt(docs, "What is the country of Dethik?")}]
    sched = Scheduler(demo.driver, max_batch=1)
    sched.start()
    try:
        _, started = _turn(sched, rag, messages)
    finally:
        sched.shutdown()
    assert started.counts.approximate == 0 and started.counts.prompt_tokens > 200
    state = default_state(rag, "demo")
    assert state.rag("tenant-b").options.exact_turns is True


def test_both_skins_take_exact_turns(demo: Any) -> None:
    from langchain_core.messages import HumanMessage
    from langchain_kvboost import ChatKVBoost
    from llama_index.llms.kvboost import KVBoostLLM

    eng = KVEngine(demo.model, demo.tokenizer, demo.config)
    chat = ChatKVBoost(engine=eng, exact_turns=True, max_tokens=4)
    assert chat._rag.options.exact_turns is True
    records = [d["text"] for d in dd.load_corpus()]
    chat._rag.warm_documents([" ".join(records[:8])], progress=False)
    chat.invoke([HumanMessage(content=dd.build_prompt([" ".join(records[:8])], "What is the country of Dethik?"))])
    stats = chat._rag.last_result.stats
    assert stats["reused_approx"] == 0 and stats["chat_history_tokens"] == stats["prompt_tokens"]
    assert ChatKVBoost(engine=eng)._rag.options.exact_turns is False
    assert KVBoostLLM(eng, exact_turns=True)._rag.options.exact_turns is True
    assert KVBoostLLM(KVBoostRAG(eng), exact_turns=True)._rag.options.exact_turns is True


def test_switched_on_sets_only_the_flags_given_true():
    base = RAGOptions(auto_warm=True)
    assert base.switched_on(auto_warm=False, exact_turns=True) == RAGOptions(auto_warm=True, exact_turns=True)
    assert base.switched_on(exact_turns=False) == base
    with pytest.raises(TypeError, match="unknown RAG option"):
        base.switched_on(exact_turn=True)
