"""Tool-call values typed by the tool's JSON schema, as vLLM's `coerce_to_schema_type` does
(`kvfold.chat.parsers` reads DSML and GLM tool calls with these)."""
from __future__ import annotations

import json
from typing import Any

_TYPE_ALIASES = {"str": "string", "text": "string", "int": "integer", "float": "number",
                 "double": "number", "bool": "boolean", "dict": "object", "list": "array"}


def schema_types(schema: Any) -> set[str]:
    """The JSON types a parameter schema allows (`type`, `enum`, `anyOf`/`oneOf`/`allOf`).

    An empty set means "no type information": the value is then kept as the model wrote it."""
    types: set[str] = set()
    if not isinstance(schema, dict):
        return types
    declared = schema.get("type")
    for t in declared if isinstance(declared, list) else [declared]:
        if isinstance(t, str):
            types.add(_TYPE_ALIASES.get(t.strip().lower(), t.strip().lower()))
    enum = schema.get("enum")
    if isinstance(enum, list):
        types.update(_json_type(v) for v in enum)
    for key in ("anyOf", "oneOf", "allOf"):
        choices = schema.get(key)
        if isinstance(choices, list):
            for choice in choices:
                types |= schema_types(choice)
    return types


def _json_type(value: Any) -> str:
    """JSON-Schema type name of a parsed JSON value."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, int):
        return "integer"
    if isinstance(value, float):
        return "number"
    if isinstance(value, str):
        return "string"
    return "array" if isinstance(value, list) else "object"


def _strict_json(text: str) -> tuple[bool, Any]:
    """(ok, value) for strict JSON: no NaN/Infinity (Python's json accepts them, JSON does not)
    and nothing that would not serialize back (1e999 parses to inf). Never raises: too-deep
    nesting is just "not JSON"."""
    def reject(_constant: str) -> Any:
        raise ValueError("non-finite number")

    try:
        value = json.loads(text, parse_constant=reject)
        json.dumps(value, allow_nan=False)
    except (ValueError, RecursionError, MemoryError):  # all mean "not usable JSON"
        return False, None
    return True, value


def _allowed(value: Any, types: set[str]) -> bool:
    kind = _json_type(value)
    return kind in types or (kind == "integer" and "number" in types)


def coerce_text(raw: str, types: set[str]) -> Any:
    """A raw-text value typed by its schema, as vLLM's `coerce_to_schema_type` does: a string
    parameter (or one with no type information) keeps the text exactly; otherwise the first of
    null, integer, number, boolean, object, array that the text parses as; else the text."""
    text = raw.strip()
    if "null" in types and text == "null":
        return None
    if not types or "string" in types:
        return raw
    if "boolean" in types and text.lower() in ("true", "false"):
        return text.lower() == "true"
    ok, value = _strict_json(text)
    if ok and not isinstance(value, bool) and value is not None and _allowed(value, types):
        return value
    return raw


def coerce_json(raw: str, types: set[str]) -> tuple[bool, Any]:
    """A DSML ``string="false"`` value: it must be JSON (else the block is malformed). A JSON
    value the schema does not allow is mended where that is unambiguous: a JSON string for a
    non-string parameter is coerced from its text, any JSON for a string-only parameter becomes
    its text; otherwise the model's JSON is kept."""
    ok, value = _strict_json(raw.strip())
    if not ok:
        return False, None
    if not types or _allowed(value, types):
        return True, value
    if isinstance(value, str):
        return True, coerce_text(value, types)
    if "string" in types:
        return True, raw.strip()
    return True, value


def tool_properties(tools: list[dict] | None) -> dict[str, dict]:
    """Function name -> its JSON-schema `properties`, from OpenAI tools (or bare functions).
    Entries of any other shape are ignored: they only lose coercion, never raise."""
    table: dict[str, dict] = {}
    for tool in tools or []:
        if not isinstance(tool, dict):
            continue
        function = tool.get("function", tool)
        if not isinstance(function, dict) or not isinstance(function.get("name"), str):
            continue
        params = function.get("parameters")
        props = params.get("properties") if isinstance(params, dict) else None
        table[function["name"]] = props if isinstance(props, dict) else {}
    return table
