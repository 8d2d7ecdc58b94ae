"""Every per-call argument is validated as the config validates its own: bad input raises ValueError or
TypeError naming the argument, before any work and before a stream yields its first piece."""

from __future__ import annotations

import math

import pytest
from conftest import CORPUS
from helpers import engine_for

from kvboost_core import EngineConfig, Segment


@pytest.fixture(scope="module")
def eng(tiny_llama, tokenizer):
    e = engine_for(tiny_llama, tokenizer)
    e.warm(CORPUS[:2])
    return e


SAMPLING = [
    (dict(temperature=math.nan), ValueError, "temperature"),
    (dict(temperature=math.inf), ValueError, "temperature"),
    (dict(temperature=-0.5), ValueError, "temperature"),
    (dict(temperature=True), TypeError, "temperature"),
    (dict(temperature="0.7"), TypeError, "temperature"),
    (dict(top_p=0.0), ValueError, "top_p"),
    (dict(top_p=1.5), ValueError, "top_p"),
    (dict(top_p=math.nan), ValueError, "top_p"),
    (dict(top_p=True), TypeError, "top_p"),
    (dict(seed="abc"), TypeError, "seed"),
    (dict(seed=2**70), ValueError, "seed"),
    (dict(seed=-1), ValueError, "seed"),
    (dict(seed=True), TypeError, "seed"),
    (dict(seed=1.0), TypeError, "seed"),
    (dict(stop=123), TypeError, "stop"),
    (dict(stop=b"x"), TypeError, "stop"),
    (dict(stop=[""]), TypeError, "stop"),
    (dict(stop=["ok", 5]), TypeError, "stop"),
    (dict(max_new_tokens=0), ValueError, "max_new_tokens"),
    (dict(max_new_tokens=2.5), TypeError, "max_new_tokens"),
    (dict(max_new_tokens=True), TypeError, "max_new_tokens"),
]
REPAIR = [
    (dict(check_layer=-1), ValueError, "check_layer"),
    (dict(check_layer=-7), ValueError, "check_layer"),
    (dict(check_layer=3), ValueError, "check_layer"),  # the tiny model has 3 layers: 0, 1, 2
    (dict(check_layer=1.5), TypeError, "check_layer"),
    (dict(check_layer=True), TypeError, "check_layer"),
    (dict(check_layer="1"), TypeError, "check_layer"),
    (dict(recompute_ratio=-0.1), ValueError, "recompute_ratio"),
    (dict(recompute_ratio=1.5), ValueError, "recompute_ratio"),
    (dict(recompute_ratio=math.nan), ValueError, "recompute_ratio"),
    (dict(recompute_ratio=True), TypeError, "recompute_ratio"),
    (dict(recompute_ratio="0.5"), TypeError, "recompute_ratio"),
    (dict(select="biggest"), ValueError, "select"),
    (dict(select=["deviation"]), ValueError, "select"),
    (dict(repair="partial"), ValueError, "repair"),
    (dict(repair=None, recompute_ratio=None, select=7), ValueError, "select"),
    (dict(store_prefix="yes"), TypeError, "store_prefix"),
    (dict(add_special_tokens=1), TypeError, "add_special_tokens"),
    (dict(reuse_repaired=None), TypeError, "reuse_repaired"),
]


def _ids(tokenizer, text):
    return tokenizer(text, add_special_tokens=False)["input_ids"]


@pytest.mark.parametrize("kw,exc,name", SAMPLING + REPAIR + [(dict(repiar="full"), TypeError, "repiar")])
def test_generate_and_stream_reject(eng, kw, exc, name):
    with pytest.raises(exc, match=name):
        eng.generate("Where was Alice born?", **{"max_new_tokens": 2, **kw})
    with pytest.raises(exc, match=name):
        eng.stream("Where was Alice born?", **{"max_new_tokens": 2, **kw})  # before the first piece


@pytest.mark.parametrize("kw,exc,name", REPAIR)
def test_prefill_rejects(eng, kw, exc, name):
    with pytest.raises(exc, match=name):
        eng.prefill("Where was Alice born?", **kw)


def test_check_layer_is_never_silently_ignored(eng):
    """The probe: check_layer -1 used to run every token through every layer while reporting 97% reuse."""
    last = eng.driver.num_layers - 1
    res = eng.prefill([Segment(text=CORPUS[1], cacheable=True), Segment(text=" Why?")], repair="cacheblend",
                      check_layer=last, store_prefix=False)
    assert res.stats["tokens_per_layer"][-1] < res.stats["prompt_tokens"]  # selection happened at the last layer


@pytest.mark.parametrize("make", [
    lambda tok: Segment(token_ids=[5, 400]),  # the tiny model's vocabulary is 400
    lambda tok: [Segment(text="fine"), Segment(token_ids=[10**9])],
])
def test_token_ids_outside_the_vocabulary(eng, tokenizer, make):
    with pytest.raises(ValueError, match="token_ids"):
        eng.generate(make(tokenizer), max_new_tokens=1)
    with pytest.raises(ValueError, match="token_ids"):
        eng.prefill(make(tokenizer))
    with pytest.raises(ValueError, match="token_ids"):
        eng.warm(make(tokenizer))


@pytest.mark.parametrize("text", ["abc\ud800", "\udfff", "ok \udc80 ok"])
def test_lone_surrogates_are_rejected(eng, text):
    with pytest.raises(ValueError, match="text"):
        eng.generate(text, max_new_tokens=1)
    with pytest.raises(ValueError, match="text"):
        eng.warm([text])
    with pytest.raises(ValueError, match="text"):
        Segment(text=text, cacheable=True)


@pytest.mark.parametrize("prompts", ["ab", b"ab", Segment(text="ab"), 7])
def test_verify_rejects_a_bare_prompt(eng, prompts):
    with pytest.raises(TypeError, match="prompts"):
        eng.verify(prompts)


@pytest.mark.parametrize("repairs,exc", [("cacheblend", TypeError), (("none", "fast"), ValueError)])
def test_verify_rejects_bad_repairs(eng, repairs, exc):
    with pytest.raises(exc, match="repair"):
        eng.verify(["Where?"], repairs=repairs)


@pytest.mark.parametrize("kw,exc,name", [
    (dict(check_layer=True), TypeError, "check_layer"),
    (dict(check_layer=-1), ValueError, "check_layer"),
    (dict(recompute_ratio=True), TypeError, "recompute_ratio"),
    (dict(recompute_ratio=math.nan), ValueError, "recompute_ratio"),
])
def test_config_rejects(kw, exc, name):
    with pytest.raises(exc, match=name):
        EngineConfig(**kw)


def test_config_check_layer_past_the_model_is_clamped(tiny_llama, tokenizer):
    e = engine_for(tiny_llama, tokenizer, check_layer=50)  # the config does not know the model: clamped
    res = e.prefill([Segment(text=CORPUS[0], cacheable=True), Segment(text=" Why?")], store_prefix=False)
    assert len(res.stats["tokens_per_layer"]) == e.driver.num_layers


def test_cli_fidelity_rejects_a_negative_check_layer(tmp_path, capsys):
    from kvboost_rag.app import cli
    from kvboost_rag.tiny import tiny_model_and_tokenizer

    model, tok = tiny_model_and_tokenizer()
    model.save_pretrained(tmp_path)
    tok.save_pretrained(tmp_path)
    import torch

    threads = torch.get_num_threads()
    try:
        with pytest.raises(SystemExit) as exc:  # a user error: one line, exit status 2, nothing measured
            cli.main(["fidelity", "--model", str(tmp_path), "--prompts", "1", "--max-new-tokens", "1",
                      "--check-layer", "-1", "--threads", "1"])
        assert exc.value.code == 2
        err = capsys.readouterr().err
        assert "--check-layer" in err and "KL" not in err
        # past the model's last layer (2 layers): the engine's check, still one line and exit status 2
        assert cli.main(["fidelity", "--model", str(tmp_path), "--prompts", "1", "--max-new-tokens", "1",
                         "--check-layer", "5", "--threads", "1"]) == 2
        assert "check_layer" in capsys.readouterr().err
    finally:
        torch.set_num_threads(threads)
    assert "KL" not in capsys.readouterr().out
