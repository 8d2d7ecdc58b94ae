"""TTFT of long RAG chats (``kvboost-rag bench rag --ttft-k K``): plain HF full prefill against each reuse
setting through the transparent path, side by side in one process.

The chats are the quality benchmark's (:mod:`.rag_chat`) with ``k`` held-out documents each; TTFT counts from
the call's start. Medians over ``rounds`` per prompt, then over prompts; speedup = full / reuse.
"""

from __future__ import annotations

import statistics
import time
from typing import Any

from kvboost_rag.app.bench.rag_chat import messages


def ttft_long(rag: Any, k: int, n_prompts: int, settings: dict[str, dict[str, Any]], rounds: int = 2,
              seed: int = 1, block_rag: Any = None) -> dict[str, Any]:
    """TTFT of ``n_prompts`` chats of ``k`` eval documents: HF full prefill (``logits_to_keep=1``) and each of
    ``settings`` (engine kwargs) on ``rag``; with ``block_rag`` also its ``block`` setting (the adapted model at
    ``repair="none"``), side by side with the base model's HF prefill."""
    import torch

    from kvboost_rag.app import rag_corpus as rc

    corpus = rc.load_corpus("eval")
    rag.warm_documents([rc.doc_text(d) for d in corpus.documents], progress=False)
    eng = rag.engine
    owners = {s: (rag, kw) for s, kw in settings.items()}
    if block_rag is not None:
        block_rag.warm_documents([rc.doc_text(d) for d in corpus.documents], progress=False)
        owners["block"] = (block_rag, {"repair": "none"})
    rows: dict[str, list[float]] = {"full": [], **{s: [] for s in owners}}
    lengths = []
    for q, docs in rc.retrieval_sets(corpus, k, seed)[:n_prompts]:
        prompt = rag.chat_prompt(messages(q.question, [rc.doc_text(d) for d in docs]))
        special = rag.chat_add_special_tokens(prompt)
        ids = rag.encode(prompt, special)
        lengths.append(len(ids))
        per: dict[str, list[float]] = {s: [] for s in rows}
        for _ in range(rounds):
            with torch.inference_mode():
                t0 = time.perf_counter()
                eng.model(input_ids=torch.tensor([ids]), logits_to_keep=1)
                per["full"].append(time.perf_counter() - t0)
            for name, (owner, kw) in owners.items():
                res = owner.generate(prompt, max_new_tokens=1, add_special_tokens=special, store_prefix=False, **kw)
                per[name].append(res.stats["ttft_s"])
        for s, v in per.items():
            rows[s].append(statistics.median(v))
    full = statistics.median(rows["full"])
    return {"k": k, "prompts": n_prompts, "rounds": rounds, "prompt_tokens_median": statistics.median(lengths),
            "ttft_s": {s: statistics.median(v) for s, v in rows.items()},
            "speedup": {s: full / statistics.median(v) for s, v in rows.items() if s != "full"},
            "settings": settings}


def print_ttft(result: dict[str, Any]) -> None:
    from kvboost_rag.app.fmt import ratio_speedup

    print(f"{result['prompt_tokens_median']} prompt tokens (median), {result['prompts']} prompts")
    for s, t in result["ttft_s"].items():
        sp = result["speedup"].get(s)
        print(f"  {s:<22} TTFT {t:.3f} s" + (f"  {ratio_speedup(sp)}" if sp else ""))
