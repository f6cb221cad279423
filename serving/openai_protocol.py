"""The OpenAI wire format: request bodies in (validated), response objects and stream chunks out, and the text
side of generation (detokenization with stop strings; reasoning / content / tool-call splitting).

`model` must be the served model's name (or an alias it was given) when it is sent; an unknown one gets 404
`model_not_found`. Extensions as vLLM has them: `top_k`, `ignore_eos`, `stop_token_ids`,
`chat_template_kwargs.enable_thinking` (default False). What is not implemented is refused with a 400 rather than
ignored: `n` > 1, `best_of` > 1, `logprobs`, `echo`, `suffix`, `logit_bias`, presence and frequency penalties,
`response_format` other than text, `parallel_tool_calls: false`, and `tool_choice` other than "auto" or "none"
("none": the tools are neither rendered nor parsed). Stop strings: at most MAX_STOP_STRINGS of at most
MAX_STOP_CHARS characters. Errors carry OpenAI's JSON: {"error": {"message", "type", "param", "code"}}.
"""
import math
import time
import uuid
from dataclasses import dataclass

from model.chat_template import render_segments
from model.tokenizer import QwenTokenizer, StreamDecoder
from model.tool_calls import parse_tool_calls, split_reasoning
from serving.sequence import SamplingParams


class ApiError(Exception):
    """An error to answer with OpenAI's error JSON: status 400 unless said otherwise; `headers` go on the
    response (e.g. Retry-After with a 429)."""

    def __init__(self, message: str, param: str | None = None, status: int = 400,
                 kind: str = "invalid_request_error", code: str | None = None, headers: dict | None = None):
        super().__init__(message)
        self.message, self.param, self.status, self.kind, self.code = message, param, status, kind, code
        self.headers = headers or {}

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}}


@dataclass(frozen=True)
class ServedModel:
    name: str
    max_model_len: int
    vocab_size: int
    aliases: tuple[str, ...] = ()

    def serves(self, model: str) -> bool:
        return model == self.name or model in self.aliases


@dataclass(frozen=True)
class GenerationRequest:
    prompt_ids: list[int]
    params: SamplingParams  # params.stop holds the stop strings
    stream: bool
    include_usage: bool
    tools: list[dict] | None = None
    enable_thinking: bool = False
    cache_point: int = 0  # where the system and tools message ends (LLMEngine.add_request)


# ---- parsing -------------------------------------------------------------------------------------------------


def _field(body: dict, key: str, types: tuple, default=None):
    value = body.get(key)
    if value is None:
        return default
    if not isinstance(value, types) or (isinstance(value, bool) and bool not in types):
        raise ApiError(f"'{key}' must be of type {'/'.join(t.__name__ for t in types)}", key)
    return value


def _check_model(body: dict, served: ServedModel) -> None:
    model = _field(body, "model", (str,))
    if model is not None and not served.serves(model):
        raise ApiError(f"the model '{model}' does not exist; this server serves '{served.name}'", "model",
                       status=404, code="model_not_found")


MAX_STOP_STRINGS = 16
MAX_STOP_CHARS = 1024
# fields a client may send at their neutral value only: (key, types, the neutral values)
NEUTRAL_ONLY = (("n", (int,), (1,)), ("best_of", (int,), (1,)), ("logprobs", (bool, int), (False, 0)),
                ("top_logprobs", (int,), (0,)), ("echo", (bool,), (False,)), ("suffix", (str,), ("",)),
                ("logit_bias", (dict,), ({},)), ("presence_penalty", (int, float), (0,)),
                ("frequency_penalty", (int, float), (0,)), ("response_format", (dict,), ({"type": "text"},)),
                ("parallel_tool_calls", (bool,), (True,)))


def _refuse_unsupported(body: dict) -> None:
    for key, types, neutral in NEUTRAL_ONLY:
        value = _field(body, key, types)
        if value is not None and value not in neutral:
            raise ApiError(f"'{key}' is not supported here beyond {neutral[0]!r}, got {value!r}"[:300], key)


def _tool_choice(body: dict) -> str:
    choice = body.get("tool_choice", "auto")
    if choice is None:
        return "auto"
    if choice not in ("auto", "none"):
        raise ApiError(f"'tool_choice' must be \"auto\" or \"none\" (forced tool calls are not supported), got "
                       f"{choice!r}"[:300], "tool_choice")
    return choice


def _stop_strings(body: dict) -> tuple[str, ...]:
    stop = body.get("stop")
    if stop is None:
        return ()
    stops = [stop] if isinstance(stop, str) else stop
    if not isinstance(stops, list) or not all(isinstance(s, str) for s in stops):
        raise ApiError("'stop' must be a string or a list of strings", "stop")
    if len(stops) > MAX_STOP_STRINGS or any(len(s) > MAX_STOP_CHARS for s in stops):
        raise ApiError(f"'stop' takes at most {MAX_STOP_STRINGS} strings of at most {MAX_STOP_CHARS} characters",
                       "stop")
    return tuple(s for s in stops if s)


def _stop_token_ids(body: dict, served: ServedModel) -> tuple[int, ...]:
    ids = _field(body, "stop_token_ids", (list,), [])
    if not all(isinstance(t, int) and not isinstance(t, bool) and 0 <= t < served.vocab_size for t in ids):
        raise ApiError(f"'stop_token_ids' must be token ids in [0, {served.vocab_size})", "stop_token_ids")
    return tuple(ids)


def _max_tokens(body: dict, keys: tuple[str, ...], prompt_len: int, served: ServedModel) -> int:
    if prompt_len >= served.max_model_len:
        raise ApiError(f"the prompt has {prompt_len} tokens; this model's context is {served.max_model_len} "
                       "tokens", "messages" if "max_completion_tokens" in keys else "prompt")
    room = served.max_model_len - prompt_len
    values = [(key, _field(body, key, (int,))) for key in keys]  # every key's type checked
    for key, value in values:
        if value is None:
            continue
        if value < 1:
            raise ApiError(f"'{key}' must be at least 1", key)
        if value > room:
            raise ApiError(f"{prompt_len} prompt tokens + {key}={value} exceed the context of "
                           f"{served.max_model_len} tokens", key)
        return value
    return room


def _float(body: dict, key: str, default: float) -> float:
    try:
        return float(_field(body, key, (int, float), default))
    except OverflowError:  # an integer past float's range
        raise ApiError(f"'{key}' is out of range", key) from None


def _sampling(body: dict, prompt_len: int, served: ServedModel, max_keys: tuple[str, ...]) -> SamplingParams:
    temperature = _float(body, "temperature", 1.0)
    if not (math.isfinite(temperature) and temperature >= 0):
        raise ApiError("'temperature' must be a finite number >= 0", "temperature")
    top_p = _float(body, "top_p", 1.0)
    if not 0 < top_p <= 1:  # also refuses NaN
        raise ApiError("'top_p' must lie in (0, 1]", "top_p")
    top_k = _field(body, "top_k", (int,), 0)
    if top_k < -1:
        raise ApiError("'top_k' must be >= -1 (-1 or 0: off)", "top_k")
    seed = _field(body, "seed", (int,))
    if seed is not None and not 0 <= seed < 2**63:
        raise ApiError("'seed' must lie in [0, 2**63)", "seed")
    return SamplingParams(temperature=temperature, top_k=min(max(top_k, 0), served.vocab_size), top_p=top_p, seed=seed,
                          max_tokens=_max_tokens(body, max_keys, prompt_len, served),
                          stop_token_ids=_stop_token_ids(body, served),
                          ignore_eos=_field(body, "ignore_eos", (bool,), False), stop=_stop_strings(body))


def _stream_flags(body: dict) -> tuple[bool, bool]:
    stream = _field(body, "stream", (bool,), False)
    options = _field(body, "stream_options", (dict,), {})
    return stream, bool(stream and _field(options, "include_usage", (bool,), False))


def _prompt_ids(prompt, tokenizer: QwenTokenizer, served: ServedModel) -> list[int]:
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]  # a batch of one
    if isinstance(prompt, str):
        ids = tokenizer.encode(prompt)
    elif isinstance(prompt, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        ids = prompt
    else:
        raise ApiError("'prompt' must be a string or a list of token ids (batches are not supported)", "prompt")
    if not ids:
        raise ApiError("'prompt' is empty", "prompt")
    if any(not 0 <= t < served.vocab_size for t in ids):
        raise ApiError(f"prompt token ids must lie in [0, {served.vocab_size})", "prompt")
    return ids


def parse_completion(body, tokenizer: QwenTokenizer, served: ServedModel) -> GenerationRequest:
    if not isinstance(body, dict):
        raise ApiError("the request body must be a JSON object")
    _check_model(body, served)
    _refuse_unsupported(body)
    if "prompt" not in body:
        raise ApiError("'prompt' is required", "prompt")
    ids = _prompt_ids(body["prompt"], tokenizer, served)
    stream, include_usage = _stream_flags(body)
    return GenerationRequest(ids, _sampling(body, len(ids), served, ("max_tokens",)), stream, include_usage)


def _check_tool_messages(messages: list) -> None:
    """Each tool message answers a tool call of an earlier assistant message: its `tool_call_id` names that call's
    `id`. (Messages that are not dicts are left to the template's checks.)"""
    call_ids: set = set()
    for i, message in enumerate(messages):
        if not isinstance(message, dict):
            continue
        if message.get("role") == "assistant" and isinstance(message.get("tool_calls"), list):
            call_ids.update(call.get("id") for call in message["tool_calls"] if isinstance(call, dict))
        elif message.get("role") == "tool":
            param = f"messages[{i}].tool_call_id"
            call_id = message.get("tool_call_id")
            if not isinstance(call_id, str) or not call_id:
                raise ApiError(f"'{param}' is required: a tool message answers a tool call by its id", param)
            if call_id not in call_ids:
                raise ApiError(f"'{param}' {call_id!r} matches no tool call of an earlier assistant message"[:300],
                               param)


def parse_chat(body, tokenizer: QwenTokenizer, served: ServedModel) -> GenerationRequest:
    if not isinstance(body, dict):
        raise ApiError("the request body must be a JSON object")
    _check_model(body, served)
    _refuse_unsupported(body)
    messages = _field(body, "messages", (list,))
    if not messages:
        raise ApiError("'messages' must be a non-empty list", "messages")
    tools = _field(body, "tools", (list,)) or None
    if _tool_choice(body) == "none":
        tools = None
    thinking = _field(_field(body, "chat_template_kwargs", (dict,), {}), "enable_thinking", (bool,), False)
    if tools:
        try:  # the tools alone first, so that an error in them names `tools`
            render_segments([{"role": "user", "content": ""}], tools)
        except (ValueError, KeyError, TypeError, AttributeError) as error:
            raise ApiError(f"bad tools: {error}", "tools") from None
    _check_tool_messages(messages)
    try:
        ids = tokenizer.apply_chat_template(messages, tools=tools, enable_thinking=thinking)
    except (ValueError, KeyError, TypeError, AttributeError) as error:
        raise ApiError(f"bad messages: {error}", "messages") from None
    stream, include_usage = _stream_flags(body)
    params = _sampling(body, len(ids), served, ("max_completion_tokens", "max_tokens"))
    return GenerationRequest(ids, params, stream, include_usage, tools, thinking,
                             _shared_prefix_end(tokenizer, messages, tools, thinking, ids))


def _shared_prefix_end(tokenizer: QwenTokenizer, messages: list[dict], tools, thinking: bool, ids: list[int]) -> int:
    """The tokens of the conversation's head that sessions share (its system message and tools), where the prefix
    cache should keep a snapshot; 0 when there is none. Templates refuse a conversation without a user turn, so the
    head is rendered before a stand-in one: the head ends at the last turn opening both renderings share."""
    head = messages[:1] if messages[0].get("role") == "system" else []
    if not head and not tools:
        return 0
    try:
        probe = tokenizer.apply_chat_template([*head, {"role": "user", "content": "?"}], tools=tools,
                                              enable_thinking=thinking)
    except (ValueError, KeyError, TypeError, AttributeError):
        return 0
    shared = next((i for i, (a, b) in enumerate(zip(probe, ids)) if a != b), min(len(probe), len(ids)))
    opening = tokenizer.encode_special("<|im_start|>")
    return max((i for i in range(shared) if ids[i] == opening), default=0)


# ---- text of the generated tokens ------------------------------------------------------------------------------


class MarkerSplitter:
    """Incremental search for the first of some markers in streamed text: `push` returns the text that is
    certainly before any marker (a tail that could start one is held back); once a marker is seen, `found` is
    set, and `rest` holds the text after it."""

    def __init__(self, markers: tuple[str, ...]):
        self.markers = markers
        self.text, self.sent = "", 0
        self.found: str | None = None
        self.rest = ""

    def push(self, delta: str) -> str:
        if self.found is not None:
            self.rest += delta
            return ""
        start = max(0, len(self.text) - max((len(m) for m in self.markers), default=0))
        self.text += delta
        hits = [(i, m) for m in self.markers if (i := self.text.find(m, start)) >= 0]
        if hits:
            cut, self.found = min(hits)
            self.rest = self.text[cut + len(self.found):]
            self.text = self.text[:cut]
            return self.flush()
        safe = max(self.sent, len(self.text) - self._held_back())
        out, self.sent = self.text[self.sent:safe], safe
        return out

    def flush(self) -> str:
        out, self.sent = self.text[self.sent:], len(self.text)
        return out

    def _held_back(self) -> int:
        """The longest end of the text that begins a marker (held back until the next text tells)."""
        best = 0
        for m in self.markers:
            tail = self.text[max(0, len(self.text) - len(m) + 1):] if len(m) > 1 else ""
            i = tail.find(m[0])
            while 0 <= i and len(tail) - i > best:  # from the longest candidate: the first that fits is it
                if m.startswith(tail[i:]):
                    best = len(tail) - i
                    break
                i = tail.find(m[0], i + 1)
        return best


class Detokenizer:
    """Generated tokens to text: incremental UTF-8, end-of-sequence tokens (and the request's stop token ids)
    dropped, cut at the first stop string (then `stopped` is set)."""

    def __init__(self, tokenizer: QwenTokenizer, stop: tuple[str, ...], stop_token_ids: tuple[int, ...] = ()):
        self._decoder = StreamDecoder(tokenizer)
        self._eos = set(tokenizer.eos_token_ids) | set(stop_token_ids)
        self._stops = MarkerSplitter(stop)

    @property
    def stopped(self) -> bool:
        return self._stops.found is not None

    def push(self, token: int) -> str:
        return "" if token in self._eos else self._stops.push(self._decoder.push(token))

    def flush(self) -> str:
        return self._stops.push(self._decoder.flush()) + self._stops.flush()


class ChatDeltas:
    """Streamed chat text to OpenAI deltas: reasoning before `</think>` (when thinking is on), then content,
    then, from the first `<tool_call>` (when tools were given), a buffer parsed into tool calls at the end."""

    def __init__(self, tools: list[dict] | None, enable_thinking: bool):
        self.tools = tools
        self.fields = (["reasoning_content"] if enable_thinking else []) + ["content"]
        self.tool_text: str | None = None
        self._splitter = self._next_splitter()
        self._fresh = True

    def _next_splitter(self) -> MarkerSplitter:
        if self.fields[0] == "reasoning_content":
            return MarkerSplitter(("</think>",))
        return MarkerSplitter(("<tool_call>",) if self.tools else ())

    def push(self, text: str) -> list[dict]:
        deltas = []
        while text:
            if self.tool_text is not None:
                self.tool_text += text
                break
            deltas += self._emit(self._splitter.push(text))
            if self._splitter.found is None:
                break
            text = self._splitter.rest
            self._advance()
        return deltas

    def _advance(self) -> None:
        if len(self.fields) > 1:
            self.fields.pop(0)
            self._splitter, self._fresh = self._next_splitter(), True
        else:
            self.tool_text = "<tool_call>"

    def _emit(self, text: str) -> list[dict]:
        if self._fresh:
            text = text.lstrip()
        self._fresh = self._fresh and not text
        return [{self.fields[0]: text}] if text else []

    def finish(self) -> tuple[list[dict], bool]:
        """The last deltas, and whether tool calls were made."""
        deltas = self._emit(self._splitter.flush()) if self.tool_text is None else []
        if self.tool_text is None:
            return deltas, False
        content, calls = parse_tool_calls(self.tool_text, self.tools)
        if content:
            deltas.append({"content": content})
        if calls:
            deltas.append({"tool_calls": [{"index": i, **call} for i, call in enumerate(calls)]})
        return deltas, bool(calls)


def chat_message(text: str, tools: list[dict] | None, enable_thinking: bool) -> tuple[dict, bool]:
    """The assistant message of a whole generated text, and whether it calls tools."""
    if enable_thinking and "</think>" not in text:
        reasoning, rest = text.strip() or None, ""  # thinking was cut off
    elif enable_thinking:
        reasoning, rest = split_reasoning(text)
    else:
        reasoning, rest = None, text
    content, calls = parse_tool_calls(rest, tools) if tools else (rest.strip(), [])
    message = {"role": "assistant", "content": content or (None if calls else "")}
    if reasoning is not None:
        message["reasoning_content"] = reasoning
    if calls:
        message["tool_calls"] = calls
    return message, bool(calls)


# ---- responses -------------------------------------------------------------------------------------------------


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": cached_tokens}}


@dataclass(frozen=True)
class ResponseHeader:
    """What every object of one response shares."""
    id: str
    model: str
    created: int

    @classmethod
    def new(cls, prefix: str, model: str) -> "ResponseHeader":
        return cls(f"{prefix}-{uuid.uuid4().hex}", model, int(time.time()))

    def wrap(self, kind: str, choices: list[dict], usage_: dict | None = None) -> dict:
        body = {"id": self.id, "object": kind, "created": self.created, "model": self.model, "choices": choices}
        if usage_ is not None:
            body["usage"] = usage_
        return body


def completion_choice(text: str, finish_reason: str | None) -> dict:
    return {"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason}


def chat_choice(message: dict, finish_reason: str) -> dict:
    return {"index": 0, "message": message, "logprobs": None, "finish_reason": finish_reason}


def chat_chunk_choice(delta: dict, finish_reason: str | None = None) -> dict:
    return {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason}
