"""Bad input, decoding options, streaming, threads and stats."""

from __future__ import annotations

import threading

import pytest
import torch
from conftest import CORPUS
from helpers import engine_for

from kvboost_core import Segment
from kvboost_core.chunking import chunk_spans
from kvboost_core.config import parse_bytes
from kvboost_core.decode import SamplingParams, sample


@pytest.fixture(scope="module")
def eng(tiny_llama, tokenizer):
    return engine_for(tiny_llama, tokenizer)


@pytest.mark.parametrize("prompt,exc,needle", [
    ("", ValueError, "empty"),
    ([], ValueError, "empty"),
    (123, TypeError, "str"),
    ([Segment(text="a"), 5], TypeError, "Segment"),
    (b"bytes", TypeError, "str"),
])
def test_bad_prompts(eng, prompt, exc, needle):
    with pytest.raises(exc, match=needle):
        eng.generate(prompt, max_new_tokens=2)


@pytest.mark.parametrize("kw,needle", [
    (dict(max_new_tokens=0), "max_new_tokens"), (dict(max_new_tokens=-3), "max_new_tokens"),
    (dict(temperature=-1.0), "temperature"), (dict(top_p=0.0), "top_p"), (dict(repair="magic"), "repair"),
    (dict(recompute_ratio=1.5), "recompute_ratio"),
])
def test_bad_options(eng, kw, needle):
    with pytest.raises(ValueError, match=needle):
        eng.generate("hello", **kw)


def test_prompt_longer_than_context_names_both_numbers(tokenizer):
    from conftest import make_tiny_model

    small = engine_for(make_tiny_model("llama", max_positions=64), tokenizer)
    text = " ".join(CORPUS)
    n = len(small.tokenize_ids(text))
    with pytest.raises(ValueError, match=rf"{n} tokens.*context is 64"):
        small.generate(text, max_new_tokens=2)


def test_bad_config():
    from kvboost_core.config import EngineConfig

    with pytest.raises(ValueError, match="chunk_size"):
        EngineConfig(chunk_size=0)
    with pytest.raises(ValueError, match="kv_bits"):
        EngineConfig(kv_bits=3)
    with pytest.raises(ValueError, match="byte size"):
        EngineConfig(max_cache_bytes="lots")
    assert parse_bytes("2GiB") == 2 * 1024**3 and parse_bytes("1.5MB") == 1_500_000


def test_stream_equals_generate_and_stop_strings(eng):
    full = eng.generate(CORPUS[1], max_new_tokens=16, store_prefix=False)
    pieces = list(eng.stream(CORPUS[1], max_new_tokens=16, store_prefix=False))
    assert "".join(pieces) == full.text
    if len(full.text) > 4:
        stop = full.text[2:4]
        cut = eng.generate(CORPUS[1], max_new_tokens=16, stop=[stop], store_prefix=False)
        assert stop not in cut.text and full.text.startswith(cut.text) and cut.finish_reason == "stop"
        assert "".join(eng.stream(CORPUS[1], max_new_tokens=16, stop=stop, store_prefix=False)) == cut.text


def test_sampling_seeded_and_top_p(eng):
    a = eng.generate(CORPUS[0], max_new_tokens=8, temperature=1.0, top_p=0.9, seed=7)
    b = eng.generate(CORPUS[0], max_new_tokens=8, temperature=1.0, top_p=0.9, seed=7)
    assert a.token_ids == b.token_ids
    logits = torch.tensor([0.0, 10.0, 9.9, -5.0])
    p = SamplingParams.create(4, temperature=1.0, top_p=0.5)
    g = torch.Generator().manual_seed(0)
    assert {sample(logits, p, g) for _ in range(50)} == {1}  # nucleus keeps only the top token
    assert sample(logits, SamplingParams.create(4), None) == 1  # temperature 0: greedy, no division


def test_result_fields_and_ttft(eng):
    res = eng.generate(CORPUS[2], max_new_tokens=4)
    assert 0 < res.ttft_s <= res.total_s
    for key in ("reused_exact", "reused_approx", "recomputed", "computed", "tokenize_s", "lookup_s",
                "assemble_s", "forward_s"):
        assert key in res.stats
    s = res.stats
    assert s["reused_exact"] + s["reused_approx"] + s["recomputed"] + s["computed"] == s["prompt_tokens"]
    st = eng.stats()
    for key in ("entries", "tokens", "bytes", "hits_exact", "hits_content", "misses", "evictions"):
        assert key in st


def test_chunk_spans_respect_sentences_and_tail():
    ids = list(range(40))
    ends = {9, 21}  # tokens that end sentences
    spans = chunk_spans(ids, 10, 3, lambda t: t in ends)
    assert spans[0] == (0, 10)  # slides to just after token 9 (its own cut)
    assert spans[1] == (10, 22)  # slides +2 to the sentence end
    assert spans[-1][1] == 40 and all(b > a for a, b in spans)
    assert chunk_spans(list(range(5)), 10, 3) == [(0, 5)]


def test_threads_get_their_own_answers(tiny_llama, tokenizer):
    eng = engine_for(tiny_llama, tokenizer)
    eng.warm(CORPUS[:4])
    prompts = [[Segment(text=CORPUS[i], cacheable=True), Segment(text=CORPUS[(i + 1) % 4], cacheable=True),
                Segment(text=f" Question {i}?")] for i in range(4)]
    alone = [eng.generate(p, max_new_tokens=8, repair="full", store_prefix=False).token_ids for p in prompts]
    results: dict[int, list[int]] = {}
    errors: list[BaseException] = []

    def work(i: int) -> None:
        try:
            for _ in range(3):
                r = eng.generate(prompts[i], max_new_tokens=8, repair="full")
                assert r.token_ids == alone[i]
            results[i] = r.token_ids
        except BaseException as e:  # noqa: BLE001 - surfaced below
            errors.append(e)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(4) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    assert results == dict(enumerate(alone))


def test_from_pretrained_loads_a_local_model(tmp_path, tiny_llama, tokenizer):
    from kvboost_core.engine import KVEngine

    tiny_llama.save_pretrained(tmp_path)
    tokenizer.save_pretrained(tmp_path)
    eng = KVEngine.from_pretrained(str(tmp_path), chunk_size=32, repair="selective", kv_bits=8, device="cpu")
    assert eng.config.chunk_size == 32 and eng.config.repair == "selective" and eng.config.kv_bits == 8
    assert next(eng.model.parameters()).dtype == torch.float32  # fp32 is the CPU default
    ref = engine_for(tiny_llama, tokenizer)
    assert eng.fingerprint == ref.fingerprint  # same weights, dtype and tokenizer: the same cache identity
    assert eng.generate(CORPUS[0], max_new_tokens=4).token_ids == ref.generate(CORPUS[0], max_new_tokens=4).token_ids
    with pytest.raises(ValueError, match="dtype"):
        KVEngine.from_pretrained(str(tmp_path), dtype="float8")
