"""A stock LangChain retrieval chain (FAISS + create_retrieval_chain) on KVBoostLLM with warmed documents.

    python examples/langchain_rag.py                 # tiny random model built in-process (no download)
    python examples/langchain_rag.py --model PATH    # any supported HF causal LM (local path or hub id)

The chain is unchanged LangChain; documents warmed at indexing time are found inside the prompts it builds
and their KV reused. With the tiny random model the answers are noise; the reuse ratios and TTFTs are real.
"""

from __future__ import annotations

import argparse

from langchain_classic.chains import create_retrieval_chain
from langchain_classic.chains.combine_documents import create_stuff_documents_chain
from langchain_community.vectorstores import FAISS
from langchain_core.documents import Document
from langchain_core.prompts import PromptTemplate
from langchain_kvboost import KVBoostLLM, KVHashEmbeddings, add_documents_warmed

from kvboost_core import KVEngine
from kvboost_rag.tiny import synthetic_facts, tiny_model_and_tokenizer

PROMPT = PromptTemplate.from_template(
    "System: Use the following pieces of retrieved context to answer the question. If you do not know the "
    "answer, say that you do not know.\n\n{context}\n\nQuestion: {input}\nAnswer:")
QUESTIONS = ["Where does Dana live?", "What does Dana do on weekends?", "Who lives in Portvale?",
             "When was Alice born?"]


def build_llm(model_path: str | None, max_tokens: int) -> KVBoostLLM:
    if model_path:
        return KVBoostLLM.from_model_id(model_path, max_tokens=max_tokens)
    model, tok = tiny_model_and_tokenizer()
    return KVBoostLLM(engine=KVEngine(model, tok), max_tokens=max_tokens, model_id="kvboost-tiny-random")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="HF model path or id (default: a tiny random Llama)")
    parser.add_argument("--k", type=int, default=3, help="documents retrieved per question")
    parser.add_argument("--max-tokens", type=int, default=16)
    args = parser.parse_args(argv)

    llm = build_llm(args.model, args.max_tokens)
    docs = [Document(page_content=t, metadata={"id": i}) for i, t in enumerate(synthetic_facts(20))]
    store = FAISS.from_documents(docs[:1], KVHashEmbeddings())
    add_documents_warmed(store, docs[1:], llm)  # index and warm together
    llm.warm_documents(docs[:1], progress=False)
    chain = create_retrieval_chain(store.as_retriever(search_kwargs={"k": args.k}),
                                   create_stuff_documents_chain(llm, PROMPT))
    for q in QUESTIONS:
        out = chain.invoke({"input": q})
        s = llm.last_stats
        share = s["doc_tokens_reused"] / s["doc_tokens"] if s["doc_tokens"] else 0.0
        print(f"Q: {q}\n   A: {out['answer']!r}\n   docs found {s['documents']}/{len(out['context'])}, "
              f"doc tokens reused {s['doc_tokens_reused']}/{s['doc_tokens']} ({share:.0%}; "
              f"{s['doc_tokens_kept']} kept as is), "
              f"prompt reuse {s['reuse_ratio']:.0%}, TTFT {s['ttft_s'] * 1e3:.0f} ms")


if __name__ == "__main__":
    main()
