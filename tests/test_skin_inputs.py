"""Bad text into the LangChain and LlamaIndex skins (issue 34, item 7): a lone surrogate raised the tokenizer's
bare TypeError, and a chat message with ``None`` content was rendered as an empty message. Both skins share
``KVBoostRAG.plan`` (prompts) and ``KVBoostRAG.chat_prompt`` (messages), which now say what is wrong and where."""

from __future__ import annotations

import pytest

from kvboost_core.engine import KVEngine
from kvboost_rag import KVBoostRAG
from kvboost_rag.tiny import tiny_model_and_tokenizer

BAD = "Where does Alice live? \ud800"  # a lone surrogate, as a bad decode leaves it
SURROGATE = r"is not valid Unicode text: surrogates not allowed"


@pytest.fixture(scope="module")
def engine():
    return KVEngine(*tiny_model_and_tokenizer())


def test_rag_names_the_bad_prompt_message_or_document(engine):
    rag = KVBoostRAG(engine)
    with pytest.raises(ValueError, match=rf"^prompt {SURROGATE}"):
        rag.generate(BAD, max_new_tokens=1)
    with pytest.raises(ValueError, match=rf"^kv_documents\[1\] {SURROGATE}"):
        rag.generate("Question?", kv_documents=["Alice lives in Portvale.", BAD], max_new_tokens=1)
    ok = {"role": "user", "content": "Hi"}
    with pytest.raises(ValueError, match=rf"^messages\[1\]\.content {SURROGATE}"):
        rag.chat_prompt([ok, {"role": "user", "content": BAD}])
    with pytest.raises(TypeError, match=r"^messages\[1\] \(role 'user'\) has no content \(None\)"):
        rag.chat_prompt([ok, {"role": "user", "content": None}])
    with pytest.raises(TypeError, match=r"^messages\[0\] must be a dict"):
        rag.chat_prompt(["Hi"])
    # OpenAI's shape of an assistant's tool calls has no text: still accepted
    calls = [{"id": "c1", "type": "function", "function": {"name": "f", "arguments": {}}}]
    assert rag.chat_prompt([ok, {"role": "assistant", "content": None, "tool_calls": calls}, ok])


def test_langchain_skin_says_what_is_wrong(engine):
    pytest.importorskip("langchain_core")
    from langchain_core.messages import HumanMessage, SystemMessage
    from langchain_kvboost import ChatKVBoost, KVBoostLLM

    chat = ChatKVBoost(engine=engine, max_tokens=2)
    messages = [SystemMessage("Be brief."), HumanMessage(BAD)]
    with pytest.raises(ValueError, match=rf"^messages\[1\]\.content {SURROGATE}"):
        chat.invoke(messages)
    with pytest.raises(ValueError, match=rf"^messages\[1\]\.content {SURROGATE}"):
        list(chat.stream(messages))
    with pytest.raises(ValueError, match=rf"^prompt {SURROGATE}"):
        KVBoostLLM(engine=engine, max_tokens=2).invoke(BAD)


def test_llamaindex_skin_says_what_is_wrong(engine):
    pytest.importorskip("llama_index.core")
    from llama_index.core.base.llms.types import ChatMessage
    from llama_index.core.llms.llm import ToolSelection
    from llama_index.llms.kvboost import KVBoostLLM
    from llama_index.llms.kvboost._tools import tool_chat_dicts

    llm = KVBoostLLM(engine=engine, max_new_tokens=2)
    system = ChatMessage(role="system", content="Be brief.")
    with pytest.raises(ValueError, match=rf"^messages\[1\]\.content {SURROGATE}"):
        llm.chat([system, ChatMessage(role="user", content=BAD)])
    with pytest.raises(ValueError, match=rf"^prompt {SURROGATE}"):
        llm.complete(BAD)
    empty = [system, ChatMessage(role="user", content=None)]
    with pytest.raises(TypeError, match=r"^messages\[1\] \(role 'user'\) has no content \(None\)"):
        llm.chat(empty)
    with pytest.raises(TypeError, match=r"^messages\[1\] \(role 'user'\) has no content \(None\)"):
        list(llm.stream_chat(empty))
    # an assistant's tool calls without text stay accepted, as before
    call = ToolSelection(tool_id="c1", tool_name="f", tool_kwargs={})
    turn = ChatMessage(role="assistant", content=None, additional_kwargs={"tool_calls": [call]})
    assert tool_chat_dicts([turn])[0]["content"] == ""
