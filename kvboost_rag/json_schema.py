"""JSON-schema helpers shared by constrained decoding (kvboost_rag.constrained) and the tool-call format
(kvboost_rag.toolcalls). Pure functions, stdlib only."""

from __future__ import annotations

from typing import Any


def closed_schema(schema: Any) -> Any:
    """``schema`` with ``additionalProperties: false`` on every object that lists properties and does not
    say otherwise: JSON-schema's default lets a model add keys until the token budget runs out, and pydantic
    schemas never say it."""
    if isinstance(schema, list):
        return [closed_schema(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: closed_schema(v) for k, v in schema.items()}
    if "properties" in out and "additionalProperties" not in out:
        out["additionalProperties"] = False
    return out
