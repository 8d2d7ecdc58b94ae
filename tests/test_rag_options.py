"""RAGOptions (issue #34): KVBoostRAG's document options travel as one typed value, from both skins, with clear
errors for bad values and unknown names."""

from __future__ import annotations

import pytest
from conftest import make_tiny_model
from helpers import engine_for

from kvboost_rag import KVBoostRAG
from kvboost_rag.options import RAGOptions


def test_options_are_one_value_and_keywords_override_it(tokenizer):
    eng = engine_for(make_tiny_model("llama"), tokenizer)
    base = RAGOptions(preserve_order=True, auto_warm=True)
    rag = KVBoostRAG(eng, base, transparent=False)
    assert rag.options == RAGOptions(transparent=False, preserve_order=True, auto_warm=True)
    assert base.transparent  # the caller's value is not changed
    assert KVBoostRAG(eng).options == RAGOptions()


@pytest.mark.parametrize(("kw", "err", "match"), [
    ({"transparent": 1}, TypeError, "transparent must be a bool"),
    ({"auto_warm": "yes"}, TypeError, "auto_warm must be a bool"),
    ({"separator": None}, TypeError, "separator must be a str"),
    ({"miss_warning_interval_s": -1}, ValueError, "miss_warning_interval_s"),
])
def test_bad_values_name_the_option(kw, err, match):
    with pytest.raises(err, match=match):
        RAGOptions(**kw)


def test_unknown_names_and_wrong_types_are_refused(tokenizer):
    eng = engine_for(make_tiny_model("llama"), tokenizer)
    with pytest.raises(TypeError, match=r"unknown RAG option\(s\) \['transperent'\]"):
        KVBoostRAG(eng, transperent=False)
    with pytest.raises(TypeError, match="options must be a kvboost_rag.options.RAGOptions"):
        KVBoostRAG(eng, {"transparent": False})  # type: ignore[arg-type]


def test_both_skins_hand_their_fields_over_as_options(tokenizer):
    pytest.importorskip("langchain_core")
    pytest.importorskip("llama_index.core")
    from langchain_kvboost import KVBoostLLM as LangChainLLM
    from llama_index.llms.kvboost import KVBoostLLM as LlamaIndexLLM

    eng = engine_for(make_tiny_model("llama"), tokenizer)
    lc = LangChainLLM(engine=eng, transparent=False, preserve_order=True, auto_warm=True)
    assert lc.rag.options == RAGOptions(transparent=False, preserve_order=True, auto_warm=True)
    li = LlamaIndexLLM(engine=eng, transparent=False, preserve_order=True, auto_warm=True)
    assert li.rag.options == RAGOptions(transparent=False, preserve_order=True, auto_warm=True)
    shared = KVBoostRAG(eng)
    LangChainLLM(engine=shared, auto_warm=True)  # wrapping a KVBoostRAG turns its auto_warm on, nothing else
    assert shared.options == RAGOptions(auto_warm=True)
