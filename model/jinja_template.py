"""A checkpoint's own chat template (jinja), rendered without letting message text become control tokens.

The template runs in the sandboxed environment transformers 5.x builds for `apply_chat_template`
(`ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)` with `jinja2.ext.loopcontrols`, a
`{% generation %}` tag, a `tojson` filter that does not HTML-escape, and the `raise_exception` / `strftime_now`
globals). A rendered string alone cannot tell a template's `<|im_end|>` from one a user typed, so the template never
sees message text: every request string (content, reasoning, tool names, argument keys and values, tool results, tool
definitions) reaches it as a placeholder `@@<nonce>#<n>@@` (the nonce is random per render), and the output is cut
at the placeholders. The template's own text between them is tokenized with control-token names allowed; each field
is spliced back as plain text (`Special` segments only ever come from template text), so the ids are what
transformers would give for the same conversation, minus any control token a request tried to smuggle in.

What the template may do with a field, and how the placeholders keep it exact:

* write it (`{{ content }}`, `'<function=' + name + '>'`): spliced as is;
* `|trim` it: contents are trimmed before masking (the Qwen templates trim every content), so trim is a no-op;
* `|tojson` it (tool definitions, nested argument values): our `tojson` rewrites the placeholders it writes into
  JSON-string form, spliced as `json.dumps(text)` without its quotes;
* compare it: strings of only letters, digits, `_`, `-` and `.` (roles, `"function"`, most tool and argument names)
  are passed as they are, as they cannot spell or complete a control token;
* look inside it: the two tests the Qwen templates make are answered before rendering. An assistant content with a
  `</think>` is split into `reasoning_content` and content here (the template's own rule), and a user content
  wrapped in `<tool_response>...</tool_response>` keeps that wrapper around its placeholder (spliced whole, as
  text) so the template's `startswith`/`endswith` test still sees it.

Where it cannot work: a template that slices, splits, searches or re-cases message text in other ways, sorts JSON
keys of masked strings (`tojson(sort_keys=True)`), or renders a field through `|string`/`repr` of a container. A
placeholder it took apart is detected where its pieces show (part of the nonce, or its `#n@@` tail) and raises
ValueError; any other difference shows up only as a differently rendered prompt. Neither can inject a control token:
request text reaches the rendered string only through placeholders.
"""

from __future__ import annotations

import json
import re
import secrets
from datetime import datetime
from pathlib import Path

from model.chat_template import (
    Segment,
    Special,
    _assistant_reasoning,
    _check_messages,
    _check_tools,
    _content_text,
    _tool_call,
)

_RAW_RE = re.compile(r"[A-Za-z0-9_.\-]*")  # strings that cannot spell or complete a control-token name
_WRAP_OPEN, _WRAP_CLOSE = "<tool_response>", "</tool_response>"
_PLACEHOLDER_RE = re.compile(r"@@([0-9a-f]{16})#(\d+)@@")


def _jinja_environment():
    """The sandboxed environment of transformers' `_cached_compile_jinja_template`, minus its assistant-mask
    tracking (`{% generation %}` blocks render their body unchanged)."""
    import jinja2
    import jinja2.ext
    import jinja2.nodes
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class GenerationTag(jinja2.ext.Extension):
        tags = {"generation"}

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return jinja2.nodes.CallBlock(self.call_method("_render"), [], [], body).set_lineno(lineno)

        def _render(self, caller):
            return caller()

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def strftime_now(fmt):
        return datetime.now().strftime(fmt)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[GenerationTag, jinja2.ext.loopcontrols])
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = strftime_now
    env.filters["tojson"] = _tojson
    return env


def _tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    """transformers' `tojson` filter (no HTML escaping), with the placeholders it writes marked as being in
    JSON-string context."""
    text = json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)
    return _PLACEHOLDER_RE.sub(lambda m: f"@@{m[1]}#{m[2]}:j{int(ensure_ascii)}@@", text)


def find_chat_template(folder) -> str | None:
    """A checkpoint folder's chat template: `chat_template.jinja`, else `chat_template` in `chat_template.json` or
    `tokenizer_config.json` (a string, or a list of named templates: the one named `default`); None if it has none."""
    folder = Path(folder)
    if (folder / "chat_template.jinja").is_file():
        return (folder / "chat_template.jinja").read_text(encoding="utf-8")
    for name in ("chat_template.json", "tokenizer_config.json"):
        path = folder / name
        if not path.is_file():
            continue
        template = json.loads(path.read_text(encoding="utf-8")).get("chat_template")
        if isinstance(template, list):
            named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
            template = named.get("default")
        if isinstance(template, str) and template:
            return template
    return None


class _Fields:
    """The request strings of one render, each behind a placeholder that cannot occur in text a client sent."""

    def __init__(self, source: str):
        self.nonce = secrets.token_hex(8)
        while self.nonce in source:  # the template's own text must not contain it either
            self.nonce = secrets.token_hex(8)
        self.texts: list[str] = []
        self.wrapped: list[bool] = []
        self.pattern = re.compile(f"({re.escape(_WRAP_OPEN)})?@@{self.nonce}#(\\d+)(:j[01])?@@"
                                  f"({re.escape(_WRAP_CLOSE)})?")

    def mask(self, text: str, wrap: bool = False) -> str:
        """`text` itself if harmless, else a fresh placeholder (kept inside a `<tool_response>` wrapper if `wrap`
        and text has one, so a template's startswith/endswith test on it gives the same answer)."""
        if _RAW_RE.fullmatch(text):
            return text
        wrap = wrap and len(text) >= len(_WRAP_OPEN + _WRAP_CLOSE) and text.startswith(_WRAP_OPEN) \
            and text.endswith(_WRAP_CLOSE)
        self.texts.append(text)
        self.wrapped.append(wrap)
        marker = f"@@{self.nonce}#{len(self.texts) - 1}@@"
        return _WRAP_OPEN + marker + _WRAP_CLOSE if wrap else marker

    def mask_tree(self, value):
        """A JSON-like value with every string (dict keys too) masked."""
        if isinstance(value, str):
            return self.mask(value)
        if isinstance(value, dict):
            return {self.mask(k) if isinstance(k, str) else k: self.mask_tree(v) for k, v in value.items()}
        if isinstance(value, (list, tuple)):
            return [self.mask_tree(v) for v in value]
        return value

    def splice(self, rendered: str, specials) -> list[Segment]:
        """The rendered text as segments: template text split at control-token names, fields as plain text."""
        segments: list[Segment] = []
        template_text: list[str] = []
        position = 0
        for match in self.pattern.finditer(rendered):
            opened, index, json_mode, closed = match.groups()
            n = int(index)
            if n >= len(self.texts):
                raise ValueError("chat template produced an unknown placeholder")
            if self.wrapped[n] and not (opened and closed):
                raise ValueError("chat template took a message field apart; cannot render it safely")
            prefix, suffix = ("", "") if self.wrapped[n] else (opened or "", closed or "")
            template_text += [rendered[position:match.start()] + prefix, suffix]
            segments += specials(template_text[-2])
            text = self.texts[n]
            if json_mode:
                text = json.dumps(text, ensure_ascii=json_mode == ":j1")[1:-1]
            segments.append(text)
            segments += specials(suffix)
            position = match.end()
        template_text.append(rendered[position:])
        segments += specials(template_text[-1])
        leftover = re.compile(f"(?i){self.nonce[4:12]}|#\\d+(:j[01])?@@")  # a placeholder the template cut or re-cased
        if any(leftover.search(text) for text in template_text):
            raise ValueError("chat template altered a message field; cannot render it safely")
        return segments


class JinjaChatTemplate:
    """A checkpoint's jinja chat template, rendered to segments (see the module docstring)."""

    def __init__(self, source: str, special_names, extra_context: dict | None = None):
        self.source = source
        self._template = _jinja_environment().from_string(source)
        names = sorted(special_names, key=len, reverse=True)
        self._special_re = re.compile("(" + "|".join(re.escape(n) for n in names) + ")")
        self._special_names = frozenset(names)
        self._context = dict(extra_context or {})

    @classmethod
    def from_folder(cls, folder, special_names) -> JinjaChatTemplate | None:
        """The folder's template (see find_chat_template), with its tokenizer_config's special-token strings
        (`eos_token`, ...) as template variables, as transformers passes them; None if the folder has none."""
        source = find_chat_template(folder)
        if source is None:
            return None
        context = {}
        config = Path(folder) / "tokenizer_config.json"
        if config.is_file():
            for key, value in json.loads(config.read_text(encoding="utf-8")).items():
                if key.endswith("_token") and isinstance(value, str):
                    context[key] = value
        return cls(source, special_names, context)

    def _specials(self, text: str) -> list[Segment]:
        return [Special(p) if p in self._special_names else p for p in self._special_re.split(text) if p]

    def render_segments(self, messages: list[dict], tools: list[dict] | None = None,
                        add_generation_prompt: bool = True, enable_thinking: bool = False) -> list[Segment]:
        """Render a conversation; raises ValueError on malformed input or when the template raises."""
        import jinja2

        fields = _Fields(self.source)
        masked = _mask_messages(messages, fields)
        masked_tools = fields.mask_tree(_check_tools(tools)) if tools else None
        try:
            rendered = self._template.render(messages=masked, tools=masked_tools, documents=None,
                                             add_generation_prompt=add_generation_prompt,
                                             enable_thinking=enable_thinking, **self._context)
        except jinja2.exceptions.TemplateError as err:
            raise ValueError(f"chat template: {err}") from None
        return fields.splice(rendered, self._specials)

    def literal_style(self) -> str:
        """How this template writes a boolean tool-call argument: "python" (Qwen3.5's `True`) or "json" (Qwen3.6's
        `true`), found by rendering a probe conversation; "json" if the probe does not render."""
        probe = [{"role": "user", "content": "q"},
                 {"role": "assistant", "content": "", "tool_calls": [
                     {"type": "function", "function": {"name": "f", "arguments": {"flag": False}}}]}]
        try:
            text = "".join(s.token if isinstance(s, Special) else s for s in self.render_segments(probe, None, False))
        except ValueError:
            return "json"
        return "python" if re.search(r"\bFalse\b", text) else "json"


def _mask_messages(messages: list[dict], fields: _Fields) -> list[dict]:
    """Messages normalized as the built-in renderer reads them (contents trimmed, reasoning split off, tool-call
    arguments parsed) with their strings masked; keys the Qwen templates do not read are dropped."""
    _check_messages(messages)
    masked = []
    for message in messages:
        role = message["role"]
        content = _content_text(message.get("content"), role)
        item: dict = {"role": role}
        if role == "assistant":
            reasoning, content = _assistant_reasoning(message, content)
            item["reasoning_content"] = fields.mask(reasoning)
            calls = message.get("tool_calls") or []
            if not isinstance(calls, list):
                raise ValueError(f"assistant tool_calls must be a list, got {type(calls).__name__}")
            item["tool_calls"] = [_mask_call(call, fields) for call in calls]
        item["content"] = fields.mask(content, wrap=role == "user")
        masked.append(item)
    return masked


def _mask_call(call, fields: _Fields) -> dict:
    name, arguments = _tool_call(call)
    return {"type": "function", "function": {"name": fields.mask(name), "arguments": fields.mask_tree(arguments)}}
