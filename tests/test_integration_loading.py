"""Loading through the integrations with the keywords HF's own wrappers take (issue 26): ``model_kwargs`` that
override kvboost's loading defaults, ``device`` as HF pipelines spell it, unknown keywords refused before the
weights load, HuggingFaceLLM's ``generate_kwargs`` / ``tokenizer_name`` / ``stopping_ids`` / ``device_map``,
``ChatKVBoost(llm=...)`` (the ChatHuggingFace pattern), and llguidance checked when a grammar is bound."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import tomllib
import torch

pytest.importorskip("langchain_core")
pytest.importorskip("llama_index.core")

from langchain_core.tools import tool  # noqa: E402
from langchain_kvboost import ChatKVBoost  # noqa: E402
from langchain_kvboost import KVBoostLLM as LCLLM  # noqa: E402
from llama_index.llms.kvboost import KVBoostLLM as LILLM  # noqa: E402
from pydantic import BaseModel  # noqa: E402

from kvboost_core.engine import KVEngine  # noqa: E402
from kvboost_rag.options import load_device, one_device  # noqa: E402
from kvboost_rag.rag import KVBoostRAG  # noqa: E402
from kvboost_rag.tiny import tiny_model_and_tokenizer  # noqa: E402

PROMPT = "Alice lives in Portvale and works as a chemist. Where does Alice live?"


@tool
def get_weather(city: str) -> str:
    """Current weather in a city."""
    return f"sunny in {city}"


class Person(BaseModel):
    name: str


@pytest.fixture(scope="module")
def model_and_tok():
    return tiny_model_and_tokenizer()


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory, model_and_tok):
    path = tmp_path_factory.mktemp("tiny-load")
    model, tok = model_and_tok
    model.save_pretrained(path)
    tok.save_pretrained(path)
    return path


def test_model_kwargs_override_the_loading_defaults(tiny_dir):
    # used to be a TypeError: from_pretrained got dtype= and attn_implementation= twice
    llm = LCLLM.from_model_id(str(tiny_dir), model_kwargs={"dtype": torch.bfloat16})
    assert llm.rag.engine.model.dtype == torch.bfloat16
    llm = LCLLM.from_model_id(str(tiny_dir), model_kwargs={"attn_implementation": "eager", "torch_dtype": "float32"})
    assert llm.rag.engine.model.config._attn_implementation == "eager"
    assert llm.rag.engine.model.dtype == torch.float32
    li = LILLM.from_model_id(str(tiny_dir), model_kwargs={"dtype": "bfloat16"})
    assert li.engine.model.dtype == torch.bfloat16
    with pytest.raises(TypeError, match="two spellings"):
        LCLLM.from_model_id(str(tiny_dir), model_kwargs={"dtype": "float32", "torch_dtype": "float32"})
    with pytest.raises(ValueError, match="differ"):
        LCLLM.from_model_id(str(tiny_dir), dtype="float32", model_kwargs={"dtype": torch.bfloat16})


def test_device_as_hf_pipelines_take_it(tiny_dir):
    # used to be an AttributeError ('int' object has no attribute 'startswith')
    assert LCLLM.from_model_id(str(tiny_dir), device=-1).rag.engine.model.device.type == "cpu"
    assert ChatKVBoost.from_model_id(str(tiny_dir), device_map="cpu").rag.engine.model.device.type == "cpu"
    assert one_device(-1) == "cpu" and one_device(0) == "cuda:0" and one_device(torch.device("cpu")) == "cpu"
    assert load_device(None, "auto") is None and load_device("cpu", {"": "cpu"}) == "cpu"
    assert load_device(None, {"model.embed": 1, "lm_head": "cuda:1"}) == "cuda:1"
    with pytest.raises(ValueError, match="one device"):
        load_device(None, {"model.embed": 0, "lm_head": "cpu"})
    with pytest.raises(ValueError, match="one device"):
        load_device(None, "balanced")
    with pytest.raises(ValueError, match="different devices"):
        load_device("cpu", 0)
    with pytest.raises(ValueError, match="-1"):
        one_device(-2)
    with pytest.raises(TypeError, match="device"):
        one_device(True)


def test_unknown_keywords_fail_before_the_weights_load(tiny_dir, monkeypatch):
    from transformers import AutoModelForCausalLM

    def no_load(*args, **kwargs):
        raise AssertionError("the weights were loaded before the keywords were checked")

    monkeypatch.setattr(AutoModelForCausalLM, "from_pretrained", no_load)
    for load in (LCLLM.from_model_id, ChatKVBoost.from_model_id, LILLM.from_model_id, KVBoostRAG.from_model_id):
        with pytest.raises(TypeError, match="chunk_sise"):
            load(str(tiny_dir), chunk_sise=32)
        with pytest.raises(ValueError, match="chunk_size"):
            load(str(tiny_dir), chunk_size=0)  # a bad value too
    with pytest.raises(ValueError, match="top_k"):
        LILLM.from_model_id(str(tiny_dir), generate_kwargs={"top_k": 5})
    with pytest.raises(ValueError, match="stopping_ids"):
        LILLM.from_model_id(str(tiny_dir), stopping_ids=[-3])


def test_llamaindex_takes_huggingface_llm_arguments(tiny_dir, model_and_tok, tmp_path):
    _, tok = model_and_tok
    other = tmp_path / "tok"
    tok.save_pretrained(other)
    marked = "{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}"
    (other / "chat_template.jinja").write_text(marked)
    llm = LILLM.from_model_id(str(tiny_dir), tokenizer_name=str(other), device_map="auto",
                              generate_kwargs={"temperature": 0.7, "do_sample": True, "top_p": 0.9},
                              max_new_tokens=6, stopping_ids=[7])
    assert llm.engine.tokenizer.chat_template == marked  # the tokenizer came from tokenizer_name
    assert (llm.temperature, llm.top_p, llm.max_new_tokens, llm.stopping_ids) == (0.7, 0.9, 6, [7])
    greedy = LILLM(engine=llm.rag, generate_kwargs={"do_sample": False}, max_new_tokens=6)
    assert greedy.temperature == 0.0
    # stopping_ids end the generation at that token (kept, as HuggingFaceLLM keeps it)
    base = greedy.complete(PROMPT).raw["token_ids"]
    assert len(base) >= 3
    stopped = LILLM(engine=llm.rag, stopping_ids=[base[1]], max_new_tokens=6)
    out = stopped.complete(PROMPT)
    assert out.raw["token_ids"] == base[: base.index(base[1]) + 1] and out.raw["finish_reason"] == "stop"
    streamed = list(stopped.stream_complete(PROMPT))
    assert streamed[-1].raw["token_ids"] == out.raw["token_ids"]
    with pytest.raises(TypeError, match="from_model_id"):
        LILLM(engine=llm.rag, tokenizer_name="x")
    with pytest.raises(TypeError, match="from_model_id"):
        LILLM(engine=llm.rag, device_map="auto")


def test_chat_model_from_an_llm(model_and_tok):
    llm = LCLLM(engine=KVEngine(*model_and_tok), max_tokens=5, temperature=0.3, stop=["\n"], model_id="tiny")
    chat = ChatKVBoost(llm=llm)
    assert chat.rag is llm.rag and chat.llm is llm  # the engine and warmed documents are shared
    assert (chat.max_tokens, chat.temperature, chat.stop, chat.model_id) == (5, 0.3, ["\n"], "tiny")
    assert ChatKVBoost(llm=llm, max_new_tokens=2, temperature=0.0).max_tokens == 2  # given fields win
    llm.warm_documents(["Bob repairs bicycles in a small shop near the harbour."], show_progress=False)
    assert chat.rag.is_warm("Bob repairs bicycles in a small shop near the harbour.")
    assert isinstance(ChatKVBoost(llm=llm, temperature=0.0).invoke("hi").content, str)
    with pytest.raises(TypeError, match="KVBoostLLM"):
        ChatKVBoost(llm="not an llm")
    with pytest.raises(TypeError, match="not both"):
        ChatKVBoost(llm=llm, engine=llm.rag)


def test_grammar_dependency_is_checked_when_bound(model_and_tok, monkeypatch):
    extras = tomllib.loads((Path(__file__).resolve().parents[1] / "pyproject.toml").read_text())[
        "project"]["optional-dependencies"]
    assert any(d.startswith("llguidance") for d in extras["langchain"])
    assert any(d.startswith("llguidance") for d in extras["llamaindex"])
    chat = ChatKVBoost(engine=KVEngine(*model_and_tok), max_tokens=4)
    li = LILLM(engine=chat.rag, max_new_tokens=4)
    monkeypatch.setitem(sys.modules, "llguidance", None)  # as if it were not installed
    with pytest.raises(ImportError, match=r"kvboost-rag\[langchain\]"):
        chat.bind_tools([get_weather], tool_choice="any")
    with pytest.raises(ImportError, match="llguidance"):
        chat.bind_tools([get_weather], tool_choice="get_weather")
    with pytest.raises(ImportError, match="llguidance"):
        chat.with_structured_output(Person)
    assert chat.bind_tools([get_weather]) is not None  # free calls need no grammar
    calls: list[str] = []
    object.__setattr__(li.rag, "generate", lambda prompt, **kw: calls.append(prompt))
    with pytest.raises(ImportError, match="llguidance"):
        li.chat_with_tools([_li_tool()], user_msg="weather?", tool_required=True)
    assert calls == []  # refused before generating


def _li_tool():
    from llama_index.core.tools import FunctionTool

    def weather(city: str) -> str:
        """Current weather in a city."""
        return city

    return FunctionTool.from_defaults(fn=weather)
