"""A call's options are one typed value (issue 34, item 2): the repair settings become one ``RepairSpec`` at the
engine's edge and travel down as it, the per-call option names have one source, and both skins merge per-call
options by the same rule (``kvboost_rag.options.merge_call_options``)."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest

from kvboost_core.call_options import CALL_OPTIONS, CallOptions, call_options, repair_spec
from kvboost_core.config import REPAIR_OPTIONS, EngineConfig
from kvboost_core.engine import KVEngine
from kvboost_core.repair import RepairSpec
from kvboost_rag.options import ENGINE_KEYS, merge_call_options
from kvboost_rag.tiny import tiny_model_and_tokenizer


@pytest.fixture(scope="module")
def engine() -> KVEngine:
    return KVEngine(*tiny_model_and_tokenizer())


def test_one_list_of_repair_names_matches_the_spec_the_config_and_the_skins() -> None:
    spec_fields = {f.name for f in dataclasses.fields(RepairSpec)}
    config_fields = {f.name for f in dataclasses.fields(EngineConfig)}
    assert set(REPAIR_OPTIONS) <= spec_fields
    assert set(REPAIR_OPTIONS) - {"reuse_repaired"} <= config_fields  # reuse_repaired is per call only
    assert set(REPAIR_OPTIONS) <= ENGINE_KEYS and set(REPAIR_OPTIONS) <= set(CALL_OPTIONS)


def test_the_config_carries_its_repair_spec_and_a_call_overrides_it() -> None:
    cfg = EngineConfig(repair="cacheblend", recompute_ratio=0.3, check_layer=2)
    assert isinstance(cfg.repair_spec, RepairSpec)
    assert (cfg.repair_spec.repair, cfg.repair_spec.recompute_ratio, cfg.repair_spec.check_layer) == (
        "cacheblend", 0.3, 2)
    spec = repair_spec(cfg, 4, repair="selective", recompute_ratio=None)  # None: the config's
    assert spec == dataclasses.replace(cfg.repair_spec, repair="selective")
    with pytest.raises(ValueError, match="check_layer"):
        repair_spec(cfg, 4, check_layer=9)  # past the model's last layer
    with pytest.raises(ValueError, match="recompute_ratio"):
        repair_spec(cfg, 4, recompute_ratio=1.5)
    with pytest.raises(TypeError, match="typo"):
        repair_spec(cfg, 4, typo=1)


def test_call_options_checks_every_keyword_once() -> None:
    cfg = EngineConfig()
    opts = call_options(cfg, 4, {"repair": "full", "store_prefix": False, "history_tokens": 3, "turn_end": [1]})
    assert isinstance(opts, CallOptions) and opts.spec.repair == "full" and opts.store_prefix is False
    assert opts.chat and opts.turn_end == (1,)
    with pytest.raises(TypeError, match="max_lenght"):
        call_options(cfg, 4, {"max_lenght": 3})
    with pytest.raises(TypeError, match="store_prefix"):
        call_options(cfg, 4, {"store_prefix": "yes"})
    with pytest.raises(ValueError, match="history_tokens"):
        call_options(cfg, 4, {"history_tokens": -1})


def test_the_repair_setting_reaches_the_prefill_as_one_spec(engine: KVEngine, monkeypatch: pytest.MonkeyPatch
                                                             ) -> None:
    """generate(repair=..., recompute_ratio=...) arrives at the prefill as one RepairSpec, built once."""
    from kvboost_core import call_options as co
    from kvboost_core.engine.prefill import PrefillMixin

    seen: list[Any] = []
    built: list[int] = []
    real_prefill, real_spec = PrefillMixin._prefill, co.repair_spec

    def spy_prefill(self: Any, prompt: Any, spec: Any, *a: Any, **k: Any) -> Any:
        seen.append(spec)
        return real_prefill(self, prompt, spec, *a, **k)

    def spy_spec(*a: Any, **k: Any) -> Any:
        built.append(1)
        return real_spec(*a, **k)

    monkeypatch.setattr(PrefillMixin, "_prefill", spy_prefill)
    monkeypatch.setattr(co, "repair_spec", spy_spec)
    engine.generate("one two three", max_new_tokens=2, repair="selective", recompute_ratio=0.25)
    assert len(seen) == 1 and isinstance(seen[0], RepairSpec)
    assert (seen[0].repair, seen[0].recompute_ratio) == ("selective", 0.25)
    assert len(built) == 1  # built once, at the edge
    with pytest.raises(TypeError, match="repiar"):
        engine.generate("one", max_new_tokens=1, repiar="full")


def test_the_merge_rule() -> None:
    defaults = {"max_new_tokens": 8, "temperature": 0.0}
    allowed = {"max_tokens", "max_new_tokens", "temperature", "repair"}
    assert merge_call_options(defaults, {"max_tokens": 3}, allowed, owner="X") == {"max_new_tokens": 3,
                                                                                  "temperature": 0.0}
    assert merge_call_options(defaults, {"repair": "full"}, allowed, owner="X")["repair"] == "full"
    with pytest.raises(TypeError, match="X: max_tokens= repeats max_new_tokens="):
        merge_call_options(defaults, {"max_tokens": 3, "max_new_tokens": 4}, allowed, owner="X")
    with pytest.raises(TypeError, match="top_k"):
        merge_call_options(defaults, {"top_k": 3}, allowed, owner="X")


def test_both_skins_apply_the_same_rule_to_conflicting_keys(engine: KVEngine) -> None:
    lc = pytest.importorskip("langchain_kvboost")
    pytest.importorskip("llama_index.core")
    from llama_index.llms.kvboost import KVBoostLLM as LlamaIndexLLM

    skins = [lc.KVBoostLLM(engine=engine, max_tokens=4), LlamaIndexLLM(engine=engine, max_new_tokens=4)]
    for skin in skins:
        with pytest.raises(TypeError, match="max_tokens= repeats max_new_tokens="):
            skin.invoke("one two", max_tokens=2, max_new_tokens=3) if hasattr(skin, "invoke") else \
                skin.complete("one two", max_tokens=2, max_new_tokens=3)
    outs = [skins[0].invoke("one two", max_new_tokens=2), skins[1].complete("one two", max_tokens=2).text]
    assert outs[0] == outs[1]  # either spelling, either skin: the same 2-token completion
    for skin in skins:  # an option neither uses is refused by both
        with pytest.raises(TypeError, match="top_k"):
            skin.invoke("one", top_k=3) if hasattr(skin, "invoke") else skin.complete("one", top_k=3)


def test_options_built_once_equal_the_keywords(engine: KVEngine) -> None:
    """options= (built by engine.call_options) is the keywords' call: the same tokens; both at once, or a value
    of another type, is a TypeError naming it."""
    by_kw = engine.generate("one two three", max_new_tokens=3, repair="selective", recompute_ratio=0.5)
    built = engine.call_options(repair="selective", recompute_ratio=0.5)
    assert engine.generate("one two three", max_new_tokens=3, options=built).token_ids == by_kw.token_ids
    assert "".join(engine.stream("one two three", 3, options=built)) == by_kw.text
    with pytest.raises(TypeError, match="not both"):
        engine.generate("one", max_new_tokens=1, options=built, repair="full")
    with pytest.raises(TypeError, match="options must be a kvboost_core CallOptions"):
        engine.generate("one", max_new_tokens=1, options={"repair": "full"})


def _spy_options(monkeypatch: pytest.MonkeyPatch) -> tuple[list[Any], list[int]]:
    """(what each KVBoostRAG.generate/stream call got as call_options=, one entry per CallOptions built from
    keywords). A call given loose engine keywords records them instead, so the test below fails on it."""
    from kvboost_core.engine import generation
    from kvboost_rag import KVBoostRAG

    seen: list[Any] = []
    built: list[int] = []
    real_generate, real_stream, real_build = KVBoostRAG.generate, KVBoostRAG.stream, generation.call_options

    def record(k: dict[str, Any]) -> None:
        loose = sorted(set(k) & set(CALL_OPTIONS))
        seen.append(loose or k.get("call_options"))

    def spy_generate(self: Any, *a: Any, **k: Any) -> Any:
        record(k)
        return real_generate(self, *a, **k)

    def spy_stream(self: Any, *a: Any, **k: Any) -> Any:
        record(k)
        return real_stream(self, *a, **k)

    def spy_build(*a: Any, **k: Any) -> Any:
        built.append(1)
        return real_build(*a, **k)

    monkeypatch.setattr(KVBoostRAG, "generate", spy_generate)
    monkeypatch.setattr(KVBoostRAG, "stream", spy_stream)
    monkeypatch.setattr(generation, "call_options", spy_build)
    return seen, built


def test_each_skin_carries_the_repair_setting_as_one_value(engine: KVEngine, monkeypatch: pytest.MonkeyPatch
                                                          ) -> None:
    """From a skin's entry to the engine, a call's options are one CallOptions, built once per call: the
    skin's field and the call's override both land in it (issue 34: the repair setting followed as one value)."""
    lc = pytest.importorskip("langchain_kvboost")
    pytest.importorskip("llama_index.core")
    from llama_index.core.llms import ChatMessage
    from llama_index.llms.kvboost import KVBoostLLM as LlamaIndexLLM

    seen, built = _spy_options(monkeypatch)
    calls = [
        lambda: lc.KVBoostLLM(engine=engine, max_tokens=2, repair="full").invoke("one two"),
        lambda: "".join(lc.KVBoostLLM(engine=engine, max_tokens=2, repair="full").stream("one two")),
        lambda: LlamaIndexLLM(engine=engine, max_new_tokens=2, repair="full").complete("one two"),
        lambda: "".join(r.delta or "" for r in
                        LlamaIndexLLM(engine=engine, max_new_tokens=2, repair="full").stream_complete("one two")),
    ]
    if getattr(engine.tokenizer, "chat_template", None):
        calls += [
            lambda: lc.ChatKVBoost(engine=engine, max_tokens=2, repair="full").invoke("one two"),
            lambda: LlamaIndexLLM(engine=engine, max_new_tokens=2, repair="full").chat(
                [ChatMessage(role="user", content="one two")]),
        ]
    for call in calls:
        seen.clear(), built.clear()
        call()
        assert len(seen) == 1 and isinstance(seen[0], CallOptions) and seen[0].spec.repair == "full"
        assert len(built) == 1  # once, at the skin's entry
    seen.clear()
    lc.KVBoostLLM(engine=engine, max_tokens=2, repair="full").invoke("one two", recompute_ratio=0.4,
                                                                      repair="selective")
    assert (seen[0].spec.repair, seen[0].spec.recompute_ratio) == ("selective", 0.4)
    with pytest.raises(ValueError, match="recompute_ratio"):  # checked at the skin's call, before any compute
        LlamaIndexLLM(engine=engine, max_new_tokens=2).complete("one", recompute_ratio=2.0)


def test_rag_takes_call_options_or_keywords(engine: KVEngine) -> None:
    from kvboost_rag import KVBoostRAG

    rag = KVBoostRAG(engine)
    a = rag.generate("one two three", max_new_tokens=3, repair="none", store_prefix=False)
    b = rag.generate("one two three", max_new_tokens=3,
                     call_options=rag.call_options(repair="none", store_prefix=False))
    assert a.token_ids == b.token_ids
    with pytest.raises(TypeError, match="not both"):
        rag.generate("one", max_new_tokens=1, call_options=rag.call_options(), repair="full")
    with pytest.raises(TypeError, match="chat_history= or history_tokens="):
        rag.generate("one two", max_new_tokens=1, chat_history="one", history_tokens=1)
