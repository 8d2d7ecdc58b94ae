"""``ChatKVBoost.with_structured_output``: JSON enforced by constrained decoding (kvboost_rag.constrained)."""

from __future__ import annotations

from operator import itemgetter
from typing import Any

from langchain_core.output_parsers import JsonOutputParser, PydanticOutputParser
from langchain_core.runnables import Runnable, RunnableMap, RunnablePassthrough

METHODS = ("json_schema", "json_mode", "function_calling")


def _is_pydantic(schema: Any) -> bool:
    """A pydantic class, v2 or v1 (``pydantic.v1.BaseModel``; PydanticOutputParser builds either)."""
    from langchain_core.utils.pydantic import is_basemodel_subclass

    return isinstance(schema, type) and is_basemodel_subclass(schema)


def json_schema_of(schema: Any) -> dict[str, Any]:
    """A JSON schema from a pydantic class, a TypedDict, an OpenAI tool/function schema or a JSON schema."""
    from langchain_core.utils.function_calling import convert_to_json_schema

    if isinstance(schema, dict) and "properties" in schema and "type" in schema:
        return schema  # already a JSON schema
    return convert_to_json_schema(schema)


def response_format(schema: Any, method: str) -> dict[str, Any]:
    if method == "json_mode":
        return {"type": "json_object", "schema": json_schema_of(schema) if schema is not None else None}
    if schema is None:
        raise ValueError("with_structured_output(method='json_schema') needs a schema; use method='json_mode' "
                         "for any JSON object")
    return {"type": "json_schema", "schema": json_schema_of(schema)}


def structured_runnable(llm: Runnable, schema: Any, include_raw: bool) -> Runnable:
    """``llm`` (already bound to the response format) followed by the parser the schema calls for."""
    parser: Runnable = (PydanticOutputParser(pydantic_object=schema) if _is_pydantic(schema)
                        else JsonOutputParser())
    if not include_raw:
        return llm | parser
    parsed = RunnablePassthrough.assign(parsed=itemgetter("raw") | parser, parsing_error=lambda _: None)
    none = RunnablePassthrough.assign(parsed=lambda _: None)
    return RunnableMap(raw=llm) | parsed.with_fallbacks([none], exception_key="parsing_error")
