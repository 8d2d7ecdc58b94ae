"""LlamaIndex RAG with kvboost: warm documents during ingestion, then query a stock VectorStoreIndex.

    python examples/llamaindex_rag.py                    # a tiny random in-process model (answers are noise)
    python examples/llamaindex_rag.py --model ./my-llama  # a local HuggingFace model directory

Nothing is downloaded: the embedding is a local hashed bag-of-words, and the LLM is passed explicitly.
Printed per query: the answer, how many document tokens reused cached KV, and the time to first token,
next to a cold run (same model, nothing warmed) for comparison.
"""

from __future__ import annotations

import argparse
import time

from llama_index.core import Settings, VectorStoreIndex
from llama_index.core.ingestion import IngestionPipeline
from llama_index.core.schema import Document
from llama_index.llms.kvboost import KVBoostLLM, KVHashEmbedding, KVWarmer, StableOrderPostprocessor

from kvboost_core import KVEngine


def _tiny() -> tuple[object, object, list[str]]:
    """(model, tokenizer, documents) built in-process."""
    from kvboost_rag.tiny import synthetic_facts, tiny_model_and_tokenizer

    model, tok = tiny_model_and_tokenizer()
    return model, tok, synthetic_facts(20)


QUESTIONS = [
    "Where does Alice live and what is her job?",
    "What job does Alice have, and where does she live?",  # the same documents, asked differently
    "Who was born in Essberg or lives in Portvale?",
]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", help="local HuggingFace model directory (default: a tiny in-process model)")
    ap.add_argument("--top-k", type=int, default=3)
    ap.add_argument("--max-new-tokens", type=int, default=16)
    ap.add_argument("--mode", default="compact", help="response_mode: compact, refine, tree_summarize, ...")
    args = ap.parse_args()

    Settings.embed_model = embed = KVHashEmbedding()
    if args.model:
        llm = KVBoostLLM.from_model_id(args.model, max_new_tokens=args.max_new_tokens)
        cold = KVBoostLLM(engine=KVEngine(llm.engine.model, llm.engine.tokenizer, store_prefix=False),
                          max_new_tokens=args.max_new_tokens)
        texts = [f"Fact {i + 1}: document {i + 1} of the demo corpus." for i in range(20)]
        try:
            from kvboost_rag.tiny import synthetic_facts

            texts = synthetic_facts(20)
        except ImportError:
            pass
    else:
        model, tok, texts = _tiny()
        llm = KVBoostLLM(engine=KVEngine(model, tok), max_new_tokens=args.max_new_tokens)
        cold = KVBoostLLM(engine=KVEngine(model, tok, store_prefix=False), max_new_tokens=args.max_new_tokens)
    Settings.llm = llm  # nothing falls back to a remote default

    # Ingestion: embed, then warm (KVWarmer last: it renders each node exactly as the synthesizer will).
    t0 = time.perf_counter()
    warmer = KVWarmer(llm)
    nodes = IngestionPipeline(transformations=[embed, warmer]).run(documents=[Document(text=t) for t in texts])
    rep = warmer.last_report
    print(f"ingested and warmed {len(nodes)} nodes in {time.perf_counter() - t0:.2f}s ({rep})")

    index = VectorStoreIndex(nodes, embed_model=embed)
    post = [StableOrderPostprocessor()]  # same documents -> same prompt -> exact prefix hits
    qe = index.as_query_engine(llm=llm, response_mode=args.mode, similarity_top_k=args.top_k,
                               node_postprocessors=post)
    qe_cold = index.as_query_engine(llm=cold, response_mode=args.mode, similarity_top_k=args.top_k,
                                    node_postprocessors=post)
    for q in QUESTIONS:
        answer = qe.query(q).response
        s = llm.last_stats
        qe_cold.query(q)
        c = cold.last_stats
        reused, kept, total = s.get("doc_tokens_reused", 0), s.get("doc_tokens_kept", 0), s.get("doc_tokens", 0)
        print(f"\nQ: {q}\nA: {answer!r}\n   documents found: {s.get('documents', 0)}, document tokens from cache "
              f"{reused}/{total} ({reused / max(total, 1):.0%}), kept unrepaired {kept / max(total, 1):.0%}, "
              f"prompt tokens {s.get('prompt_tokens')}, "
              f"TTFT {s['ttft_s'] * 1e3:.1f} ms (cold {c['ttft_s'] * 1e3:.1f} ms)\n   "
              f"exact-prefix {s.get('reused_exact')}, re-placed kept {s.get('reused_approx')}, "
              f"recomputed {s.get('recomputed')}, computed {s.get('computed')}")


if __name__ == "__main__":
    main()
