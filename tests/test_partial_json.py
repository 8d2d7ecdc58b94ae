"""kvboost_rag.partial_json: every prefix of a JSON text closes into valid JSON standing for what has come so
far (value strings stream in, keys without values and unfinished literals are left out)."""

from __future__ import annotations

import json

import pytest

from kvboost_rag.partial_json import close_json_prefix, parse_partial

DOCS = [
    {"name": 'Al\u00e9 "x" \\ y', "age": 123, "tags": ["a", {"b": [1.5e3, True, None, -2]}], "ok": False},
    [{"a": []}, {}, [[]], "s", 0],
    {"nested": {"deeper": {"list": [1, 2, 3], "text": "\u4e2d\n"}}},
]


@pytest.mark.parametrize("doc", DOCS)
@pytest.mark.parametrize("separators", [(",", ":"), (", ", ": ")])
def test_every_prefix_closes_into_valid_json(doc, separators):
    full = json.dumps(doc, separators=separators)
    assert close_json_prefix("") is None
    for i in range(1, len(full) + 1):
        closed = close_json_prefix(full[:i])
        assert closed is not None, full[:i]
        json.loads(closed)
    assert parse_partial(full) == doc


@pytest.mark.parametrize("prefix, closed", [
    ('{"a":"x","b', '{"a":"x"}'),  # a key without its value: left out
    ('{"a":', "{}"),
    ('{"a":1,"b":tru', '{"a":1}'),  # an unfinished literal: left out
    ('{"a":12', '{"a":12}'),  # digits so far are a number
    ('{"a":1.', "{}"),
    ('{"a":"ab\\', '{"a":"ab"}'),  # an escape not written yet
    ('{"a":"ab\\u00', '{"a":"ab"}'),
    ('[1,2', "[1,2]"),
    ('{"a":[1,{"b":"c', '{"a":[1,{"b":"c"}]}'),
])
def test_closing_rules(prefix, closed):
    assert close_json_prefix(prefix) == closed


def test_not_json_and_bad_input():
    for text in ("  ", "abc", "}", '"just a string'):
        assert close_json_prefix(text) is None and parse_partial(text) is None
    with pytest.raises(TypeError, match="text"):
        close_json_prefix(None)  # type: ignore[arg-type]
