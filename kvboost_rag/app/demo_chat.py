"""``kvboost-rag demo``: a stock LangChain retrieval chain over ``ChatKVBoost`` on a real instruct model.

The corpus is the held-out English set of :mod:`kvboost_rag.app.rag_corpus` (64 short encyclopedic documents about
invented entities, so the model must read them). Documents are warmed once (ingestion time); each question then
goes through ``create_retrieval_chain`` + ``create_stuff_documents_chain`` with a FAISS retriever (k=12, about
2K prompt tokens). ``ChatKVBoost`` finds the warmed documents inside the rendered chat prompt and reuses their KV.

For every question the same chat prompt also runs through plain HF (a full prefill of exactly the ids the chat
template gives, greedy on HF's own cache), so each line shows both answers, whether each is right, and the TTFT
of each. Speedups are printed as "N.NNx faster" = full TTFT / reuse TTFT.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from kvboost_rag.app import rag_corpus as rc
from kvboost_rag.app.bench.rag import SYSTEM, first_sentence, hf_greedy

HUMAN = "Documents:\n\n{context}\n\nQuestion: {input}"


@dataclass(slots=True)
class ChatRow:
    question: str
    gold: str
    answer: str
    answer_full: str
    correct: bool
    correct_full: bool
    ttft_s: float
    ttft_full_s: float
    reuse_ratio: float
    recompute_share: float
    documents: int
    prompt_tokens: int

    @property
    def same(self) -> bool:
        return first_sentence(self.answer) == first_sentence(self.answer_full)


def build_chain(chat: Any, corpus: rc.RagCorpus, top_k: int) -> Any:
    from langchain_classic.chains import create_retrieval_chain
    from langchain_classic.chains.combine_documents import create_stuff_documents_chain
    from langchain_community.vectorstores import FAISS
    from langchain_core.documents import Document
    from langchain_core.prompts import ChatPromptTemplate
    from langchain_kvboost import KVHashEmbeddings

    docs = [Document(page_content=rc.doc_text(d), metadata={"id": d.id}) for d in corpus.documents]
    store = FAISS.from_documents(docs, KVHashEmbeddings())
    prompt = ChatPromptTemplate.from_messages([("system", SYSTEM), ("human", HUMAN)])
    return create_retrieval_chain(store.as_retriever(search_kwargs={"k": top_k}),
                                  create_stuff_documents_chain(chat, prompt))


def ask(chain: Any, chat: Any, q: rc.CorpusQuestion, max_new_tokens: int) -> ChatRow:
    out = chain.invoke({"input": q.question})
    stats = dict(chat.last_stats)
    answer = str(out["answer"]).strip()
    # The same chat the chain sent (stuff-documents joins page contents with "\n\n"), through plain HF.
    context = "\n\n".join(d.page_content for d in out["context"])
    messages = [{"role": "system", "content": SYSTEM},
                {"role": "user", "content": HUMAN.format(context=context, input=q.question)}]
    rag = chat.rag
    prompt = rag.chat_prompt(messages)
    ids = rag.encode(prompt, rag.chat_add_special_tokens(prompt))
    eng = rag.engine
    ref = hf_greedy(eng.model, eng.tokenizer, ids, max_new_tokens, set(eng._eos))
    n = max(int(stats.get("prompt_tokens", len(ids))), 1)
    return ChatRow(q.question, q.answer, answer, ref.text.strip(), rc.is_correct(answer, q),
                   rc.is_correct(ref.text, q), float(stats["ttft_s"]), ref.ttft_s, float(stats["reuse_ratio"]),
                   int(stats.get("recomputed", 0)) / n, int(stats.get("documents", 0)), len(ids))


def _mark(ok: bool) -> str:
    return "right" if ok else "wrong"


def print_row(i: int, r: ChatRow) -> None:
    print(f"\n[{i}] Q: {r.question}   (gold: {r.gold})")
    print(f"    A (reuse): {r.answer!r} -> {_mark(r.correct)}")
    print(f"    A (full):  {r.answer_full!r} -> {_mark(r.correct_full)}"
          f"{'' if r.same else '   [answers differ]'}")
    print(f"    {r.prompt_tokens} prompt tokens, {r.documents} warmed documents found | TTFT reuse "
          f"{r.ttft_s * 1e3:.0f} ms, full prefill {r.ttft_full_s * 1e3:.0f} ms "
          f"({r.ttft_full_s / max(r.ttft_s, 1e-9):.2f}x faster) | reused {r.reuse_ratio:.0%}, "
          f"recomputed {r.recompute_share:.0%}")


def print_summary(rows: Sequence[ChatRow], seconds: float, setting: str) -> None:
    n = len(rows)
    print(f"\nSummary ({n} questions, repair {setting})")
    print(f"  accuracy: with reuse {sum(r.correct for r in rows)}/{n}, full prefill "
          f"{sum(r.correct_full for r in rows)}/{n}")
    print(f"  same answer as full prefill (first sentence): {sum(r.same for r in rows)}/{n}")
    ttft, full = statistics.median(r.ttft_s for r in rows), statistics.median(r.ttft_full_s for r in rows)
    print(f"  median TTFT: reuse {ttft * 1e3:.0f} ms, full prefill {full * 1e3:.0f} ms -> "
          f"{full / max(ttft, 1e-9):.2f}x faster (full/reuse); mean reused {statistics.fmean(r.reuse_ratio for r in rows):.0%}"
          f" of prompt tokens")
    print(f"  total {seconds:.1f} s")


def run(model: str, questions: int, top_k: int, max_new_tokens: int, progress: bool | None = None) -> int:
    try:
        from langchain_kvboost import ChatKVBoost
    except ImportError as exc:
        raise SystemExit(f"the demo needs LangChain: pip install 'kvboost-rag[langchain]' ({exc})") from exc
    t0 = time.perf_counter()
    chat = ChatKVBoost.from_model_id(model, device="cpu", max_tokens=max_new_tokens)
    corpus = rc.load_corpus("eval")
    qs = corpus.questions[::max(1, len(corpus.questions) // max(questions, 1))][:questions]
    cfg = chat.rag.engine.config
    setting = f"{cfg.repair}, recompute_ratio {cfg.recompute_ratio}, check layer {cfg.check_layer}"
    print(f"model: {model}; corpus: {len(corpus.documents)} documents (held-out set); {len(qs)} questions; "
          f"top-k {top_k}; repair: {setting}")
    report = chat.warm_documents([rc.doc_text(d) for d in corpus.documents], show_progress=progress)
    print(f"warmed {report.warmed} documents ({report.tokens} tokens, {report.bytes / 2**20:.1f} MiB) in "
          f"{report.seconds:.1f} s (once, at ingestion)")
    chain = build_chain(chat, corpus, top_k)
    chain.invoke({"input": "warm-up"})  # untimed: lazy initialisation stays out of the first TTFT
    rows = []
    for i, q in enumerate(qs, 1):
        rows.append(ask(chain, chat, q, max_new_tokens))
        print_row(i, rows[-1])
    print_summary(rows, time.perf_counter() - t0, setting)
    return 0
