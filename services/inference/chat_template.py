"""Render a conversation with the model's own chat template, keeping message contents apart from markup.

The template is the GGUF's ``tokenizer.chat_template``: Jinja, rendered the way
Hugging Face transformers and ``llama-server --jinja`` do (sandboxed, ``trim_blocks``
and ``lstrip_blocks``, their ``tojson``, ``raise_exception``, ``strftime_now`` and the
``{% generation %}`` tag), so any GGUF that carries a template works.

Message contents are data, never markup: a tool output holding ``<|im_end|>`` must
not end a turn. So the output is a list of segments, template text (tokenized with
special tokens parsed) and content text (tokenized as plain text). To find the
contents in the rendered text, the template is rendered a second time with each
content replaced by a sentinel, and the two renders are walked side by side; a
content the template transformed (``| trim``, a reasoning part dropped) is the text
between the template text around it.

A GGUF's template is code from whoever made the file. Jinja's immutable sandbox
keeps it from Python's internals (the CVE-2024-34359 escape through
``__class__.__subclasses__``); ``_Sandbox`` also bounds what it may compute, so
``9 ** 99999999``, ``'a' * 10**10`` or nested ``range(100000)`` loops are a
refused template, not a stalled or exhausted inference process.
"""

from __future__ import annotations

import functools
import json
import re
import secrets
from dataclasses import dataclass
from datetime import datetime
from typing import Any

import jinja2
from jinja2.ext import Extension, loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment, SecurityError

#: The most bits a number may get from ``*`` or ``**``, and characters or items a repeated sequence may have.
_MAX_BITS = 4096
_MAX_REPEAT = 1 << 20
#: Items all the ``range`` calls of one render may produce together.
_RANGE_BUDGET = 100_000


class TemplateError(ValueError):
    """The template cannot render this conversation (its own raise_exception, or a Jinja error)."""


@dataclass(frozen=True)
class Segment:
    text: str
    content: bool  # True: a message content, tokenized as plain text; False: template markup


class _GenerationTag(Extension):
    """``{% generation %}...{% endgeneration %}`` (transformers marks assistant text with it): render the body."""

    tags = {"generation"}

    def parse(self, parser):
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.Scope(body, lineno=lineno)


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None, separators=None,
            sort_keys: bool = False) -> str:
    """transformers' tojson: plain json.dumps (Jinja's own escapes <, > and & for HTML and sorts keys)."""
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _raise_exception(message: str) -> None:
    raise TemplateError(f"the chat template refused the conversation: {message}")


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


class _Sandbox(ImmutableSandboxedEnvironment):
    """The immutable sandbox with bounded ``*`` and ``**`` (intercepted operators are not folded at compile
    time either, where Jinja would compute a constant ``9 ** 99999999`` while compiling)."""

    intercepted_binops = frozenset({"*", "**"})

    def call_binop(self, context, operator: str, left: Any, right: Any) -> Any:
        if isinstance(left, int) and isinstance(right, int):
            bits = right * abs(left).bit_length() if operator == "**" and abs(left) > 1 else \
                left.bit_length() + right.bit_length() if operator == "*" else 0
            if bits > _MAX_BITS:
                raise SecurityError(f"the template computes a number over {_MAX_BITS} bits")
        elif operator == "*":
            sequence, times = (left, right) if isinstance(right, int) else (right, left)
            if isinstance(sequence, (str, list, tuple)) and isinstance(times, int) and len(sequence) * times > _MAX_REPEAT:
                raise SecurityError(f"the template builds a sequence over {_MAX_REPEAT} characters or items")
        return super().call_binop(context, operator, left, right)


def _budgeted_range(budget: int):
    """``range`` for one render: all its ranges together yield at most ``budget`` items."""
    left = budget

    def bounded(*args: int) -> range:
        nonlocal left
        numbers = range(*args)
        left -= len(numbers)
        if left < 0:
            raise SecurityError(f"the template's ranges go over {budget} items in one render")
        return numbers
    return bounded


@functools.lru_cache(maxsize=16)
def _compile(source: str) -> jinja2.Template:
    env = _Sandbox(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols, _GenerationTag])
    env.filters["tojson"] = _tojson
    env.globals.update(raise_exception=_raise_exception, strftime_now=_strftime_now)
    try:
        return env.from_string(source)
    except jinja2.TemplateError as err:
        raise TemplateError(f"the model's chat template does not compile: {err}") from None


class _Unmappable(Exception):
    """The sentinel render does not line up with the real one."""


class ChatTemplate:
    def __init__(self, source: str, bos_token: str = "", eos_token: str = ""):
        self.source = source
        self._template = _compile(source)
        self._specials = {"bos_token": bos_token, "eos_token": eos_token}

    @property
    def renders_tools(self) -> bool:
        """Whether the template itself presents tool definitions (else the caller describes them)."""
        return "tools" in self.source

    def render_text(self, messages: list[dict], tools: list[dict] | None = None,
                    add_generation_prompt: bool = True) -> str:
        try:
            return self._template.render(messages=messages, tools=tools or None, range=_budgeted_range(_RANGE_BUDGET),
                                         add_generation_prompt=add_generation_prompt, **self._specials)
        except TemplateError:
            raise
        except Exception as err:  # Jinja errors, and a template's own TypeErrors on odd input
            raise TemplateError(f"the chat template failed on this conversation: {type(err).__name__}: {err}") \
                from None

    def render(self, messages: list[dict], tools: list[dict] | None = None,
               add_generation_prompt: bool = True) -> tuple[list[Segment], bool]:
        """The prompt as segments, and whether every content could be told apart from the markup.

        When it could not (a template that rewrites contents beyond recognition), the whole render is one
        markup segment; the caller must then make sure no content carries special-token text."""
        full = self.render_text(messages, tools, add_generation_prompt)
        nonce = str(secrets.randbelow(10**12))  # digits: case changes and trims leave the sentinels intact
        contents: dict[str, str] = {}
        marked_messages = []
        for message in messages:
            content = message.get("content")
            if isinstance(content, str) and content:
                key = f"{nonce}:{len(contents)}"
                contents[key] = content
                message = {**message, "content": f"\ue000{key}\ue001"}
            marked_messages.append(message)
        if not contents:
            return ([Segment(full, False)] if full else []), True
        marked = self.render_text(marked_messages, tools, add_generation_prompt)
        try:
            return _split(full, marked, contents, nonce), True
        except _Unmappable:
            return [Segment(full, False)], False


def _split(full: str, marked: str, contents: dict[str, str], nonce: str) -> list[Segment]:
    """Walk the real render along the sentinel render: literals must match, contents fill the gaps."""
    pieces = re.split(f"\ue000({re.escape(nonce)}:\\d+)\ue001", marked)  # literal, key, literal, key, ..., literal
    segments: list[Segment] = []
    pos = 0
    for j in range(0, len(pieces), 2):
        literal = pieces[j]
        if not full.startswith(literal, pos):
            raise _Unmappable
        if literal:
            segments.append(Segment(literal, False))
            pos += len(literal)
        if j + 1 == len(pieces):
            break
        end = _content_end(full, pos, contents[pieces[j + 1]], pieces[j + 2], last=j + 3 == len(pieces))
        if end > pos:
            segments.append(Segment(full[pos:end], True))
        pos = end
    if pos != len(full):
        raise _Unmappable
    return segments


def _content_end(full: str, pos: int, content: str, following: str, last: bool) -> int:
    """Where the content that starts at ``pos`` ends in the real render."""
    for candidate in (content, content.strip(), content.lstrip(), content.rstrip()):  # as is, or trimmed
        end = pos + len(candidate)
        if full.startswith(candidate, pos) and (full[end:] == following if last else full.startswith(following, end)):
            return end
    # Transformed otherwise (e.g. a reasoning part dropped): the content runs until the template text resumes.
    if last:
        end = len(full) - len(following)
        if end >= pos and full.endswith(following):
            return end
        raise _Unmappable
    if not following:
        raise _Unmappable
    end = full.find(following, pos)
    if end < 0:
        raise _Unmappable
    return end
