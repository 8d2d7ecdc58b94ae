"""API keys → namespaces, the key file's validation, and the serve command's arguments (no server started)."""

from __future__ import annotations

import json

import pytest

from kvboost_rag.app.cli import build_parser
from kvboost_rag.app.server.auth import DEFAULT_NAMESPACE, KeyRing, load_key_file


def test_keyring_resolves_bearer_keys():
    ring = KeyRing({"sk-alpha-123": "alpha", "sk-beta-4567": "beta"})
    assert ring.enabled and ring.namespaces == ["alpha", "beta"]
    assert ring.namespace("Bearer sk-alpha-123") == "alpha"
    assert ring.namespace("bearer sk-beta-4567") == "beta"
    assert ring.namespace("Bearer sk-alpha-12") is None
    assert ring.namespace(None) is None and ring.namespace("Basic xyz") is None
    open_ring = KeyRing(None)
    assert not open_ring.enabled and open_ring.namespace(None) == DEFAULT_NAMESPACE


def test_key_file_validation(tmp_path):
    good = tmp_path / "keys.json"
    good.write_text(json.dumps({"sk-alpha-123": "alpha"}))
    assert load_key_file(good) == {"sk-alpha-123": "alpha"}
    cases = {"[]": "mapping", "{}": "mapping", '{"short": "alpha"}': "8 characters",
             '{"sk-alpha-123": "bad namespace!"}': "namespace", "{not json": "not valid JSON"}
    for text, why in cases.items():
        bad = tmp_path / "bad.json"
        bad.write_text(text)
        with pytest.raises(ValueError, match=why):
            load_key_file(bad)
    with pytest.raises(ValueError, match="cannot read"):
        load_key_file(tmp_path / "missing.json")


def test_serve_arguments_defaults():
    args = build_parser().parse_args(["serve"])
    assert args.host is None and args.port == 8000 and args.max_batch == 8 and args.namespace_keys is None
    args = build_parser().parse_args(["serve", "--max-batch", "1", "--store", "redis://h:6379/0"])
    assert args.max_batch == 1 and args.store == "redis://h:6379/0"
