"""A known model gets the same defaults whatever folder its weights are loaded from (issue: SmolLM2 by its short
name ran at r=0.7, from a plain HF folder at r=0.15 and then switched to 0.5 after a 24 s calibration inside
warm_documents). Known models are recognised by fingerprint (kvboost_core.zoo.recognise)."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from kvboost_core import zoo
from kvboost_core.engine import KVEngine
from kvboost_core.tuning.calibrate import DEFAULTS_FILE


@pytest.fixture(scope="module")
def plain_dir(tmp_path_factory) -> Path:
    from kvboost_rag.tiny import tiny_model_and_tokenizer

    path = tmp_path_factory.mktemp("plain-model")
    model, tok = tiny_model_and_tokenizer(layers=2, seed=5)
    model.save_pretrained(path)
    tok.save_pretrained(path)
    return path


@pytest.fixture()
def known(plain_dir, monkeypatch):
    """A zoo entry whose weights are ``plain_dir``'s, with shipped defaults unlike the engine's."""
    monkeypatch.setenv("KVBOOST_AUTO_CALIBRATE", "1")
    eng = KVEngine.from_pretrained(str(plain_dir), device="cpu")  # unknown yet: calibrates on first use
    assert eng.config.auto_calibrate and eng.config.recompute_ratio == 0.15
    entry = dataclasses.replace(zoo.SMOLLM2, name="tiny-known", engine_defaults=(("recompute_ratio", 0.7),),
                                shape=zoo.config_shape(eng.model.config), fingerprints=(eng.fingerprint,))
    monkeypatch.setattr(zoo, "MODELS", {**zoo.MODELS, entry.name: entry})
    return entry


def test_known_weights_in_a_plain_folder_get_the_shipped_defaults(plain_dir, known, caplog):
    with caplog.at_level("INFO", logger="kvboost_core.calibration"):
        eng = KVEngine.from_pretrained(str(plain_dir), device="cpu")
    assert eng.config.recompute_ratio == 0.7
    assert not eng.config.auto_calibrate  # no first-use calibration inside a later warm
    assert "tiny-known" in caplog.text and "fingerprint" in caplog.text


def test_explicit_arguments_and_a_kvboost_json_still_win(plain_dir, known, tmp_path):
    assert KVEngine.from_pretrained(str(plain_dir), device="cpu", recompute_ratio=0.3).config.recompute_ratio == 0.3
    import shutil

    copy = tmp_path / "calibrated-copy"
    shutil.copytree(plain_dir, copy)
    (copy / DEFAULTS_FILE).write_text(json.dumps({"engine": {"recompute_ratio": 0.5}}))
    assert KVEngine.from_pretrained(str(copy), device="cpu").config.recompute_ratio == 0.5


def test_other_weights_of_the_same_shape_are_not_recognised(plain_dir, known, tmp_path):
    from kvboost_rag.tiny import tiny_model_and_tokenizer

    model, tok = tiny_model_and_tokenizer(layers=2, seed=6)  # same shape, other weights
    assert zoo.recognise(model, tok) is None


def test_a_model_of_another_shape_is_not_even_fingerprinted(known, monkeypatch):
    from kvboost_core import keys
    from kvboost_rag.tiny import tiny_model_and_tokenizer

    model, tok = tiny_model_and_tokenizer(layers=3, seed=5)

    def boom(*a, **kw):
        raise AssertionError("fingerprinted a model no zoo entry has the shape of")

    monkeypatch.setattr(keys, "model_fingerprint", boom)
    assert zoo.recognise(model, tok) is None


@pytest.mark.skipif(not zoo.available("smollm2-135m-instruct"),
                    reason=f"smollm2-135m-instruct is not installed ({zoo.SMOLLM2.install_hint})")
def test_smollm2_from_a_plain_folder_gets_its_shipped_defaults(tmp_path, monkeypatch):
    """The real weights, in a folder of links to the converted files without kvboost.json: recognised, so the
    same defaults as the short name and no calibration on first use. Fails when a transformers upgrade changes
    the fingerprint: record the new one in zoo.SMOLLM2.fingerprints."""
    monkeypatch.setenv("KVBOOST_AUTO_CALIBRATE", "1")
    src = Path(zoo.resolve("smollm2-135m-instruct"))
    plain = tmp_path / "smollm2-plain"
    plain.mkdir()
    for f in src.iterdir():
        if f.is_file() and f.name != DEFAULTS_FILE:
            (plain / f.name).symlink_to(f)
    eng = KVEngine.from_pretrained(str(plain), device="cpu")
    assert eng.fingerprint in zoo.SMOLLM2.fingerprints
    shipped = zoo.shipped_defaults(zoo.SMOLLM2)
    assert {k: getattr(eng.config, k) for k in shipped} == shipped
    assert not eng.config.auto_calibrate
