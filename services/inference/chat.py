"""The ``chat`` message: a conversation rendered with the model's own template, tool calls native and constrained.

A chat request becomes an ordinary generation through one hook (``Conversations.begin``):
prompt token ids (template markup tokenized with special tokens, message contents as
plain text), the sampling parameters with a ``Constraint`` (the lazy tool-call grammar,
``tool_choice``, ``response_format``), and a ``ChatTurn`` whose ``on_text`` filters the
streamed text (content only; calls as ``tool_call`` events once complete) and whose
``reply`` turns the finished generation into the assistant message.

Session KV reuse across turns: the engine reuses a session's longest common token
prefix, so turn N+1 must start with turn N's tokens. Templates do not always render
a reply the way the model wrote it (a bare-JSON call comes back as ``<tool_call>``
tags, some templates trim), so the last turn of each session is remembered: when the
next request carries that reply back unchanged, its prompt is turn N's prompt tokens,
the reply's own tokens, the end-of-turn markup, then the new messages as the template
renders them.
"""

from __future__ import annotations

import json
import re
import secrets
import weakref
from array import array
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Callable

import llama_cpp

from services.inference.chat_template import ChatTemplate, Segment, TemplateError
from services.inference.constraint import Constraint, check_schema, vocabulary
from services.inference.engine import Engine
from services.inference.tool_calls import (OPEN, Tool, ToolCall, answer_or_calls_grammar, scan, tagged_grammar,
                                           tool_table, triggers)
from shared.protocol import ErrorCode, ProtocolError

ROLES = ("system", "user", "assistant", "tool")
MAX_MESSAGES = 4096
#: Sessions whose last turn is remembered for byte-identical continuation (least recently used beyond).
MAX_REMEMBERED_SESSIONS = 1024
_PROBE = "\ue000reply\ue001"


def _bad(message: str) -> ProtocolError:
    return ProtocolError(ErrorCode.BAD_REQUEST, message)


# --- the request, checked ---------------------------------------------------------------
def _text(content: Any, where: str) -> str:
    """A message content as text: a string, null, or OpenAI's list of text parts."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list) and all(isinstance(p, dict) and p.get("type") == "text"
                                         and isinstance(p.get("text"), str) for p in content):
        return "".join(p["text"] for p in content)
    raise _bad(f"{where}.content must be a string, null or a list of text parts")


def _arguments(value: Any) -> Any:
    """Tool-call arguments as the templates expect them: an object (OpenAI sends a JSON string)."""
    if isinstance(value, str):
        try:
            return json.loads(value)
        except ValueError:
            return value
    return value


def _messages(raw: Any) -> list[dict]:
    if not isinstance(raw, list) or not 0 < len(raw) <= MAX_MESSAGES:
        raise _bad(f"messages must be a list of 1..{MAX_MESSAGES} messages")
    out = []
    for i, m in enumerate(raw):
        where = f"messages[{i}]"
        if not isinstance(m, dict) or m.get("role") not in ROLES:
            raise _bad(f"{where} must be a map whose role is one of {', '.join(ROLES)}")
        msg = {"role": m["role"], "content": _text(m.get("content"), where)}
        for key in ("name", "tool_call_id"):
            if m.get(key) is not None:
                if not isinstance(m[key], str):
                    raise _bad(f"{where}.{key} must be a string")
                msg[key] = m[key]
        calls = m.get("tool_calls")
        if calls:
            if m["role"] != "assistant" or not isinstance(calls, list):
                raise _bad(f"{where}.tool_calls: only an assistant message has them, as a list")
            msg["tool_calls"] = []
            for j, call in enumerate(calls):
                fn = call.get("function") if isinstance(call, dict) else None
                if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
                    raise _bad(f"{where}.tool_calls[{j}] must be {{id, type: function, function: {{name, arguments}}}}")
                msg["tool_calls"].append({"id": str(call.get("id") or f"call_{j}"), "type": "function",
                                          "function": {"name": fn["name"],
                                                       "arguments": _arguments(fn.get("arguments", {}))}})
        out.append(msg)
    return out


def _message_key(m: dict) -> tuple:
    """What makes two messages render the same (call ids aside)."""
    calls = tuple((c["function"]["name"], json.dumps(c["function"]["arguments"], sort_keys=True))
                  for c in m.get("tool_calls", ()))
    return m["role"], m["content"] or "", calls, m.get("name"), m.get("tool_call_id")


def _tool_choice(choice: Any, tools: dict[str, Tool]) -> tuple[str, str | None]:
    """("auto" | "none" | "required" | "named", the named tool)."""
    if choice is None:
        return ("auto" if tools else "none"), None
    if choice in ("auto", "none", "required"):
        if choice != "none" and not tools:
            raise _bad(f"tool_choice {choice!r} needs tools")
        return choice, None
    name = choice.get("function", {}).get("name") if isinstance(choice, dict) else None
    if not isinstance(name, str) or name not in tools:
        raise _bad('tool_choice must be "auto", "none", "required" or {type: function, function: {name}} '
                   "naming one of the tools")
    return "named", name


def _response_schema(fmt: Any) -> dict | None:
    if fmt is None:
        return None
    kind = fmt.get("type") if isinstance(fmt, dict) else None
    if kind == "text":
        return None
    if kind == "json_object":
        return {"type": "object"}
    if kind == "json_schema":
        spec = fmt.get("json_schema")
        schema = spec.get("schema") if isinstance(spec, dict) else None
        check_schema(schema, "response_format.json_schema.schema")
        return schema
    raise _bad('response_format must be {type: "text" | "json_object" | "json_schema", json_schema?: {name, schema}}')


# --- the model's side -----------------------------------------------------------------------
class ChatModel:
    """What chat needs of one model: its template, its tokenizer both ways, where an assistant turn ends."""

    def __init__(self, engine: Engine):
        self.model = weakref.proxy(engine.model)  # this object is cached under the model: no strong reference back
        meta = engine.model.metadata()
        source = meta.get("tokenizer.chat_template")
        if not source:
            raise _bad(f"model {engine.model_name!r} has no chat template (tokenizer.chat_template): it is a base "
                       f"model; use generate, or an instruct model (magnitude models list)")
        vocab = engine.model.vocab
        self.add_bos = bool(llama_cpp.llama_vocab_get_add_bos(vocab))
        self.bos = llama_cpp.llama_vocab_bos(vocab)
        self.template = ChatTemplate(source, self._piece(self.bos), self._piece(llama_cpp.llama_vocab_eos(vocab)))
        self._controls = self._control_tokens()
        self._control_re = re.compile("|".join(re.escape(t) for t in sorted(self._controls, key=len, reverse=True))
                                      or "(?!)")
        self.end_of_turn = self._end_of_turn()

    def _piece(self, token: int) -> str:
        if token < 0:
            return ""
        buf = bytes(256)
        n = llama_cpp.llama_token_to_piece(self.model.vocab, token, buf, len(buf), 0, True)
        return buf[:max(n, 0)].decode("utf-8", "replace")

    def _end_of_turn(self) -> str | None:
        """The markup a template puts after an assistant message's content (Qwen: ``<|im_end|>\\n``)."""
        try:
            text = self.template.render_text([{"role": "user", "content": "hi"},
                                              {"role": "assistant", "content": _PROBE}], None, False)
        except TemplateError:
            return None
        return text.split(_PROBE, 1)[1] if _PROBE in text else None

    def is_eog(self, token: int) -> bool:
        return bool(llama_cpp.llama_vocab_is_eog(self.model.vocab, token))

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


_chat_models: "weakref.WeakKeyDictionary[Any, ChatModel]" = weakref.WeakKeyDictionary()


def chat_model(engine: Engine) -> ChatModel:
    cm = _chat_models.get(engine.model)
    if cm is None:
        cm = _chat_models[engine.model] = ChatModel(engine)
    return cm


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


# --- sessions: the last turn, for byte-identical continuation -------------------------------
@dataclass
class _LastTurn:
    model: str
    tools: str  # the tools as rendered (JSON), so a changed tool list never splices
    messages: list[tuple]  # message keys of the request
    reply: tuple  # key of the assistant message returned
    prompt_text: str
    prompt_tokens: array
    reply_text: str
    reply_tokens: array


# --- one chat request ---------------------------------------------------------------------
class ChatTurn:
    """One chat generation: its prompt, its streaming filter and the assistant message at the end."""

    def __init__(self, conversations: "Conversations", session: str | None, model_name: str, cm: ChatModel,
                 prompt: list[int], constraint: Constraint, request: dict, tools: dict[str, Tool],
                 parse_calls: bool, emit: Callable[[dict], None] | None):
        self._conversations, self._session, self._model_name, self._cm = conversations, session, model_name, cm
        self.prompt = prompt
        self.constraint = constraint  # also the record of the tokens sampled (the reply's own, for the session)
        self._request = request  # what the session remembers of this turn's request (see _LastTurn)
        self._tools, self._parse_calls, self._emit = tools, parse_calls, emit
        self._text = ""
        self._streamed = ""  # content sent as text events
        self._ids: list[str] = []  # ids of the calls sent as tool_call events
        self._content = ""

    def on_text(self, piece: str) -> None:
        """The engine's text callback: stream content and finished calls, never call markup."""
        self._text += piece
        self._flush(final=False)

    def _flush(self, final: bool) -> list[ToolCall]:
        if self._parse_calls:
            found = scan(self._text, self._tools, final)
            content, calls = found.content, found.calls
        else:
            content, calls = self._text, []
        if self._emit is not None:
            if content.startswith(self._streamed) and len(content) > len(self._streamed):
                self._emit({"text": content[len(self._streamed):]})
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

    def reply(self, result: dict) -> dict:
        """The ok body: the assistant message, finish_reason, and the generation's stats."""
        text = self._text = result["text"]
        calls = self._flush(final=True)
        while len(self._ids) < len(calls):
            self._ids.append(f"call_{secrets.token_hex(12)}")
        wire_calls = [call.wire(call_id) for call, call_id in zip(calls, self._ids)]
        message = {"role": "assistant", "content": self._content or (None if calls else ""),
                   "tool_calls": wire_calls}
        finish = "tool_calls" if calls else "length" if result["stop_reason"] == "length" else "stop"
        if self._session is not None and result["stop_reason"] in ("eos", "length"):
            tokens = self.constraint.tokens
            reply_tokens = tokens[:-1] if tokens and self._cm.is_eog(tokens[-1]) else tokens
            self._conversations.remember(self._session, _LastTurn(
                model=self._model_name, reply=_message_key({**message, "content": message["content"] or "",
                                                             "tool_calls": [_parsed_call(c) for c in wire_calls]}),
                reply_text=text, reply_tokens=array("i", reply_tokens), **self._request))
        stats = {k: v for k, v in result.items() if k != "text"}
        return {"message": message, "finish_reason": finish, **stats}


def _parsed_call(call: dict) -> dict:
    return {"function": {"name": call["function"]["name"], "arguments": _arguments(call["function"]["arguments"])}}


class Conversations:
    """The service's chat front end: builds each chat turn, remembers each session's last one."""

    def __init__(self, max_sessions: int = MAX_REMEMBERED_SESSIONS):
        self._last: OrderedDict[str, _LastTurn] = OrderedDict()
        self._max = max_sessions

    def remember(self, session: str, turn: _LastTurn) -> None:
        self._last[session] = turn
        self._last.move_to_end(session)
        while len(self._last) > self._max:
            self._last.popitem(last=False)

    def forget(self, session: str) -> None:
        self._last.pop(session, None)

    def begin(self, body: dict, session: str | None, engine: Engine, model_name: str,
              emit: Callable[[dict], None] | None) -> ChatTurn:
        """The hook: a chat request as prompt tokens and a constraint, in the turn that finishes it."""
        messages = _messages(body.get("messages"))
        tools = tool_table(body["tools"]) if body.get("tools") else {}
        choice, named = _tool_choice(body.get("tool_choice"), tools)
        schema = _response_schema(body.get("response_format"))
        cm = chat_model(engine)
        wire_tools = [{"type": "function", "function": {k: v for k, v in t.items() if k in
                                                        ("name", "description", "parameters")}}
                      for t in (x["function"] for x in body.get("tools") or [])]
        for i, tool in enumerate(wire_tools):
            if cm.has_special_text(json.dumps(tool, ensure_ascii=False)):
                raise _bad(f"tools[{i}] holds the spelling of one of the model's control tokens")
        for i, m in enumerate(messages):
            for call in m.get("tool_calls", ()):
                if cm.has_special_text(json.dumps(call["function"], ensure_ascii=False)):
                    raise _bad(f"messages[{i}].tool_calls holds the spelling of one of the model's control tokens")
        shown = messages if cm.template.renders_tools else _without_tool_roles(messages, wire_tools)
        shown_tools = wire_tools if cm.template.renders_tools else None
        segments, mapped = cm.template.render(shown, shown_tools)
        if not mapped and any(cm.has_special_text(m["content"]) for m in shown):
            raise _bad("this model's chat template rewrites message contents, so contents holding control-token "
                       "text cannot be kept apart from its markup")
        prompt_text = "".join(s.text for s in segments)
        tools_key = json.dumps(wire_tools, sort_keys=True)
        keys = [_message_key(m) for m in messages]
        prompt = None
        last = self._last.get(session) if session is not None else None
        if last is not None and last.model == model_name and last.tools == tools_key:
            prompt = self._continuation(last, keys, shown, shown_tools, cm, segments, prompt_text)
        if prompt is None:
            prompt = cm.tokenize(segments)
        constraint = self._constraint(engine, tools, choice, named, schema)
        request = {"tools": tools_key, "messages": keys, "prompt_text": prompt_text,
                   "prompt_tokens": array("i", prompt)}
        return ChatTurn(self, session, model_name, cm, prompt, constraint, request, tools,
                        choice != "none" and bool(tools), emit)

    @staticmethod
    def _continuation(last: _LastTurn, keys: list[tuple], shown: list[dict], shown_tools: list | None,
                      cm: ChatModel, segments: list[Segment], prompt_text: str) -> list[int] | None:
        """Turn N's tokens + its reply's tokens + the new messages, when the request continues turn N unchanged."""
        k = len(last.messages)
        if len(keys) <= k or keys[:k] != last.messages or keys[k] != last.reply or len(shown) != len(keys):
            return None
        head = cm.template.render_text(shown[:k + 1], shown_tools, add_generation_prompt=False)
        if not (head.startswith(last.prompt_text) and prompt_text.startswith(head)):
            return None
        as_rendered = head[len(last.prompt_text):]
        if as_rendered.startswith(last.reply_text):
            end_of_turn = as_rendered[len(last.reply_text):]
        elif cm.end_of_turn is not None:
            end_of_turn = cm.end_of_turn
        else:
            return None
        rest, offset = [], 0
        for seg in segments:  # the segments after ``head``
            if offset + len(seg.text) > len(head):
                cut = max(len(head) - offset, 0)
                rest.append(Segment(seg.text[cut:], seg.content))
            offset += len(seg.text)
        tail = cm.tokenize([Segment(end_of_turn, False)] + rest, start=False)
        return list(last.prompt_tokens) + list(last.reply_tokens) + tail

    @staticmethod
    def _constraint(engine: Engine, tools: dict[str, Tool], choice: str, named: str | None,
                    schema: dict | None) -> Constraint:
        """What the reply may be; with no rule at all, a constraint that allows everything and records the tokens."""
        vocab = vocabulary(engine.model)
        if choice in ("required", "named"):
            only = {named: tools[named]} if named else tools
            return Constraint(vocab, tagged_grammar(only, vocab, single=named is not None))
        if schema is not None:
            return Constraint(vocab, answer_or_calls_grammar(schema, tools if choice == "auto" else None, vocab))
        if choice == "auto":
            return Constraint(vocab, triggers=triggers(tools, vocab))
        opener = vocab.single_special(OPEN) if tools else None  # "none": the opener cannot be written
        return Constraint(vocab, banned=[] if opener is None else [opener])
