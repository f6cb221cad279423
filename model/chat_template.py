"""The Qwen3.5 chat template, written out in plain Python.

`render_segments` turns OpenAI-style messages (and tools) into a flat list of segments: `Special` markers for the
control tokens the template itself inserts, and plain strings for everything else. The tokenizer maps each `Special`
to its token id and encodes the strings as ordinary text, so nothing a user, a tool or a model wrote can ever become a
control token.

The layout follows the official Qwen3.5 jinja template (text-only subset):

* System turn first. With tools it holds the `# Tools` section (one JSON schema a line inside `<tools>...</tools>`
  and instructions for the XML call format), then the system message, if any.
* Each user turn is `<|im_start|>user\\n{content}<|im_end|>\\n`; message content is whitespace-trimmed.
* Assistant turns after the last real user query carry a `<think>\\n{reasoning}\\n</think>\\n\\n` block; earlier ones
  drop their reasoning. Tool calls follow the content in the XML form.
* Runs of consecutive tool messages become one user turn of `<tool_response>` blocks; a tool message that opens the
  conversation opens no user turn (the official template only opens one after a non-tool message).
* Tool-call argument values that are strings are written as is, objects and arrays as JSON; booleans and null follow
  the model: Qwen3.5's template writes Python's `True`/`False`/`None` (`literals="python"`), Qwen3.6's JSON's
  `true`/`false`/`null` (`literals="json"`, the default).
* The generation prompt is `<|im_start|>assistant\\n<think>\\n`, or with thinking disabled
  `<|im_start|>assistant\\n<think>\\n\\n</think>\\n\\n`.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass

ROLES = ("system", "user", "assistant", "tool")
LITERAL_STYLES = ("json", "python")  # how tool-call arguments write booleans and null: Qwen3.6 / Qwen3.5

# Control tokens that appear in the template's own fixed text (the tool-format instructions).
_TEMPLATE_SPECIALS = ("<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>", "<think>", "</think>")
_TEMPLATE_SPECIAL_RE = re.compile("(" + "|".join(re.escape(s) for s in _TEMPLATE_SPECIALS) + ")")

_TOOLS_HEADER = "# Tools\n\nYou have access to the following functions:\n\n<tools>"
_TOOLS_INSTRUCTIONS = (
    "\n</tools>\n\n"
    "If you choose to call a function ONLY reply in the following format with NO suffix:\n\n"
    "<tool_call>\n<function=example_function_name>\n<parameter=example_parameter_1>\nvalue_1\n</parameter>\n"
    "<parameter=example_parameter_2>\nThis is the value for the second parameter\nthat can span\nmultiple lines\n"
    "</parameter>\n</function>\n</tool_call>\n\n"
    "<IMPORTANT>\nReminder:\n"
    "- Function calls MUST follow the specified format: an inner <function=...></function> block must be nested "
    "within <tool_call></tool_call> XML tags\n"
    "- Required parameters MUST be specified\n"
    "- You may provide optional reasoning for your function call in natural language BEFORE the function call, "
    "but NOT after\n"
    "- If there is no function call available, answer the question like normal with your current knowledge and do "
    "not tell the user about function calls\n"
    "</IMPORTANT>"
)


@dataclass(frozen=True)
class Special:
    """A control token inserted by the template, named by its text form (e.g. `<|im_start|>`)."""

    token: str


Segment = Special | str

IM_START, IM_END = Special("<|im_start|>"), Special("<|im_end|>")
THINK, END_THINK = Special("<think>"), Special("</think>")
TOOL_CALL, END_TOOL_CALL = Special("<tool_call>"), Special("</tool_call>")
TOOL_RESPONSE, END_TOOL_RESPONSE = Special("<tool_response>"), Special("</tool_response>")


def render_segments(
    messages: list[dict],
    tools: list[dict] | None = None,
    add_generation_prompt: bool = True,
    enable_thinking: bool = False,
    literals: str = "json",
) -> list[Segment]:
    """Render a conversation as template segments; raises ValueError on malformed input. `literals` (see
    LITERAL_STYLES) is how tool-call arguments write booleans and null."""
    _check_messages(messages)
    _check_literals(literals)
    contents = [_content_text(m.get("content"), m["role"]) for m in messages]
    last_query = _last_query_index(messages, contents)
    segments = _system_turn(messages, contents, tools)
    for i, message in enumerate(messages):
        role = message["role"]
        if role == "system" and i > 0:
            raise ValueError(f"messages[{i}]: a system message must be the first message")
        if role == "user":
            segments += [IM_START, "user\n" + contents[i], IM_END, "\n"]
        elif role == "assistant":
            segments += _assistant_turn(message, contents[i], i > last_query, literals)
        elif role == "tool":
            segments += _tool_result(messages, contents, i, opens_first=False)
    if add_generation_prompt:
        segments += _generation_prompt(enable_thinking)
    return segments


def render_continuation(
    messages: list[dict], closed: bool = True, enable_thinking: bool = False
) -> list[Segment]:
    """Segments that append user or tool turns to a conversation whose last assistant turn was generated
    token by token: close that turn if generation stopped before `<|im_end|>`, then the new turns and the
    generation prompt. Rendering the whole conversation again gives the same tokens from the cut on."""
    _check_messages(messages)
    segments: list[Segment] = [] if closed else [IM_END]
    segments.append("\n")
    for i, message in enumerate(messages):
        content = _content_text(message.get("content"), message["role"])
        if message["role"] == "user":
            segments += [IM_START, "user\n" + content, IM_END, "\n"]
        elif message["role"] == "tool":
            contents = [_content_text(m.get("content"), "tool") for m in messages]
            segments += _tool_result(messages, contents, i, opens_first=True)  # after the generated turn
        else:
            raise ValueError(f"messages[{i}]: only user and tool turns can follow a generated turn")
    return segments + _generation_prompt(enable_thinking)


def _check_literals(literals: str) -> None:
    if literals not in LITERAL_STYLES:
        raise ValueError(f"literals must be one of {LITERAL_STYLES}, got {literals!r}")


def _content_text(content, role: str) -> str:
    """The text of a message's content (a string, a list of text parts, or None), whitespace-trimmed."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content.strip()
    if isinstance(content, list):
        return "".join(_part_text(part, role) for part in content).strip()
    raise ValueError(f"{role} message content must be a string or a list of parts, got {type(content).__name__}")


def _part_text(part, role: str) -> str:
    """The text of one content part; only text parts are supported (this toolkit serves the text model)."""
    if not isinstance(part, dict):
        raise ValueError(f"{role} message content parts must be dicts, got {type(part).__name__}")
    kind = part.get("type", "text" if "text" in part else None)
    if kind != "text" or not isinstance(part.get("text"), str):
        raise ValueError(f"{role} message has an unsupported content part of type {kind!r} (only text is supported)")
    return part["text"]


def _check_messages(messages) -> None:
    """Reject anything that is not a non-empty list of dicts with a known role."""
    if not isinstance(messages, list) or not messages:
        raise ValueError("messages must be a non-empty list")
    for i, message in enumerate(messages):
        if not isinstance(message, dict):
            raise ValueError(f"messages[{i}] must be a dict, got {type(message).__name__}")
        if message.get("role") not in ROLES:
            raise ValueError(f"messages[{i}] has unknown role {message.get('role')!r}; expected one of {ROLES}")


def _last_query_index(messages: list[dict], contents: list[str]) -> int:
    """Index of the last user message that is a real query (not a hand-wrapped tool response)."""
    for i in range(len(messages) - 1, -1, -1):
        text = contents[i]
        is_tool_response = text.startswith("<tool_response>") and text.endswith("</tool_response>")
        if messages[i]["role"] == "user" and not is_tool_response:
            return i
    raise ValueError("messages contain no user query")


def _system_turn(messages: list[dict], contents: list[str], tools: list[dict] | None) -> list[Segment]:
    """The opening system turn: the tools section (if any tools) followed by the system message (if any)."""
    system = contents[0] if messages[0]["role"] == "system" else None
    if not tools:
        return [] if system is None else [IM_START, "system\n" + system, IM_END, "\n"]
    segments: list[Segment] = [IM_START, "system\n" + _TOOLS_HEADER]
    for tool in _check_tools(tools):
        try:
            segments.append("\n" + json.dumps(tool, ensure_ascii=False))
        except (TypeError, ValueError, RecursionError) as err:
            raise ValueError(f"a tool definition is not JSON ({type(err).__name__})") from None
    segments += _template_text(_TOOLS_INSTRUCTIONS)
    if system:
        segments.append("\n\n" + system)
    return segments + [IM_END, "\n"]


def _check_tools(tools) -> list[dict]:
    """Validate OpenAI-style tool definitions: each needs a function with a non-empty string name; its parameters,
    when given, are a JSON-schema object whose properties are objects (what the tool-call parser reads)."""
    if not isinstance(tools, list):
        raise ValueError(f"tools must be a list, got {type(tools).__name__}")
    for i, tool in enumerate(tools):
        function = tool.get("function", tool) if isinstance(tool, dict) else None
        if not isinstance(function, dict) or not isinstance(function.get("name"), str) or not function["name"]:
            raise ValueError(f"tools[{i}] has no function name")
        parameters = function.get("parameters")
        properties = parameters.get("properties") if isinstance(parameters, dict) else None
        if parameters is not None and (not isinstance(parameters, dict) or properties is not None and (
                not isinstance(properties, dict) or not all(isinstance(p, dict) for p in properties.values()))):
            raise ValueError(f"tools[{i}].function.parameters must be a JSON-schema object whose properties are "
                             "objects")
    return tools


def _template_text(text: str) -> list[Segment]:
    """Split the template's own fixed text at control-token names (only ever used on template constants)."""
    pieces = _TEMPLATE_SPECIAL_RE.split(text)
    return [Special(p) if p in _TEMPLATE_SPECIALS else p for p in pieces if p]


def _assistant_turn(message: dict, content: str, show_reasoning: bool, literals: str = "json") -> list[Segment]:
    """An assistant turn: optional think block, content, then its tool calls in the XML form."""
    reasoning, content = _assistant_reasoning(message, content)
    segments: list[Segment] = [IM_START, "assistant\n"]
    if show_reasoning:
        segments += [THINK, "\n" + reasoning + "\n", END_THINK, "\n\n"]
    segments.append(content)
    calls = message.get("tool_calls") or []
    if not isinstance(calls, list):
        raise ValueError(f"assistant tool_calls must be a list, got {type(calls).__name__}")
    for k, call in enumerate(calls):
        separator = "\n" if k > 0 else ("\n\n" if content else "")
        segments += [separator, TOOL_CALL, _tool_call_body(call, literals), END_TOOL_CALL]
    return segments + [IM_END, "\n"]


def _assistant_reasoning(message: dict, content: str) -> tuple[str, str]:
    """(reasoning, content): `reasoning_content` if given, else a `<think>...</think>` prefix split off content."""
    reasoning = message.get("reasoning_content")
    if isinstance(reasoning, str):
        return reasoning.strip(), content
    if "</think>" in content:
        parts = content.split("</think>")
        return parts[0].split("<think>")[-1].strip(), parts[-1].lstrip("\n")
    return "", content


def _tool_call(call) -> tuple[str, dict]:
    """An OpenAI-format tool call's (function name, arguments as a dict)."""
    function = call.get("function", call) if isinstance(call, dict) else None
    name = function.get("name") if isinstance(function, dict) else None
    if not isinstance(name, str) or not name:
        raise ValueError("assistant tool call has no function name")
    return name, _call_arguments(function.get("arguments"), name)


def _tool_call_body(call, literals: str = "json") -> str:
    """The text between `<tool_call>` and `</tool_call>` for one OpenAI-format tool call."""
    name, arguments = _tool_call(call)
    lines = [f"\n<function={name}>\n"]
    for key, value in arguments.items():
        try:
            if isinstance(value, str):
                text = value
            elif literals == "python" and (value is None or isinstance(value, bool)):
                text = str(value)  # Qwen3.5's template: `args_value | string` for scalars
            else:
                text = json.dumps(value, ensure_ascii=False)
        except (TypeError, ValueError, RecursionError) as err:  # a set, NaN rules, nesting past the limit
            raise ValueError(f"tool call {name!r}: argument {key!r} is not JSON ({type(err).__name__})") from None
        lines.append(f"<parameter={key}>\n{text}\n</parameter>\n")
    return "".join(lines) + "</function>\n"


def _call_arguments(arguments, name: str) -> dict:
    """A tool call's arguments as a dict, from a JSON-object string, a dict, or nothing."""
    if arguments is None or arguments == "":
        return {}
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except (ValueError, RecursionError) as err:  # JSONDecodeError, an integer past the digit limit, deep nesting
            raise ValueError(f"tool call {name!r}: arguments are not valid JSON ({type(err).__name__}: "
                             f"{str(err)[:200]})") from None
    if not isinstance(arguments, dict):
        raise ValueError(f"tool call {name!r}: arguments must be a JSON object, got {type(arguments).__name__}")
    return arguments


def _tool_result(messages: list[dict], contents: list[str], i: int, opens_first: bool) -> list[Segment]:
    """One tool result; a run of consecutive tool messages shares a single user turn. A run at i == 0 opens one
    only if `opens_first` (a continuation after a generated turn); a conversation's leading run opens none."""
    opens = opens_first if i == 0 else messages[i - 1]["role"] != "tool"
    closes = i == len(messages) - 1 or messages[i + 1]["role"] != "tool"
    segments: list[Segment] = [IM_START, "user"] if opens else []
    segments += ["\n", TOOL_RESPONSE, "\n" + contents[i] + "\n", END_TOOL_RESPONSE]
    if closes:
        segments += [IM_END, "\n"]
    return segments


def _generation_prompt(enable_thinking: bool) -> list[Segment]:
    """The assistant header the model continues from, opening (or skipping) its think block."""
    if enable_thinking:
        return [IM_START, "assistant\n", THINK, "\n"]
    return [IM_START, "assistant\n", THINK, "\n\n", END_THINK, "\n\n"]


def merge_text(segments: list[Segment]) -> list[Segment]:
    """Join adjacent text segments and drop empty ones, so each text run is tokenized as a whole."""
    merged: list[Segment] = []
    for segment in segments:
        if isinstance(segment, str) and merged and isinstance(merged[-1], str):
            merged[-1] += segment
        elif segment != "":
            merged.append(segment)
    return merged


def segments_to_text(segments: list[Segment]) -> str:
    """The rendered prompt as one display string (control tokens written as their names)."""
    return "".join(s.token if isinstance(s, Special) else s for s in segments)
