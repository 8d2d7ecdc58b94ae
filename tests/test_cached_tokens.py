"""One meaning of "cached tokens" on every surface (issue 34): :class:`kvboost_core.CacheCounts`.

``cached`` is exact reuse (a prompt-prefix hit, or a block adapter's own prefill of a re-placed document);
``approximate`` is re-placed or repaired KV kept without recompute, and is never counted as cached. The same
prompt reports the same counts through the server's ``usage`` (the official ``openai`` client), ``/metrics``,
LangChain's ``usage_metadata`` and LlamaIndex's ``additional_kwargs``. The demo model (3M parameters) serves at
its shipped repair (CacheBlend, r=0.15), which keeps most re-placed document tokens: approximate reuse."""

from __future__ import annotations

import dataclasses

import pytest
from _server_fixture import demo_workload, running_server

from kvboost_core import CacheCounts, cache_counts
from kvboost_core.results import GenerationResult

STATS = {"prompt_tokens": 20, "reused_exact": 5, "reused_block": 4, "reused_approx": 3, "reused_repaired": 2,
         "recomputed": 1, "computed": 5, "hits_exact": 5, "hits_repaired": 2, "hits_content": 8}


def _result(**stats) -> GenerationResult:
    return GenerationResult(text="x", token_ids=[5] * 3, prompt_token_ids=[1] * 20, ttft_s=0.0, total_s=0.0,
                            reuse_ratio=0.0, finish_reason="eos", stats=dict(stats))


def test_the_definition():
    c = cache_counts(STATS)
    assert c == CacheCounts(prompt_tokens=20, cached=9, approximate=5, recomputed=1, computed=5,
                            replaced_cached=4, replaced_approximate=3)
    assert c.cached + c.approximate + c.recomputed + c.computed == c.prompt_tokens  # a partition of the prompt
    assert c.reuse_ratio == 14 / 20
    assert cache_counts(None) == CacheCounts(0, 0, 0, 0, 0) and cache_counts({}).reuse_ratio == 0.0
    with pytest.raises(dataclasses.FrozenInstanceError):
        c.cached = 0  # type: ignore[misc]
    assert not hasattr(c, "__dict__")  # slotted
    import kvboost_core

    assert kvboost_core.CacheCounts is CacheCounts and "cache_counts" in kvboost_core.__all__


def test_every_report_counts_it_the_same_way():
    """usage_counts (LangChain, LlamaIndex), call_info, doc_stats, the server's usage and /metrics: block-exact
    reuse is cached, approximate and repaired reuse is not."""
    from kvboost_rag import doc_stats
    from kvboost_rag.reports import call_info, usage_counts

    u = usage_counts(_result(**STATS))
    assert (u["cache_read"], u["cache_read_approximate"]) == (9, 5)
    info = call_info(_result(**STATS))
    assert (info["cached_tokens"], info["cached_tokens_approximate"], info["reused_block"]) == (9, 5, 4)
    # documents at [3, 15): 2 of the exact prefix [0, 5), 2 of the repaired [5, 7), all 8 content hits
    d = doc_stats([(3, 15)], STATS)
    assert (d["doc_tokens_cached"], d["doc_tokens_approximate"]) == (2 + 4, 2 + 3)
    assert d["doc_tokens_kept"] == d["doc_tokens_cached"] + d["doc_tokens_approximate"]
    assert d["doc_tokens_reused"] == 12 and d["doc_tokens_recomputed"] == 8 - 4 - 3
    pytest.importorskip("prometheus_client")
    from kvboost_rag.app.server import protocol
    from kvboost_rag.app.server.metrics import Metrics

    details = protocol.usage(20, 3, cache_counts(STATS))["prompt_tokens_details"]
    assert details == {"cached_tokens": 9, "cached_tokens_approximate": 5}
    m = Metrics()
    m.on_start(0.01, 20, cache_counts(STATS))
    value = m.registry.get_sample_value
    assert value("kvboost_cached_prompt_tokens_total") == 9 and value("kvboost_approximate_prompt_tokens_total") == 5


def test_block_exact_reuse_is_cached(tmp_path, tokenizer):
    """Re-placed documents under a block adapter at repair="none" are exactly that adapted model's prefill:
    cached, not approximate, in LangChain's and LlamaIndex's reports (an untrained adapter: the counts only)."""
    pytest.importorskip("langchain_core")
    pytest.importorskip("llama_index.core")
    from conftest import CORPUS, make_tiny_model
    from helpers import engine_for
    from langchain_kvboost import ChatKVBoost
    from llama_index.llms.kvboost import KVBoostLLM

    from kvboost_core.lora.block_adapter import TARGETS, BlockMeta, LoraHeader, save
    from kvboost_core.lora.reader import ReaderAdapter
    from kvboost_rag import KVBoostRAG

    base = engine_for(make_tiny_model("llama"), tokenizer)
    lora = ReaderAdapter.attach(make_tiny_model("llama"), rank=4, alpha=8.0, base_fingerprint=base.fingerprint)
    save(str(tmp_path), lora.state_dict(), BlockMeta(
        header=LoraHeader(4, 8.0, TARGETS, str(base.fingerprint)),
        warm_prefix=tuple(base.warm_prefix_ids), sink_tokens=base.config.sink_tokens))
    rag = KVBoostRAG(engine_for(make_tiny_model("llama"), tokenizer, block_adapter=str(tmp_path)))
    docs = [CORPUS[1], CORPUS[4]]
    rag.warm_documents(docs, progress=False)
    prompt = "Documents:\n\n" + "\n\n".join(docs[::-1]) + "\n\nWho repairs bicycles?"
    details = ChatKVBoost(engine=rag, max_tokens=2).invoke(prompt).usage_metadata["input_token_details"]
    s = rag.last_stats
    assert s["reused_block"] > 0 and s["reused_approx"] == s["reused_repaired"] == 0
    assert details == {"cache_read": s["reused_exact"] + s["reused_block"], "cache_read_approximate": 0}
    kw = KVBoostLLM(engine=rag, max_new_tokens=2).complete(prompt).additional_kwargs
    assert rag.last_stats["reused_block"] > 0
    assert (kw["cached_tokens"], kw["cached_tokens_approximate"]) == (cache_counts(rag.last_stats).cached, 0)


# ------------------------------------------------------------------------------------- across the surfaces
SYSTEM = "Answer from the documents."


@pytest.fixture(scope="module")
def surfaces(tmp_path_factory):
    """(server, client, docs, in-process rags for LangChain, LlamaIndex and a twin of the server's engine):
    each engine fresh, the same documents warmed, so each has served exactly the prompts the others have."""
    openai = pytest.importorskip("openai")
    pytest.importorskip("httpx")
    pytest.importorskip("langchain_core")
    pytest.importorskip("llama_index.core")
    import httpx

    from kvboost_rag import KVBoostRAG
    from kvboost_rag.app.loading import load_engine

    corpus, _ = demo_workload(0)
    docs = corpus[:6]
    with running_server(tmp_path_factory.mktemp("srv")) as srv:
        assert httpx.post(srv.v1 + "/documents", json={"documents": docs}, timeout=120).status_code == 200
        rags = []
        for _ in range(3):  # LangChain's, LlamaIndex's, and a twin of the server's
            rag = KVBoostRAG(load_engine("demo").engine)
            rag.warm_documents(docs, progress=False)
            rags.append(rag)
        client = openai.OpenAI(base_url=srv.v1, api_key="unused", max_retries=0, timeout=60)
        yield srv, client, docs, rags


def _metrics(srv) -> dict[str, float]:
    import httpx

    names = ("kvboost_prompt_tokens_total", "kvboost_cached_prompt_tokens_total",
             "kvboost_approximate_prompt_tokens_total")
    lines = httpx.get(srv.url + "/metrics", timeout=10).text.splitlines()
    return {n: float(next(ln.split()[-1] for ln in lines if ln.startswith(n + " "))) for n in names}


def _as_served(rag, messages: list[dict[str, str]]) -> tuple[int, int, int]:
    """The server's own prefill path (kvboost_core.serving.batch, run as its scheduler runs it) on a twin engine."""
    from kvboost_core.serving.batch import prefill

    prompt = rag.chat_prompt(messages)
    plan = rag.plan(prompt, add_special_tokens=rag.chat_add_special_tokens(prompt))
    pre = prefill(rag.engine, plan.segments, add_special_tokens=False)
    pre.store_prefix()
    c = cache_counts(pre.result.stats)
    return c.prompt_tokens, c.cached, c.approximate


def _reports(surfaces, user: str, system: str = SYSTEM) -> dict[str, tuple[int, int, int]]:
    """(prompt tokens, cached, approximate) of one chat prompt as each surface reports it, and as the server's
    prefill path counts it on a twin engine."""
    from langchain_core.messages import HumanMessage, SystemMessage
    from langchain_kvboost import ChatKVBoost
    from llama_index.core.base.llms.types import ChatMessage
    from llama_index.llms.kvboost import KVBoostLLM

    srv, client, _, (lc_rag, li_rag, twin) = surfaces
    messages = [{"role": "system", "content": system}, {"role": "user", "content": user}]
    out = {}
    before = _metrics(srv)
    resp = client.chat.completions.create(model="demo", max_tokens=2, temperature=0, messages=messages)
    d = resp.usage.prompt_tokens_details
    out["server usage"] = (resp.usage.prompt_tokens, d.cached_tokens, d.model_extra["cached_tokens_approximate"])
    after = _metrics(srv)
    delta = [int(after[k] - before[k]) for k in after]
    out["/metrics"] = (delta[0], delta[1], delta[2])
    out["server's prefill path"] = _as_served(twin, messages)

    msg = ChatKVBoost(engine=lc_rag, max_tokens=2, temperature=0).invoke([SystemMessage(system),
                                                                          HumanMessage(user)])
    meta = msg.usage_metadata
    out["langchain"] = (meta["input_tokens"], meta["input_token_details"]["cache_read"],
                        meta["input_token_details"]["cache_read_approximate"])
    kv = msg.response_metadata["kvboost"]
    assert (kv["cached_tokens"], kv["cached_tokens_approximate"]) == out["langchain"][1:]
    s = lc_rag.last_stats  # the engine's own figures: approximate reuse is not in cached
    assert out["langchain"] == (s["prompt_tokens"], s["reused_exact"] + s.get("reused_block", 0),
                                s["reused_approx"] + s["reused_repaired"])

    li = KVBoostLLM(engine=li_rag, max_new_tokens=2, is_chat_model=True)
    kw = li.chat([ChatMessage(role="system", content=system), ChatMessage(role="user", content=user)]
                 ).additional_kwargs
    out["llamaindex"] = (kw["prompt_tokens"], kw["cached_tokens"], kw["cached_tokens_approximate"])
    return out


def test_one_prompt_reports_the_same_cached_tokens_on_every_surface(surfaces):
    _, _, docs, _ = surfaces
    user = f"Documents:\n\n{docs[3]}\n\n{docs[1]}\n\nQuestion: Which of these comes first?\nAnswer:"
    first = _reports(surfaces, user)
    assert len(set(first.values())) == 1, first
    n, cached, approx = first["server usage"]
    assert approx > 0  # the re-placed documents were kept without recompute: approximate, never cached
    assert cached + approx < n
    # the same prompt again: its head before the first document is now an exact prefix hit on every surface
    again = _reports(surfaces, user)
    assert len(set(again.values())) == 1, again
    assert again["server usage"][1] > cached and again["server usage"][2] > 0


def test_exact_prefix_reuse_is_cached_on_every_surface(surfaces):
    """A prompt without documents, twice: the second time its KV is an exact prefix hit, counted as cached and
    never as approximate. How much is reused differs by design: the engine's ordinary prefill (completions)
    reuses all but the last token; the server's deterministic prefill (kvboost_core/serving/canonical.py) and the
    in-process chat skins' chat turns (the same canonical chunks, kvboost_core.engine.exact_history) the whole chunks
    before the chunk holding the last token; so the server's reports are compared with its own prefill path, the
    in-process skins with each other, with the server's and with the engine's stats."""
    _, _, _, (lc_rag, _, _) = surfaces
    chunk = lc_rag.engine.config.chunk_size
    system = "Be brief and friendly."  # a head no earlier prompt had
    user = "No documents this time. " + "Say hello to the reader in a few kind words, please. " * 12
    first, again = (_reports(surfaces, user, system) for _ in range(2))
    n = first["server usage"][0]
    assert n > 2 * chunk  # long enough to hold whole chunks
    for r in (first, again):
        assert r["server usage"] == r["/metrics"] == r["server's prefill path"], r
        assert r["langchain"] == r["llamaindex"], r
        assert all(approx == 0 for _, _, approx in r.values()), r
    # the second time: a chat turn reuses the canonical chunks the server reuses, exact
    assert again["langchain"] == again["server usage"] and n - chunk - 1 <= again["langchain"][1] < n
    assert first["server usage"][1] < n - chunk - 1 <= again["server usage"][1] < n
