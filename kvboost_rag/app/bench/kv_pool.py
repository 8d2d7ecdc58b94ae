"""The server's decode batch over a shared page pool against dense rows, side by side in one process (issue #36).

``c`` requests over the same documents (about ``--doc-tokens`` of heldout documents, in one order), each with its
own question, are prefilled as the server prefills them (the chat template, the warmed documents, the canonical
path), then held by each decoder in turn:

- ``dense``: :class:`kvboost_core.serving.batch.BatchedDecoder`, a row of every layer's K/V per request;
- ``paged``: :class:`kvboost_core.serving.paged_batch.PagedBatchedDecoder`, pages of one pool, full pages with the
  same contents held once.

Per decoder: the KV bytes it holds for the ``c`` requests (dense: its buffers; paged: pages in use) against one
request's, the process's resident memory growth when they join, greedy decode tokens/s over ``--steps`` steps at
batch ``c`` (after 2 warm-up steps), and whether both decoders produced the same tokens; the pool's KV again with
each request's documents in another order (``paged_shuffled``: what same-position sharing gives up). Then the
largest batch a
fixed budget (``--budget-requests`` requests' worth of dense KV) holds: dense by its rows' bytes, paged by adding
requests to a pool of that size until it is full.

    OMP_NUM_THREADS=1 python benchmarks/bench_kv_pool.py --threads 1 --json benchmarks/results/kv_pool.json
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
import time
from collections.abc import Sequence
from typing import Any

from kvboost_rag.app.bench import write_json
from kvboost_rag.app.bench.rag_chat import DEFAULT_MODEL, messages


def _rss() -> int:
    with open("/proc/self/statm") as f:
        import os

        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _workload(doc_tokens: int, n: int, count_tokens: Any) -> tuple[list[str], list[str]]:
    """(documents of about ``doc_tokens`` tokens in one order, ``n`` questions) from the heldout split."""
    from importlib import resources

    data = json.loads(resources.files("kvboost_rag.app.assets").joinpath("rag_corpus/heldout.json").read_text())
    docs, total = [], 0
    for d in data["documents"]:
        if total >= doc_tokens:
            break
        docs.append(d["text"])
        total += count_tokens(d["text"])
    return docs, [q["question"] for q in data["questions"][:n]]


def _prefilled(rag: Any, docs: list[str], question: str) -> Any:
    from kvboost_core.serving.batch import prefill

    prompt = rag.chat_prompt(messages(question, docs))
    plan = rag.plan(prompt, add_special_tokens=rag.chat_add_special_tokens(prompt))
    pre = prefill(rag.engine, plan.segments, add_special_tokens=False)
    pre.store_prefix()  # as the server does after the first token: the next request reads the shared prefix
    return pre.result


def _hold(decoder: Any, pres: list[Any], new_tokens: int) -> tuple[dict[Any, int], int, float]:
    """Add every prefilled request; (slot -> its first token, resident growth in bytes, seconds per add)."""
    import torch

    gc.collect()
    before = _rss()
    live = {}
    t0 = time.perf_counter()
    for pre in pres:
        n = len(pre.token_ids)
        slot = decoder.add(pre.cache.keys, pre.cache.values, n, n + new_tokens)
        live[slot] = int(torch.argmax(pre.last_logits))
    return live, _rss() - before, (time.perf_counter() - t0) / len(pres)


def _decode(decoder: Any, live: dict[Any, int], steps: int) -> tuple[float, list[list[int]]]:
    """Greedy steps for every request (2 warm-up steps, then ``steps`` timed); (tokens/s, tokens per request)."""
    import torch

    slots = list(live)
    tokens: list[list[int]] = [[live[s]] for s in slots]
    elapsed = 0.0
    for i in range(steps + 2):
        t0 = time.perf_counter()
        out = decoder.step({s: tokens[j][-1] for j, s in enumerate(slots)})
        if i >= 2:
            elapsed += time.perf_counter() - t0
        for j, s in enumerate(slots):
            tokens[j].append(int(torch.argmax(out[s])))
    return steps * len(slots) / elapsed, tokens


def _shuffled(rag: Any, driver: Any, docs: list[str], questions: list[str], new: int, budget: int,
              page_tokens: int) -> dict[str, Any]:
    """The same documents in another order per request (seeded shuffles), held in a pool: pages are shared only
    where equal tokens sit at equal positions, so what a moved document costs is measured here."""
    import random

    from kvboost_core.serving.paged_batch import PagedBatchedDecoder

    pres = []
    for i, q in enumerate(questions):
        order = list(docs)
        random.Random(i).shuffle(order)
        pres.append(_prefilled(rag, order, q))
    pool = PagedBatchedDecoder(driver, len(pres), pool_bytes=budget, page_tokens=page_tokens)
    _, grown, _ = _hold(pool, pres, new)
    stats = pool.stats()
    pool.reset()
    return {"kv_bytes": stats.used * pool.pool.page_bytes, "pages_used": stats.used, "pages_shared": stats.shared,
            "rss_growth": grown}


def measure(rag: Any, c: int, doc_tokens: int, steps: int, page_tokens: int, budget_requests: int) -> dict[str, Any]:
    from kvboost_core.serving.batch import BatchedDecoder
    from kvboost_core.serving.paged_batch import PagedBatchedDecoder
    from kvboost_core.serving.pages import PoolFull

    docs, questions = _workload(doc_tokens, max(c, 64), rag.count_tokens)
    t0 = time.perf_counter()
    rag.warm_documents(docs, show_progress=False)
    warm_s = time.perf_counter() - t0
    pres = [_prefilled(rag, docs, q) for q in questions[:c]]
    driver = rag.engine.driver
    per_token = 2 * driver.num_layers * driver.num_kv_heads * driver.head_dim * 4
    new = steps + 4
    one_request = per_token * (len(pres[0].token_ids) + new)
    out: dict[str, Any] = {"prompt_tokens": [len(p.token_ids) for p in pres], "documents": len(docs),
                           "warm_s": warm_s, "one_request_kv_bytes": one_request}

    dense = BatchedDecoder(driver, c)
    live, grown, add_s = _hold(dense, pres, new)
    held = dense.used_bytes()
    tps, dense_tokens = _decode(dense, live, steps)
    out["dense"] = {"kv_bytes": held, "buffer_bytes": dense.nbytes, "rss_growth": grown, "tokens_per_s": tps,
                    "add_s": add_s}
    for s in list(live):
        dense.remove(s)
    del dense
    gc.collect()

    budget = one_request * c * 2  # room for every request unshared, twice: the pool is not what limits here
    paged = PagedBatchedDecoder(driver, c, pool_bytes=budget, page_tokens=page_tokens)
    live, grown, add_s = _hold(paged, pres, new)
    stats = paged.stats()
    tps, paged_tokens = _decode(paged, live, steps)
    out["paged"] = {"kv_bytes": stats.used * paged.pool.page_bytes, "pages_used": stats.used,
                    "pages_shared": stats.shared, "page_bytes": paged.pool.page_bytes, "rss_growth": grown,
                    "tokens_per_s": tps, "add_s": add_s}
    out["same_tokens"] = paged_tokens == dense_tokens
    for s in list(live):
        paged.remove(s)
    del paged
    gc.collect()
    out["paged_shuffled"] = _shuffled(rag, driver, docs, questions[:c], new, budget, page_tokens)

    fixed = one_request * budget_requests
    pool = PagedBatchedDecoder(driver, len(questions), pool_bytes=fixed, page_tokens=page_tokens)
    fits = 0
    try:
        for i, q in enumerate(questions):
            pre = pres[i] if i < len(pres) else _prefilled(rag, docs, q)  # one at a time: the pool copies it
            n = len(pre.token_ids)
            pool.add(pre.cache.keys, pre.cache.values, n, n + new)
            fits += 1
    except PoolFull:
        pass
    out["budget"] = {"bytes": fixed, "dense_requests": fixed // one_request, "paged_requests": fits,
                     "paged_capped": fits == len(questions)}
    pool.reset()
    return out


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=DEFAULT_MODEL)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--doc-tokens", type=int, default=4000, help="tokens of documents every request shares")
    ap.add_argument("--steps", type=int, default=16)
    ap.add_argument("--page-tokens", type=int, default=16)
    ap.add_argument("--budget-requests", type=int, default=2,
                    help="the fixed budget, in requests' worth of unshared KV")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    import torch

    from kvboost_rag import KVBoostRAG

    torch.set_num_threads(args.threads)
    rag = KVBoostRAG.from_model_id(args.model)
    r = measure(rag, args.concurrency, args.doc_tokens, args.steps, args.page_tokens, args.budget_requests)
    result = {"model": args.model, "threads": args.threads, "concurrency": args.concurrency,
              "page_tokens": args.page_tokens, "steps": args.steps, **r,
              "command": "python benchmarks/bench_kv_pool.py " + " ".join(sys.argv[1:] if argv is None else argv)}
    d, p, one = r["dense"], r["paged"], r["one_request_kv_bytes"]
    print(f"{args.concurrency} requests over {r['documents']} documents (prompts {min(r['prompt_tokens'])}-"
          f"{max(r['prompt_tokens'])} tokens): KV held dense {d['kv_bytes'] / one:.2f}x one request's, paged "
          f"{p['kv_bytes'] / one:.2f}x ({p['pages_shared']} of {p['pages_used']} pages shared); RSS growth dense "
          f"{d['rss_growth'] / 2**20:.0f} MiB, paged {p['rss_growth'] / 2**20:.0f} MiB; decode dense "
          f"{d['tokens_per_s']:.1f} tok/s, paged {p['tokens_per_s']:.1f} tok/s; same tokens {r['same_tokens']}; "
          f"a budget of {args.budget_requests} requests holds dense {r['budget']['dense_requests']}, paged "
          f"{r['budget']['paged_requests']}{'+' if r['budget']['paged_capped'] else ''}; shuffled orders: paged "
          f"{r['paged_shuffled']['kv_bytes'] / one:.2f}x ({r['paged_shuffled']['pages_shared']} of "
          f"{r['paged_shuffled']['pages_used']} pages shared)", flush=True)
    write_json(args.json, result)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
