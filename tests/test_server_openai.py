"""`kvboost-rag serve` driven by the official openai client (sync, async, streaming), OpenAI-shaped errors and
namespace isolation by API key. One real server on loopback for the module."""

from __future__ import annotations

import asyncio

import pytest
from _server_fixture import KEY_A, KEY_B, KEYS, demo_workload, running_server

openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    with running_server(tmp_path_factory.mktemp("srv"), keys=KEYS) as srv:
        corpus, _ = demo_workload(0)
        r = httpx.post(srv.v1 + "/documents", json={"documents": corpus}, timeout=120,
                       headers={"Authorization": f"Bearer {KEY_A}"})
        assert r.status_code == 200, r.text
        body = r.json()
        assert body["namespace"] == "tenant-a" and body["warmed"] == len(set(corpus)) and body["tokens"] > 0
        yield srv


def _client(server, key=KEY_A):
    return openai.OpenAI(base_url=server.v1, api_key=key, max_retries=0, timeout=60)


def _reused(usage) -> int:
    """Prompt tokens served from the cache: ``cached_tokens`` (exact) plus the extension field
    ``cached_tokens_approximate`` (re-placed documents kept without recompute, never in cached_tokens)."""
    d = usage.prompt_tokens_details
    return d.cached_tokens + d.model_extra["cached_tokens_approximate"]


def test_models_and_health(server):
    assert [m.id for m in _client(server).models.list()] == ["demo"]
    assert httpx.get(server.url + "/health").json()["status"] == "ok"


def test_sync_chat_and_completion_reuse_warmed_documents(server):
    _, work = demo_workload(3)
    prompt, answer = work[1]
    client = _client(server)
    comp = client.completions.create(model="demo", prompt=prompt, max_tokens=12, temperature=0, stop=["\n"])
    assert comp.choices[0].finish_reason == "stop" and answer in comp.choices[0].text
    assert _reused(comp.usage) > 0  # the documents' KV was reused
    chat = client.chat.completions.create(model="demo", messages=[{"role": "user", "content": prompt}],
                                          max_completion_tokens=5, temperature=0, seed=3)
    msg = chat.choices[0]
    assert msg.message.role == "assistant" and chat.usage.completion_tokens <= 5
    assert 0 < _reused(chat.usage) < chat.usage.prompt_tokens


def test_streaming_matches_non_streaming(server):
    _, work = demo_workload(4)
    prompt = work[2][0]
    client = _client(server)
    full = client.completions.create(model="demo", prompt=prompt, max_tokens=10, temperature=0)
    chunks = list(client.completions.create(model="demo", prompt=prompt, max_tokens=10, temperature=0,
                                            stream=True, stream_options={"include_usage": True}))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == full.choices[0].text
    assert chunks[-1].usage.completion_tokens == full.usage.completion_tokens
    chat = list(client.chat.completions.create(model="demo", messages=[{"role": "user", "content": prompt}],
                                               max_tokens=6, temperature=0, stream=True))
    assert chat[0].choices[0].delta.role == "assistant"
    assert chat[-1].choices[0].finish_reason in ("stop", "length")


def test_async_client_concurrent(server):
    _, work = demo_workload(6)

    async def run():
        client = openai.AsyncOpenAI(base_url=server.v1, api_key=KEY_A, max_retries=0, timeout=60)
        outs = await asyncio.gather(*[client.completions.create(model="demo", prompt=p, max_tokens=8,
                                                                temperature=0) for p, _ in work])
        stream = await client.chat.completions.create(model="demo", messages=[{"role": "user", "content": "hi"}],
                                                      max_tokens=4, temperature=0, stream=True)
        pieces = [c async for c in stream]
        await client.close()
        return outs, pieces

    outs, pieces = asyncio.run(run())
    assert len(outs) == 6 and all(o.usage.completion_tokens >= 1 for o in outs)
    assert pieces[-1].choices[0].finish_reason is not None


def test_openai_shaped_errors(server):
    client = _client(server)
    with pytest.raises(openai.BadRequestError) as bad:
        client.completions.create(model="demo", prompt="x", n=2)
    assert bad.value.body["param"] == "n" and "n=1" in bad.value.body["message"]
    with pytest.raises(openai.BadRequestError) as bad:
        client.completions.create(model="demo", prompt="x", temperature=3)
    assert bad.value.body["param"] == "temperature"
    with pytest.raises(openai.NotFoundError) as nf:
        client.completions.create(model="gpt-4o", prompt="x")
    assert nf.value.body["code"] == "model_not_found"
    with pytest.raises(openai.BadRequestError) as long:
        client.completions.create(model="demo", prompt="Answer: " * 1500, max_tokens=4)
    assert long.value.body["code"] == "context_length_exceeded" and "2048" in long.value.body["message"]
    r = httpx.post(server.v1 + "/chat/completions", content=b'{"model": "demo", "messages": [',
                   headers={"Authorization": f"Bearer {KEY_A}", "Content-Type": "application/json"})
    assert r.status_code == 400 and set(r.json()["error"]) == {"message", "type", "param", "code"}
    r = httpx.post(server.v1 + "/chat/completions", json={"model": "demo", "messages": []},
                   headers={"Authorization": f"Bearer {KEY_A}"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages"
    with pytest.raises(openai.AuthenticationError):
        _client(server, key="sk-not-a-known-key").models.list()
    # the server keeps serving after all of these
    assert client.completions.create(model="demo", prompt="Question:", max_tokens=2).usage.completion_tokens >= 1


def test_namespace_isolation(server):
    _, work = demo_workload(1)
    prompt = work[0][0]
    a, b = _client(server, KEY_A), _client(server, KEY_B)
    hdr_b = {"Authorization": f"Bearer {KEY_B}"}
    assert httpx.get(server.v1 + "/documents/stats", headers=hdr_b).json()["documents"] == 0
    out_b = b.completions.create(model="demo", prompt=prompt + " ", max_tokens=2, temperature=0)
    out_a = a.completions.create(model="demo", prompt=prompt + "  ", max_tokens=2, temperature=0)
    # tenant a warmed the corpus; tenant b's cache holds nothing of it
    assert _reused(out_b.usage) == 0
    assert _reused(out_a.usage) > 0
    stats_a = httpx.get(server.v1 + "/documents/stats", headers={"Authorization": f"Bearer {KEY_A}"}).json()
    assert stats_a["namespace"] == "tenant-a" and stats_a["documents"] > 0
    # /metrics sits behind the keys and shows the caller's own namespace only
    assert httpx.get(server.url + "/metrics").status_code == 401
    metrics = httpx.get(server.url + "/metrics", headers={"Authorization": f"Bearer {KEY_A}"}).text
    assert 'kvboost_cache_bytes{namespace="tenant-a",tier="memory"}' in metrics
    assert 'namespace="tenant-b"' not in metrics
    assert "kvboost_ttft_seconds_bucket" in metrics and "kvboost_queue_depth" in metrics


def _backfilled(server, timeout: float = 60.0) -> None:
    """Wait (bounded) until the server's chat backfills are done: /health's backfill queue is empty."""
    import time

    deadline = time.monotonic() + timeout
    while httpx.get(server.url + "/health").json()["backfill"]["pending"]:
        assert time.monotonic() < deadline, "the chat backfill did not finish"
        time.sleep(0.1)


def test_chat_follow_ups_read_their_history_exactly_per_tenant(server):
    """Issue 33 through the official client: after a turn's backfill, the next turn's whole history is cached
    (exact) tokens and nothing is re-placed again; the other tenant sending the same messages finds none of it,
    and gets the same answer (history is exact either way)."""
    _, work = demo_workload(2)
    messages = [{"role": "user", "content": work[1][0]}]
    a, b = _client(server, KEY_A), _client(server, KEY_B)
    answers, usages = [], []
    for question in ("Answer again.", "And once more."):
        out = a.chat.completions.create(model="demo", messages=messages, max_tokens=6, temperature=0)
        answers.append(out.choices[0].message.content)
        usages.append(out.usage)
        messages += [{"role": "assistant", "content": answers[-1]}, {"role": "user", "content": question}]
        _backfilled(server)
    last = a.chat.completions.create(model="demo", messages=messages, max_tokens=6, temperature=0)
    assert usages[0].prompt_tokens_details.model_extra["cached_tokens_approximate"] > 0  # turn 1 re-placed
    for turn in (usages[1], last.usage):  # turns 2 and 3: the history (turn 1's prompt and on) is cached
        assert turn.prompt_tokens_details.cached_tokens > usages[0].prompt_tokens
        assert turn.prompt_tokens_details.model_extra["cached_tokens_approximate"] == 0
    assert httpx.get(server.url + "/health").json()["backfill"]["tokens"] > 0
    other = b.chat.completions.create(model="demo", messages=messages, max_tokens=6, temperature=0)
    assert other.usage.prompt_tokens_details.cached_tokens == 0
    assert other.choices[0].message.content == last.choices[0].message.content
