"""Parsing Qwen3.5 model output into reasoning, content and OpenAI-format tool calls.

Qwen3.5 calls tools in an XML form, one block per call:

    <tool_call>
    <function=NAME>
    <parameter=KEY>
    VALUE
    </parameter>
    </function>
    </tool_call>

Older Qwen models used a JSON body instead (`<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`); both are
accepted. XML parameter values are raw text, typed here by the tool's JSON schema. A block that does not parse stays
in the content as text.
"""

from __future__ import annotations

import json
import re
import secrets

_OPEN, _CLOSE = "<tool_call>", "</tool_call>"
_FUNCTION_RE = re.compile(r"<function=([^>\n]+)>(.*)</function>", re.DOTALL)
_PARAMETER_RE = re.compile(r"\s*<parameter=([^>\n]+)>(.*?)</parameter>", re.DOTALL)

# Python types of decoded JSON values, by JSON-schema type name.
_JSON_TYPES = {
    "string": (str,),
    "integer": (int,),
    "number": (int, float),
    "boolean": (bool,),
    "object": (dict,),
    "array": (list,),
    "null": (type(None),),
}


def parse_tool_calls(text: str, tools: list[dict] | None = None) -> tuple[str, list[dict]]:
    """(content, calls): `text` with its tool-call blocks removed and stripped, plus the calls in OpenAI format.

    Parameter values are typed by the matching tool's JSON schema; without a schema for the function they stay
    strings. Blocks that cannot be parsed are left in the content unchanged.
    """
    schemas = _parameter_schemas(tools)
    calls: list[dict] = []
    kept, position = [], 0
    # each opener to the first closer after it; once an opener has no closer, no later one has: one linear scan
    while (start := text.find(_OPEN, position)) >= 0 and (end := text.find(_CLOSE, start + len(_OPEN))) >= 0:
        call = _parse_block(text[start + len(_OPEN):end], schemas)
        kept.append(text[position:start] if call is not None else text[position:end + len(_CLOSE)])
        if call is not None:
            calls.append(call)
        position = end + len(_CLOSE)
    kept.append(text[position:])
    return "".join(kept).strip(), calls


def split_reasoning(text: str) -> tuple[str | None, str]:
    """(reasoning, rest): the text before `</think>` (minus any opening `<think>`) and the text after it.

    The generation prompt already opens the think block, so model output normally holds only the closing tag.
    Without `</think>` the text counts as reasoning only if it starts with `<think>` (reasoning cut off); a caller
    that prompted with thinking enabled and got no `</think>` should treat the whole text as reasoning itself.
    Empty reasoning is reported as None; both parts are stripped.
    """
    if "</think>" in text:
        reasoning, _, rest = text.partition("</think>")
    elif text.lstrip().startswith("<think>"):
        reasoning, rest = text, ""
    else:
        return None, text.strip()
    reasoning = reasoning.split("<think>")[-1].strip()
    return reasoning or None, rest.strip()


def _parameter_schemas(tools: list[dict] | None) -> dict[str, dict]:
    """Map each tool's function name to its parameter property schemas (tools without a name are skipped)."""
    schemas: dict[str, dict] = {}
    for tool in tools or []:
        function = tool.get("function", tool) if isinstance(tool, dict) else None
        if isinstance(function, dict) and isinstance(function.get("name"), str):
            parameters = function.get("parameters")
            properties = parameters.get("properties") if isinstance(parameters, dict) else None
            schemas[function["name"]] = properties if isinstance(properties, dict) else {}
    return schemas


def _parse_block(body: str, schemas: dict[str, dict]) -> dict | None:
    """One `<tool_call>` body (XML or JSON form) as an OpenAI tool call, or None if malformed."""
    body = body.strip()
    parsed = _parse_json_call(body) if body.startswith("{") else _parse_xml_call(body, schemas)
    if parsed is None:
        return None
    name, arguments = parsed
    return {
        "id": "call_" + secrets.token_hex(12),
        "type": "function",
        "function": {"name": name, "arguments": json.dumps(arguments, ensure_ascii=False)},
    }


def _parse_xml_call(body: str, schemas: dict[str, dict]) -> tuple[str, dict] | None:
    """(name, arguments) from `<function=NAME>` with `<parameter=KEY>` children, or None if malformed."""
    match = _FUNCTION_RE.fullmatch(body)
    if match is None:
        return None
    name, inner = match.group(1).strip(), match.group(2)
    if not name:
        return None
    properties = schemas.get(name)
    arguments: dict = {}
    position = 0
    while param := _PARAMETER_RE.match(inner, position):
        key = param.group(1).strip()
        arguments[key] = _typed_value(_unwrap(param.group(2)), properties, key)
        position = param.end()
    if inner[position:].strip():
        return None
    return name, arguments


def _parse_json_call(body: str) -> tuple[str, dict] | None:
    """(name, arguments) from the older `{"name": ..., "arguments": {...}}` form, or None if malformed."""
    call = _strict_json(body)
    if not isinstance(call, dict) or not isinstance(call.get("name"), str) or not call["name"].strip():
        return None
    arguments = call.get("arguments", {})
    if isinstance(arguments, str):
        arguments = _strict_json(arguments)
    if not isinstance(arguments, dict):
        return None
    return call["name"], arguments


def _unwrap(value: str) -> str:
    """A parameter value without the single newline the format puts on each side of it."""
    value = value.removeprefix("\n")
    return value.removesuffix("\n")


def _typed_value(raw: str, properties: dict | None, key: str):
    """A parameter's value typed by its schema.

    No schema for the function: the raw string. Declared string: the raw string. Declared other types: the JSON
    value if it parses (kept raw when the schema also allows strings and the parsed type is not declared). Undeclared
    parameter or type: JSON if it parses, else the raw string.
    """
    if properties is None:
        return raw
    types = _schema_types(properties.get(key))
    if types == {"string"}:
        return raw
    if "boolean" in types and raw.strip().lower() in ("true", "false"):
        return raw.strip().lower() == "true"
    value = _strict_json(raw, default=raw)
    if value is raw:
        return raw
    if "string" in types and not _matches(value, types):
        return raw
    return value


def _refuse_constant(name: str):
    raise ValueError(f"{name} is not JSON")


def _strict_json(text: str, default=None):
    """text as strict JSON (no NaN or Infinity, which json.dumps would write back as invalid JSON), or default when
    it is not: malformed, an integer past Python's digit limit, or nested too deep."""
    try:
        return json.loads(text, parse_constant=_refuse_constant)
    except (ValueError, RecursionError):
        return default


def _schema_types(schema) -> set[str]:
    """The JSON-schema type names a property allows (`type` as a name or list, or via anyOf/oneOf); may be empty."""
    if not isinstance(schema, dict):
        return set()
    declared = schema.get("type")
    if isinstance(declared, str):
        return {declared}
    if isinstance(declared, list):
        return {t for t in declared if isinstance(t, str)}
    options = schema.get("anyOf") or schema.get("oneOf") or []
    return set().union(*(_schema_types(option) for option in options)) if isinstance(options, list) else set()


def _matches(value, types: set[str]) -> bool:
    """Whether a decoded JSON value has one of the given schema types (booleans are not integers)."""
    for name in types:
        python_types = _JSON_TYPES.get(name, ())
        if isinstance(value, python_types) and not (isinstance(value, bool) and name in ("integer", "number")):
            return True
    return False
