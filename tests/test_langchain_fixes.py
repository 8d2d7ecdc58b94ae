"""LangChain KVBoostLLM / ChatKVBoost as a user migrating from HuggingFacePipeline hits them: empty streams,
field aliases and pipeline arguments in from_model_id, and unknown per-call keywords."""

from __future__ import annotations

import pytest

pytest.importorskip("langchain_core")

from langchain_core.messages import HumanMessage  # noqa: E402
from langchain_kvboost import ChatKVBoost, KVBoostLLM  # noqa: E402

from kvboost_core.engine import KVEngine  # noqa: E402
from kvboost_rag.tiny import tiny_model_and_tokenizer  # noqa: E402

PROMPT = "Alice lives in Portvale and works as a chemist. Where does Alice live?"


@pytest.fixture(scope="module")
def model_and_tok():
    return tiny_model_and_tokenizer()


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory, model_and_tok):
    path = tmp_path_factory.mktemp("tiny-lc")
    model, tok = model_and_tok
    model.save_pretrained(path)
    tok.save_pretrained(path)
    return path


@pytest.fixture
def llm(model_and_tok):
    return KVBoostLLM(engine=KVEngine(*model_and_tok), max_tokens=6)


def test_empty_stream_ends_with_one_empty_chunk(llm, model_and_tok):
    first = llm.invoke(PROMPT)
    assert first
    stop = [first[:1]]
    assert llm.invoke(PROMPT, stop=stop) == ""
    assert "".join(llm.stream(PROMPT, stop=stop)) == ""
    chat = ChatKVBoost(engine=llm.rag, max_tokens=6)
    reply = chat.invoke([HumanMessage(PROMPT)])
    assert reply.content
    chunks = list(chat.stream([HumanMessage(PROMPT)], stop=[reply.content[:1]]))
    assert chunks and "".join(c.content for c in chunks) == ""
    assert chunks[-1].usage_metadata is not None  # the final chunk still carries usage


def test_from_model_id_accepts_aliases_and_pipeline_kwargs(tiny_dir):
    llm = KVBoostLLM.from_model_id(str(tiny_dir), max_new_tokens=3, chunk_size=32)
    assert llm.max_tokens == 3 and llm.rag.engine.config.chunk_size == 32
    llm = KVBoostLLM.from_model_id(str(tiny_dir), task="text-generation",
                                   pipeline_kwargs={"max_new_tokens": 5, "temperature": 0.7, "do_sample": True,
                                                    "top_p": 0.8})
    assert (llm.max_tokens, llm.temperature, llm.top_p) == (5, 0.7, 0.8)
    greedy = ChatKVBoost.from_model_id(str(tiny_dir), pipeline_kwargs={"do_sample": False, "temperature": 0.7})
    assert greedy.temperature == 0.0
    with pytest.raises(ValueError, match="repetition_penalty"):
        KVBoostLLM.from_model_id(str(tiny_dir), pipeline_kwargs={"repetition_penalty": 1.1})
    with pytest.raises(ValueError, match="text-generation"):
        KVBoostLLM.from_model_id(str(tiny_dir), task="text2text-generation")
    with pytest.raises(TypeError, match="two spellings"):
        KVBoostLLM.from_model_id(str(tiny_dir), max_new_tokens=3, max_tokens=4)


def test_unknown_per_call_keyword_is_a_type_error_naming_it(llm):
    with pytest.raises(TypeError, match="top_k"):
        llm.invoke(PROMPT, top_k=5)
    chat = ChatKVBoost(engine=llm.rag, max_tokens=2)
    with pytest.raises(TypeError, match="top_k"):
        chat.invoke([HumanMessage("hi")], top_k=5)
    with pytest.raises(TypeError, match="top_k"):
        list(chat.stream([HumanMessage("hi")], top_k=5))
    # what LangChain passes itself, and the documented per-call options, still work
    assert isinstance(llm.invoke(PROMPT, stop=["\n"], max_new_tokens=2, config={"tags": ["t"],
                                                                             "metadata": {"m": 1}}), str)
    assert isinstance(chat.bind(max_tokens=2, temperature=0.0).invoke([HumanMessage("hi")]).content, str)
