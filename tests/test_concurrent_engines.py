"""An engine built on a model while another engine's forward runs on it (the backfill thread makes that routine)
must leave that forward intact. ``ModelDriver.for_model`` reset the model's attention name to "sdpa" while the
forward had it switched to kvboost's wrapper, and the forward's next layer handed its ``RowBlocks`` to plain SDPA
(issue #33: ``AttributeError: 'RowBlocks' object has no attribute 'shape'``)."""

from __future__ import annotations

import threading

import torch
from conftest import CORPUS, make_tiny_model
from helpers import engine_for

from kvboost_core import Segment
from kvboost_core.model import attention

DOCS = [CORPUS[4], CORPUS[2], CORPUS[1]]
QUESTION = " Where was Alice born?"
REPAIR = dict(repair="cacheblend", recompute_ratio=0.3)
WAIT_S = 30.0  # a liveness bound only: the builder thread ends at once when the code is right


def test_an_engine_built_during_a_forward_on_the_same_model_leaves_that_forward_intact(tokenizer):
    model = make_tiny_model("llama", seed=3)  # this test's own: the layer hook below touches no other test's model
    prompt = [Segment(text=d, cacheable=True) for d in DOCS] + [Segment(text=QUESTION)]

    def warmed():
        eng = engine_for(model, tokenizer, backfill=False)
        eng.warm(DOCS)
        return eng

    ref = warmed().generate(prompt, max_new_tokens=6, **REPAIR)  # unperturbed
    assert ref.stats["reused_approx"] > 0  # re-placed documents: a planned forward over sparse rows

    eng = warmed()
    paused, resume = threading.Event(), threading.Event()
    built: list = []
    errors: list[BaseException] = []

    def pause_mid_forward(module, args, kwargs):
        # inside the planned forward (the name switched to kvboost's wrapper), between two layers
        if str(model.config._attn_implementation).startswith(attention.PREFIX) and not paused.is_set():
            paused.set()
            resume.wait(WAIT_S)

    def build():
        try:
            assert paused.wait(WAIT_S)
            built.append(engine_for(model, tokenizer, backfill=False))  # ModelDriver.for_model on the same model
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)
        finally:
            resume.set()

    handle = model.model.layers[1].register_forward_pre_hook(pause_mid_forward, with_kwargs=True)
    builder = threading.Thread(target=build)
    builder.start()
    try:
        res = eng.generate(prompt, max_new_tokens=6, **REPAIR)
    finally:
        handle.remove()
        resume.set()
        builder.join(WAIT_S)
    assert paused.is_set() and not errors and built  # the engine was built while the forward was paused in it
    assert res.token_ids == ref.token_ids and torch.equal(res.first_logits, ref.first_logits)
    assert model.config._attn_implementation == "sdpa"  # restored when the forward left
    other = built[0]
    assert other.fingerprint == eng.fingerprint  # the attention's name is no part of the model's identity
    other.warm(DOCS)
    again = other.generate(prompt, max_new_tokens=6, **REPAIR)  # and the new engine works as the first one
    assert again.token_ids == ref.token_ids and torch.equal(again.first_logits, ref.first_logits)


def test_use_base_changes_a_switched_configs_base_and_not_its_name():
    class Cfg:
        _attn_implementation = "sdpa"

    cfg = Cfg()
    assert attention.use_base(cfg, ("sdpa", "eager"), "sdpa") == "sdpa" and cfg._attn_implementation == "sdpa"
    with attention.switched(cfg):
        assert attention.use_base(cfg, ("sdpa", "eager"), "sdpa") == "sdpa"
        assert cfg._attn_implementation == attention.PREFIX + "sdpa"  # still the wrapper's name mid-block
    assert cfg._attn_implementation == "sdpa"
    cfg._attn_implementation = "eager"
    with attention.switched(cfg):
        assert attention.use_base(cfg, ("sdpa",), "sdpa") == "sdpa"  # the base changes; the wrapper stays
        assert cfg._attn_implementation == attention.PREFIX + "sdpa" and attention.base_impl(cfg) == "sdpa"
    assert cfg._attn_implementation == "sdpa"  # the last block out restores the new base
