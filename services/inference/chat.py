"""The ``chat`` message: a conversation rendered with the model's own template, tool calls native and constrained.

A chat request becomes an ordinary generation through ``prepare_turn`` (run by the preparing workers,
``prepare.py``): prompt token ids (template markup tokenized with special tokens, message contents as plain
text), a ``Constraint`` (the lazy tool-call grammar, ``tool_choice``, ``response_format``), and a ``ChatTurn``
whose ``on_text`` filters the streamed text (content only; calls as ``tool_call`` events once complete) and whose
``reply`` turns the finished generation into the assistant message.

**Session KV reuse never changes an answer.** Every turn's prompt is the template's own rendering of the
messages, exactly as for a request without a session; the scheduler then reuses the longest common token prefix
of the session's KV (as llama-server does). Where the model's reply, as sampled, differs from how the template
renders it back (a fenced JSON call comes back inside ``<tool_call>`` tags), the common prefix ends there and
only the tokens after it are read again: the model always reads the history its template would show it.
"""

from __future__ import annotations

import json
import re
import secrets
from typing import Any, Callable

import llama_cpp
import msgspec
from llama_cpp import _internals

from services.inference.chat_template import ChatTemplate, Segment
from services.inference.constraint import Constraint, Vocabulary, check_schema
from services.inference.tool_calls import (OPEN, ParsedCall, Tool, answer_or_calls_grammar, checked_tool, scan,
                                           tagged_grammar, tool_table, triggers)
from shared import protocol
from shared.protocol import bad_request, finish_reason, unsent_text



# --- the request, as the template takes it -------------------------------------------------
# ``shared.protocol`` validated the body's shape and bounds as it decoded it (``ChatRequest``); what is left here
# is what depends on more than one field or on the model.
def _text(content: str | list[protocol.TextPart] | None) -> str:
    """A message content as text: a string, null, or OpenAI's list of text parts."""
    if isinstance(content, list):
        return "".join(p.text for p in content)
    return content or ""


def _arguments(value: str) -> Any:
    """Tool-call arguments as the templates expect them: an object (OpenAI sends a JSON string)."""
    try:
        return json.loads(value)
    except ValueError:
        return value


def _messages(raw: list[protocol.Message]) -> list[dict]:
    """The messages as the template reads them."""
    out = []
    for i, m in enumerate(raw):
        msg: dict[str, Any] = {"role": m.role, "content": _text(m.content)}
        if m.name is not None:
            msg["name"] = m.name
        if m.tool_call_id is not None:
            msg["tool_call_id"] = m.tool_call_id
        if m.tool_calls:
            if m.role != "assistant":
                raise bad_request(f"messages[{i}].tool_calls: only an assistant message has them")
            msg["tool_calls"] = [{"id": call.id or f"call_{j}", "type": "function",
                                  "function": {"name": call.function.name,
                                               "arguments": _arguments(call.function.arguments)}}
                                 for j, call in enumerate(m.tool_calls)]
        out.append(msg)
    return out


def _tool_choice(choice: str | protocol.NamedToolChoice | None, tools: dict[str, Tool]) -> tuple[str, Tool | None]:
    """("auto" | "none" | "required" | "named", the named tool, under the narrower parameters it is named with)."""
    if choice is None:
        return ("auto" if tools else "none"), None
    if isinstance(choice, str):
        if choice != "none" and not tools:
            raise bad_request(f"tool_choice {choice!r} needs tools")
        return choice, None
    name, narrower = choice.function.name, choice.function.parameters
    if name not in tools:
        raise bad_request(f"tool_choice names {name!r}, which is none of the tools")
    if narrower is None:
        return "named", tools[name]
    return "named", checked_tool(name, narrower, "tool_choice.function.parameters")


def _response_schema(fmt: protocol.ResponseFormat | None) -> dict | None:
    if fmt is None or fmt.type == "text":
        return None
    if fmt.type == "json_object":
        return {"type": "object"}
    schema = fmt.json_schema.schema if fmt.json_schema is not None else None
    check_schema(schema, "response_format.json_schema.schema")
    return schema


def _template_tools(tools: list[protocol.Tool]) -> list[dict]:
    """The tools as a template shows them: name, description, parameters."""
    return [{"type": "function", "function": {k: v for k, v in msgspec.to_builtins(t.function).items()
                                              if k != "strict"}} for t in tools]


# --- the model's side -----------------------------------------------------------------------
class ChatModel:
    """What chat needs of one model: its template, its tokenizer both ways, where an assistant turn ends."""

    def __init__(self, model: _internals.LlamaModel, name: str):
        self.model = model
        source = model.metadata().get("tokenizer.chat_template")
        if not source:
            raise bad_request(f"model {name!r} has no chat template (tokenizer.chat_template): it is a base "
                       f"model; use generate, or an instruct model (magnitude models list)")
        vocab = model.vocab
        self.add_bos = bool(llama_cpp.llama_vocab_get_add_bos(vocab))
        self.bos = llama_cpp.llama_vocab_bos(vocab)
        self.template = ChatTemplate(source, self._piece(self.bos), self._piece(llama_cpp.llama_vocab_eos(vocab)))
        self._controls = self._control_tokens()
        self._control_re = re.compile("|".join(re.escape(t) for t in sorted(self._controls, key=len, reverse=True))
                                      or "(?!)")

    def _piece(self, token: int) -> str:
        if token < 0:
            return ""
        buf = bytes(256)
        n = llama_cpp.llama_token_to_piece(self.model.vocab, token, buf, len(buf), 0, True)
        return buf[:max(n, 0)].decode("utf-8", "replace")

    def _control_tokens(self) -> dict[str, int]:
        """The spelling of every token that only markup may produce (what ``special=True`` parses)."""
        vocab, kinds = self.model.vocab, llama_cpp.LLAMA_TOKEN_ATTR_CONTROL | llama_cpp.LLAMA_TOKEN_ATTR_UNKNOWN
        return {text: t for t in range(self.model.n_vocab()) if llama_cpp.llama_vocab_get_attr(vocab, t) & kinds
                and (text := llama_cpp.llama_vocab_get_text(vocab, t).decode("utf-8", "replace"))}

    def tokenize(self, segments: list[Segment], start: bool = True) -> list[int]:
        """Control tokens only where the markup spells them; everything between them, markup and contents alike,
        tokenized as one text, as llama.cpp tokenizes the fragments between special tokens (so a prompt is the
        tokens the model was trained on, and a content can never spell a control token). BOS first when the
        model wants one and the template did not write it (``start`` False: a continuation, no BOS)."""
        tokens: list[int] = []
        text = ""
        for seg in segments:
            if seg.content:
                text += seg.text
                continue
            pos = 0
            for match in self._control_re.finditer(seg.text):
                text += seg.text[pos:match.start()]
                tokens += self._plain(text)
                tokens.append(self._controls[match.group()])
                text, pos = "", match.end()
            text += seg.text[pos:]
        tokens += self._plain(text)
        if start and self.add_bos and (not tokens or tokens[0] != self.bos):
            tokens.insert(0, self.bos)
        return tokens

    def _plain(self, text: str) -> list[int]:
        return self.model.tokenize(text.encode(), add_bos=False, special=False) if text else []

    def has_special_text(self, text: str) -> bool:
        """Whether ``text`` holds the spelling of a control token (it would turn into markup if parsed)."""
        return self._control_re.search(text) is not None


def _tools_prompt(tools: list[dict]) -> str:
    """Tool instructions for a template that has none, in the tagged format the parser and grammar know."""
    listing = "\n".join(json.dumps(t, ensure_ascii=False) for t in tools)
    return ("You can call tools. Their signatures (JSON schema) are within <tools></tools>:\n<tools>\n"
            f"{listing}\n</tools>\nTo call a tool, reply with only:\n{OPEN}\n"
            '{"name": <tool name>, "arguments": <arguments object>}\n</tool_call>')


def _without_tool_roles(messages: list[dict], tools: list[dict] | None) -> list[dict]:
    """For templates that know no tools: the tools in the system message, calls and results as plain turns."""
    out = []
    for m in messages:
        if m["role"] == "tool":
            m = {"role": "user", "content": f"<tool_response>\n{m['content']}\n</tool_response>"}
        elif m.get("tool_calls"):
            calls = "\n".join(f"{OPEN}\n" + json.dumps({"name": c["function"]["name"],
                                                        "arguments": c["function"]["arguments"]},
                                                       ensure_ascii=False) + "\n</tool_call>"
                              for c in m["tool_calls"])
            m = {"role": "assistant", "content": "\n".join(p for p in (m["content"], calls) if p)}
        out.append(m)
    if tools:
        if out[0]["role"] == "system":
            out[0] = {**out[0], "content": out[0]["content"] + "\n\n" + _tools_prompt(tools)}
        else:
            out.insert(0, {"role": "system", "content": _tools_prompt(tools)})
    return out


# --- one chat request ---------------------------------------------------------------------
class ChatTurn:
    """One chat generation: its prompt, its streaming filter and the assistant message at the end."""

    def __init__(self, prompt: list[int], constraint: Constraint, tools: dict[str, Tool], parse_calls: bool,
                 emit: Callable[[dict], None] | None):
        self.prompt = prompt
        self.constraint = constraint
        self._tools, self._parse_calls, self._emit = tools, parse_calls, emit
        self._text = ""
        self._streamed = ""  # content sent as text events
        self._ids: list[str] = []  # ids of the calls sent as tool_call events
        self._content = ""

    def on_text(self, piece: str) -> None:
        """The engine's text callback: stream content and finished calls, never call markup."""
        self._text += piece
        self._flush(final=False)

    def _flush(self, final: bool) -> list[ParsedCall]:
        if self._parse_calls:
            found = scan(self._text, self._tools, final)
            content, calls = found.content, found.calls
        else:
            content, calls = self._text, []
        if self._emit is not None:
            if unsent := unsent_text(content, self._streamed):
                self._emit({"text": unsent})
                self._streamed = content
            for index in range(len(self._ids), len(calls)):
                self._ids.append(f"call_{secrets.token_hex(12)}")
                event = {"index": index, "id": self._ids[index], "name": calls[index].name,
                         "arguments": calls[index].arguments}
                if calls[index].error:
                    event["error"] = calls[index].error
                self._emit({"tool_call": event})
        self._content = content
        return calls

    def reply(self, result: protocol.GenerateResult) -> protocol.ChatResult:
        """The ok body: the assistant message, finish_reason, and the generation's stats."""
        self._text = result.text
        calls = self._flush(final=True)
        while len(self._ids) < len(calls):
            self._ids.append(f"call_{secrets.token_hex(12)}")
        message = protocol.AssistantMessage(content=self._content or (None if calls else ""),
                                            tool_calls=[call.wire(call_id) for call, call_id in zip(calls, self._ids)])
        return protocol.ChatResult(message=message, finish_reason=finish_reason(result.stats.stop_reason, bool(calls)),
                                   stats=result.stats)


def prepare_turn(body: protocol.ChatRequest, cm: ChatModel, vocab: Vocabulary,
                 emit: Callable[[dict], None] | None) -> ChatTurn:
    """A chat request (as decoded, its messages inline) as prompt tokens and a constraint, in the turn that
    finishes it."""
    messages = _messages(body.messages or [])
    tools = tool_table(body.tools) if body.tools else {}
    choice, named = _tool_choice(body.tool_choice, tools)
    schema = _response_schema(body.response_format)
    wire_tools = _template_tools(body.tools or [])
    for i, tool in enumerate(wire_tools):
        if cm.has_special_text(json.dumps(tool, ensure_ascii=False)):
            raise bad_request(f"tools[{i}] holds the spelling of one of the model's control tokens")
    for i, m in enumerate(messages):
        for call in m.get("tool_calls", ()):
            if cm.has_special_text(json.dumps(call["function"], ensure_ascii=False)):
                raise bad_request(f"messages[{i}].tool_calls holds the spelling of one of the model's control tokens")
    shown = messages if cm.template.renders_tools else _without_tool_roles(messages, wire_tools)
    segments, mapped = cm.template.render(shown, wire_tools if cm.template.renders_tools else None)
    if not mapped and any(cm.has_special_text(m["content"]) for m in shown):
        raise bad_request("this model's chat template rewrites message contents, so contents holding control-token "
                   "text cannot be kept apart from its markup")
    return ChatTurn(cm.tokenize(segments), _constraint(vocab, tools, choice, named, schema), tools,
                    choice != "none" and bool(tools), emit)


def _constraint(vocab: Vocabulary, tools: dict[str, Tool], choice: str, named: Tool | None,
                schema: dict | None) -> Constraint:
    """What the reply may be; with no rule at all, a constraint that allows everything and records the tokens."""
    if choice in ("required", "named"):
        only = {named.name: named} if named else tools
        return Constraint(vocab, tagged_grammar(only, vocab, single=named is not None))
    if schema is not None:
        return Constraint(vocab, answer_or_calls_grammar(schema, tools if choice == "auto" else None, vocab))
    if choice == "auto":
        return Constraint(vocab, triggers=triggers(tools, vocab))
    opener = vocab.single_special(OPEN) if tools else None  # "none": the opener cannot be written
    return Constraint(vocab, banned=[] if opener is None else [opener])
