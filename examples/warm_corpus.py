"""Warm a corpus once, then show that a second warm is a cheap lookup.

    python examples/warm_corpus.py                 # tiny random model built in-process (no download)
    python examples/warm_corpus.py --model PATH    # any supported HF causal LM (local path or hub id)
"""

from __future__ import annotations

import argparse

from kvboost_core import KVEngine
from kvboost_rag import KVBoostRAG
from kvboost_rag.tiny import synthetic_facts, tiny_model_and_tokenizer


def build(model_path: str | None) -> KVBoostRAG:
    if model_path:
        return KVBoostRAG.from_model_id(model_path)
    model, tok = tiny_model_and_tokenizer()
    return KVBoostRAG(KVEngine(model, tok))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="HF model path or id (default: a tiny random Llama)")
    parser.add_argument("--docs", type=int, default=20, help="number of synthetic documents")
    parser.add_argument("--batch-size", type=int, default=8)
    args = parser.parse_args(argv)

    rag = build(args.model)
    docs = synthetic_facts(args.docs)
    first = rag.warm_documents(docs, batch_size=args.batch_size, progress=True)
    print(f"first warm : {first.warmed} warmed, {first.already_warm} already warm, {first.tokens} tokens, "
          f"{first.bytes / 1e6:.2f} MB in {first.seconds:.2f}s")
    again = rag.warm_documents(docs, batch_size=args.batch_size, progress=False)
    print(f"second warm: {again.warmed} warmed, {again.already_warm} already warm in {again.seconds * 1e3:.1f} ms")
    stats = rag.engine.stats()
    print(f"store      : {stats['entries']} entries, {stats['bytes'] / 1e6:.2f} MB, "
          f"{len(rag.registry)} documents registered")


if __name__ == "__main__":
    main()
