"""KVWarmer, StableOrderPostprocessor and stock LlamaIndex query engines over KVBoostLLM (tiny random model)."""

from __future__ import annotations

import math
import re

import pytest

pytest.importorskip("llama_index.core")

import xxhash  # noqa: E402
from conftest import make_tiny_model  # noqa: E402
from llama_index.core import Settings, VectorStoreIndex  # noqa: E402
from llama_index.core.embeddings import BaseEmbedding  # noqa: E402
from llama_index.core.ingestion import IngestionCache, IngestionPipeline  # noqa: E402
from llama_index.core.schema import MetadataMode, NodeWithScore, TextNode  # noqa: E402
from llama_index.llms.kvboost import KVBoostLLM, KVWarmer, StableOrderPostprocessor  # noqa: E402

from kvboost_core.engine import KVEngine  # noqa: E402

N_NEW = 8
NAMES = ["Alice", "Bruno", "Chen", "Dara", "Emil", "Fatou", "Goran", "Hana", "Ivo", "Jun"]
CITIES = ["Portvale", "Essberg", "Lunmoor", "Tarrow", "Quill", "Brask", "Oddby", "Sennet", "Varn", "Wexley"]
JOBS = ["chemist", "baker", "pilot", "farmer", "painter", "sailor", "tailor", "miner", "judge", "singer"]


def _corpus() -> list[TextNode]:
    nodes = []
    for i in range(20):
        n, c, j = NAMES[i % 10], CITIES[(i * 3) % 10], JOBS[(i * 7) % 10]
        text = (f"{n} lives in {c} and works as a {j}. The {c} market opens at {i % 12 + 1} and sells "
                f"{'bread' if i % 2 else 'fish'}. {n} has {i + 2} cats.")
        nodes.append(TextNode(text=text, id_=f"doc-{i}", metadata={"source": f"doc{i}.txt"}))
    return nodes


class HashEmbedding(BaseEmbedding):
    """Deterministic local bag-of-words embedding (hashed words, L2-normalized): no downloads."""

    dim: int = 256

    def _vec(self, text: str) -> list[float]:
        v = [0.0] * self.dim
        for w in re.findall(r"[a-z0-9]+", text.lower()):
            v[xxhash.xxh32_intdigest(w.encode()) % self.dim] += 1.0
        norm = math.sqrt(sum(x * x for x in v)) or 1.0
        return [x / norm for x in v]

    def _get_text_embedding(self, text: str) -> list[float]:
        return self._vec(text)

    def _get_query_embedding(self, query: str) -> list[float]:
        return self._vec(query)

    async def _aget_query_embedding(self, query: str) -> list[float]:
        return self._vec(query)


@pytest.fixture(scope="module", autouse=True)
def _local_settings():
    """LlamaIndex must never fetch anything: a local embedding globally; the LLM is always passed explicitly."""
    old = Settings._embed_model
    Settings.embed_model = HashEmbedding()
    yield
    Settings._embed_model = old


@pytest.fixture(scope="module")
def model():
    return make_tiny_model("llama", max_positions=2048)


@pytest.fixture
def engine(model, tokenizer):
    return KVEngine(model, tokenizer)


@pytest.fixture
def llm(engine):
    return KVBoostLLM(engine=engine, max_new_tokens=N_NEW)


@pytest.fixture(scope="module")
def nodes():
    return _corpus()


@pytest.fixture(scope="module")
def index(nodes):
    return VectorStoreIndex(nodes, embed_model=HashEmbedding())


def _texts(nodes) -> list[str]:
    return [n.get_content(metadata_mode=MetadataMode.LLM) for n in nodes]


def _warm_in(engine: KVEngine, texts: list[str]) -> int:
    """How many of ``texts`` are fully warm in ``engine``'s store (engine.warm on warm docs only looks up)."""
    return engine.warm(texts).already_warm


# ---------------------------------------------------------------------------------------------------- KVWarmer
def test_warmer_warms_llm_rendering_and_returns_nodes(llm, nodes):
    warmer = KVWarmer(llm, batch_size=4)
    assert KVWarmer.class_name() == "KVWarmer"
    sub = nodes[:4]
    out = IngestionPipeline(transformations=[warmer], cache=None).run(nodes=sub)
    assert [n.node_id for n in out] == [n.node_id for n in sub]
    assert _texts(out) == _texts(sub)  # unchanged
    assert warmer.last_report is not None
    # exactly the LLM rendering (metadata included) was warmed, not the bare text
    assert "source: doc0.txt" in _texts(sub)[0]
    assert _warm_in(llm.engine, _texts(sub)) == len(sub)


def test_pipeline_cache_never_skips_warming_a_fresh_store(model, tokenizer, nodes):
    cache = IngestionCache()
    sub = nodes[:5]
    llm1 = KVBoostLLM(engine=KVEngine(model, tokenizer), max_new_tokens=N_NEW)
    IngestionPipeline(transformations=[KVWarmer(llm1)], cache=cache).run(nodes=sub)
    assert _warm_in(llm1.engine, _texts(sub)) == len(sub)

    # Same store again: the cached result is valid and used (warming is not redone).
    calls = []
    w1 = KVWarmer(llm1)
    orig = w1._rag.warm_documents
    w1._rag.warm_documents = lambda *a, **k: calls.append(1) or orig(*a, **k)
    try:
        IngestionPipeline(transformations=[w1], cache=cache).run(nodes=sub)
    finally:
        del w1._rag.warm_documents
    assert calls == []

    # A new engine with a fresh store, the same cache: the documents must end up warm there.
    engine2 = KVEngine(model, tokenizer)
    IngestionPipeline(transformations=[KVWarmer(engine2)], cache=cache).run(nodes=sub)
    assert _warm_in(engine2, _texts(sub)) == len(sub)

    # A cleared store (same instance): warming happens again too.
    engine2.clear()
    IngestionPipeline(transformations=[KVWarmer(engine2)], cache=cache).run(nodes=sub)
    assert _warm_in(engine2, _texts(sub)) == len(sub)


def test_warmer_async_pipeline(llm, nodes):
    import asyncio

    sub = nodes[5:8]
    out = asyncio.run(IngestionPipeline(transformations=[KVWarmer(llm)], cache=IngestionCache()).arun(nodes=sub))
    assert [n.node_id for n in out] == [n.node_id for n in sub]
    assert _warm_in(llm.engine, _texts(sub)) == len(sub)


# ---------------------------------------------------------------------------------------------------- ordering
def test_stable_order_postprocessor(nodes):
    from kvboost_rag.registry import doc_key

    pp = StableOrderPostprocessor()
    assert StableOrderPostprocessor.class_name() == "StableOrderPostprocessor"
    scored = [NodeWithScore(node=n, score=1.0 - i / 10) for i, n in enumerate(nodes[:5])]
    a = pp.postprocess_nodes(scored)
    b = pp.postprocess_nodes(list(reversed(scored)))
    assert [n.node.node_id for n in a] == [n.node.node_id for n in b]
    keys = [doc_key(n.node.get_content(metadata_mode=MetadataMode.LLM)) for n in a]
    assert keys == sorted(keys)


# ---------------------------------------------------------------------------------------------------- query engines
# Both retrieve doc-0, doc-10, doc-12 and doc-2 (top 4), doc-0/doc-10 in opposite orders.
Q1 = "Alice chemist Portvale fish 1 2 Chen"
Q2 = "Alice chemist Portvale fish 11 12 Chen"
K = 4
KEYS = ("doc_tokens", "doc_tokens_reused", "doc_tokens_kept", "doc_tokens_recomputed", "reused_exact", "recomputed")


def _spy_prompts(llm: KVBoostLLM) -> list[str]:
    """Record the prompts the synthesizer sends (test-only instrumentation of the adapter)."""
    prompts: list[str] = []
    gen = llm.rag.generate

    def spy(prompt, **kw):
        prompts.append(prompt)
        return gen(prompt, **kw)

    llm.rag.generate = spy
    return prompts


def test_retrieval_overlaps_in_different_orders(index):
    r = index.as_retriever(similarity_top_k=K)
    ids1 = [n.node.node_id for n in r.retrieve(Q1)]
    ids2 = [n.node.node_id for n in r.retrieve(Q2)]
    assert set(ids1) == set(ids2) and ids1 != ids2, (ids1, ids2)


@pytest.mark.parametrize("mode", ["compact", "refine", "tree_summarize"])
def test_query_engine_modes_reuse(llm, index, nodes, mode):
    """A stock VectorStoreIndex query engine, engine defaults (cacheblend, recompute_ratio 0.15)."""
    llm.warm_documents(nodes, progress=False)
    qe = index.as_query_engine(llm=llm, response_mode=mode, similarity_top_k=K,
                               node_postprocessors=[StableOrderPostprocessor()])
    r1 = qe.query(Q1)
    assert isinstance(r1.response, str) and len(r1.source_nodes) == K
    s1 = llm.last_stats
    assert s1["mode"] == "transparent" and s1["documents"] >= 1
    assert s1["doc_tokens"] > 0 and s1["doc_tokens_reused"] > 0, s1
    assert s1["doc_tokens_reused"] == s1["doc_tokens"]  # every document token was served from the cache
    assert s1["doc_tokens_kept"] > 0
    qe.query(Q2)
    s2 = llm.last_stats
    print(f"\n{mode}: first {[s1[k] for k in KEYS]} second {[s2[k] for k in KEYS]} "
          f"reused {s2['doc_tokens_reused'] / s2['doc_tokens']:.3f} kept {s2['doc_tokens_kept'] / s2['doc_tokens']:.3f}")
    assert s2["doc_tokens_reused"] == s2["doc_tokens"]
    # Every document token is reused and CacheBlend recomputes up to recompute_ratio of them. The first
    # query's repaired KV is not served to the second (its selection depended on the first question), so
    # with a stable order the second query's documents cost what the first's did.
    assert s2["doc_tokens_kept"] >= 0.8 * s2["doc_tokens"], (mode, s2)
    if mode != "refine":
        assert [s2[k] for k in KEYS[:4]] == [s1[k] for k in KEYS[:4]]


def test_simple_summarize_and_unwarmed_fall_back(model, tokenizer, index, nodes):
    fresh = KVBoostLLM(engine=KVEngine(model, tokenizer), max_new_tokens=N_NEW)  # nothing warmed
    r = index.as_query_engine(llm=fresh, response_mode="compact", similarity_top_k=3).query("Who is a baker?")
    assert isinstance(r.response, str)
    assert fresh.last_stats["doc_tokens_reused"] == 0 and fresh.last_stats["mode"] == "plain"
    warm = KVBoostLLM(engine=KVEngine(model, tokenizer), max_new_tokens=N_NEW)
    warm.warm_documents(nodes, progress=False)
    r = index.as_query_engine(llm=warm, response_mode="simple_summarize", similarity_top_k=3).query("Who is a baker?")
    assert isinstance(r.response, str)  # whatever simple_summarize does to the text, no error
    assert warm.last_stats["doc_tokens"] >= 0


def test_end_to_end_overlapping_queries(model, tokenizer, nodes, index):
    """20 documents warmed by an ingestion pipeline with KVWarmer; two queries retrieve the same documents in
    different orders; StableOrderPostprocessor makes the second prompt's documents an exact prefix hit, so even
    under repair="full" it reuses >= 90% of its document tokens, and its answer equals both a cold
    repair="full" run and HuggingFaceLLM's greedy answer on the same prompt."""
    engine = KVEngine(model, tokenizer)
    llm = KVBoostLLM(engine=engine, max_new_tokens=N_NEW, repair="full")
    IngestionPipeline(transformations=[KVWarmer(llm)]).run(nodes=nodes)
    assert _warm_in(engine, _texts(nodes)) == 20

    prompts = _spy_prompts(llm)
    qe = index.as_query_engine(llm=llm, response_mode="compact", similarity_top_k=K,
                               node_postprocessors=[StableOrderPostprocessor()])
    qe.query(Q1)
    answer = qe.query(Q2).response
    s = llm.last_stats
    print(f"\ne2e (repair=full) second query {dict((k, s[k]) for k in KEYS)} ttft {s['ttft_s'] * 1e3:.1f} ms")
    assert s["doc_tokens_reused"] >= 0.9 * s["doc_tokens"], s
    assert s["doc_tokens_kept"] >= 0.9 * s["doc_tokens"], s  # not recomputed: an exact prefix

    cold = KVBoostLLM(engine=KVEngine(model, tokenizer), max_new_tokens=N_NEW, repair="full")
    cold_answer = index.as_query_engine(llm=cold, response_mode="compact", similarity_top_k=K,
                                        node_postprocessors=[StableOrderPostprocessor()]).query(Q2).response
    assert cold.last_stats["doc_tokens_kept"] == 0
    assert answer == cold_answer
    hf_mod = pytest.importorskip("llama_index.llms.huggingface")
    hf = hf_mod.HuggingFaceLLM(model=model, tokenizer=tokenizer, max_new_tokens=N_NEW, context_window=2048,
                               generate_kwargs={"do_sample": False}, tokenizer_outputs_to_remove=["token_type_ids"])
    assert answer == hf.complete(prompts[-1]).text


def test_end_to_end_default_repair_reuse(model, tokenizer, nodes, index):
    """The same flow under the engine's default repair (cacheblend): the second query reuses every document
    token and keeps >= 80% unrepaired (recompute_ratio 0.15; the first query's repaired KV is not served)."""
    llm = KVBoostLLM(engine=KVEngine(model, tokenizer), max_new_tokens=N_NEW)
    IngestionPipeline(transformations=[KVWarmer(llm)]).run(nodes=nodes)
    qe = index.as_query_engine(llm=llm, response_mode="compact", similarity_top_k=K,
                               node_postprocessors=[StableOrderPostprocessor()])
    qe.query(Q1)
    s1 = llm.last_stats
    qe.query(Q2)
    s2 = llm.last_stats
    print(f"\ne2e (cacheblend) first {dict((k, s1[k]) for k in KEYS)}\n  second {dict((k, s2[k]) for k in KEYS)}")
    assert s1["doc_tokens_reused"] > 0 and s1["doc_tokens_kept"] > 0
    assert s2["doc_tokens_reused"] >= 0.9 * s2["doc_tokens"], s2
    assert s2["doc_tokens_kept"] >= 0.8 * s2["doc_tokens"], s2
