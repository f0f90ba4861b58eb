"""Preparing a request for the scheduler, off the decode thread.

llama.cpp's server applies the chat template, tokenizes and builds the grammar in its HTTP threads, before a
task is queued; its decode loop only decodes. Here the inference service's preparing workers do the same: a
``generate`` or ``chat`` request becomes a ``GenerationRequest`` *value* (prompt token ids, sampling parameters,
a compiled constraint, the model's name, its owner and session), and only that reaches the scheduler. So a slow
or hostile request (a long template, a deep grammar, a big schema) costs a preparing worker's time, never a
decode step of the other generations.

Preparation needs a model's tokenizer and chat template, not its weights: each model file is opened a second
time with ``vocab_only`` (a ``Lexicon``: a fraction of a second and a few MB), so a request naming a model that
is not resident is prepared without loading it, and a file llama.cpp cannot read fails that request here.
The token ids are the engine's: same file, same tokenizer.
"""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Callable

import msgspec
from llama_cpp import _internals

from shared import shm
from shared.config import Config
from shared.protocol import (ChatRequest, ChatResult, ErrorCode, GenerateRequest, GenerateResult, ProtocolError, Request,
                             decode_messages)
from services.inference.chat import ChatModel, ChatTurn, prepare_turn
from services.inference.constraint import Constraint, LlamaGrammar, Vocabulary, gbnf_constraint, vocabulary
from services.inference.engine import init_backend
from services.inference.handover import Outlet
from services.inference.models import ModelPool
from services.inference.scheduler import GenerateParams, GenerationRequest


class Lexicon:
    """One model file's tokenizer, chat template and llguidance vocabulary, loaded without the weights."""

    def __init__(self, name: str, path: Path):
        init_backend()
        params = _internals.LlamaModel.default_params()
        params.vocab_only = True
        try:
            self.model = _internals.LlamaModel(path_model=str(path), params=params, verbose=False)
        except (ValueError, OSError) as err:  # llama.cpp could not read it: a corrupt or foreign file
            raise ProtocolError(ErrorCode.BAD_REQUEST, f"model {name!r} cannot be loaded ({err})") from None
        self.name = name
        self._lock = threading.Lock()
        self._chat: ChatModel | None = None

    def tokenize(self, text: str) -> list[int]:
        """As the engine tokenizes a ``generate`` prompt: BOS when the model wants one, special tokens parsed."""
        return self.model.tokenize(text.encode(), add_bos=True, special=True)

    @property
    def chat(self) -> ChatModel:
        with self._lock:
            if self._chat is None:
                self._chat = ChatModel(self.model, self.name)
            return self._chat

    @property
    def vocabulary(self) -> Vocabulary:
        return vocabulary(self.model)

    def chat_turn(self, body: ChatRequest, emit: Callable[[dict], None] | None = None) -> ChatTurn:
        """A chat request's turn on this model (``chat.prepare_turn``)."""
        return prepare_turn(body, self.chat, self.vocabulary, emit)


class Preparer:
    """Turns ``generate`` and ``chat`` requests into ``GenerationRequest``s; safe to call from several threads."""

    def __init__(self, config: Config, models: ModelPool):
        self.config = config  # read at each request: engine.configure replaces config.engine
        self.models = models
        self._lexicons: dict[Path, Lexicon] = {}
        self._lock = threading.Lock()
        self._loading: tuple[str, float] | None = None  # the model a request last brought in, and when

    def warm_up(self) -> None:
        """Open every configured model's lexicon with its vocabulary and chat template before serving. Building
        a vocabulary holds the GIL for most of a second in one native call (llguidance's tokenizer), and the
        decode thread needs the GIL between steps: done beside running decodes, it stalled another stream for
        0.7 s. A few MB and about a second per model, at start instead."""
        for name in self.models.paths:
            try:
                _, lexicon = self.lexicon(name)
            except ProtocolError:
                continue  # a missing or unreadable file: a request naming it gets the error then
            lexicon.vocabulary
            try:
                lexicon.chat
            except ProtocolError:
                pass  # a base model: no chat template, generate only

    def _may_load(self, name: str) -> None:
        """A request naming a model that is not resident makes the scheduler load it (and maybe evict another):
        allowed for one model per ``engine.model_load_interval_s``, so no caller can make the box thrash."""
        if name in self.models.resident:
            return
        interval, now = self.config.engine.model_load_interval_s, time.monotonic()
        with self._lock:
            if self._loading is not None and self._loading[0] != name and now - self._loading[1] < interval:
                raise ProtocolError(ErrorCode.BUSY, f"model {name!r} is not resident, and requests may bring in a "
                                                    f"model once per {interval:g} s (engine.model_load_interval_s; "
                                                    "model.load is not limited); retry later")
            if self._loading is None or self._loading[0] != name:
                self._loading = (name, now)

    def lexicon(self, model: str | None) -> tuple[str, Lexicon]:
        """The model's name (None: the current default) and its lexicon, opened on first use."""
        name = model or self.models.default
        path = self.models.path_of(name)
        with self._lock:
            lexicon = self._lexicons.get(path)
            if lexicon is None:
                if not path.is_file():
                    raise ProtocolError(ErrorCode.NOT_FOUND, f"model {name!r}: file {path} not found")
                lexicon = self._lexicons[path] = Lexicon(name, path)
            return name, lexicon

    def prepare(self, req: Request, owner: str, outlet: Outlet) -> GenerationRequest:
        """The request as the scheduler runs it, answering through ``outlet`` (streamed events only when the
        request streams); raises ``ProtocolError`` for a bad request."""
        t0 = time.perf_counter()
        body, n_ctx = req.message, self.config.engine.n_ctx
        assert isinstance(body, (GenerateRequest, ChatRequest)), "decode_request types generate and chat"
        params = self.params(body)
        name, lexicon = self.lexicon(body.model)
        on_text = outlet.event if body.stream else None
        finish: Callable[[GenerateResult], GenerateResult | ChatResult] = lambda result: result
        text_out = (lambda text: on_text({"text": text})) if on_text else None
        constraint: Constraint | LlamaGrammar | None = None
        if isinstance(body, ChatRequest):
            turn = lexicon.chat_turn(_with_messages(req, body, n_ctx), on_text)
            prompt, constraint, finish, text_out = turn.prompt, turn.constraint, turn.reply, turn.on_text
        else:
            prompt = lexicon.tokenize(_prompt_text(req, body, n_ctx))
            if body.grammar:
                constraint = gbnf_constraint(body.grammar, lexicon.model)
        if not 0 < len(prompt) < n_ctx:
            raise ProtocolError(ErrorCode.BAD_REQUEST, f"prompt is {len(prompt)} tokens; n_ctx is {n_ctx}")
        self._may_load(name)
        return GenerationRequest(
            prompt, params, on_done=lambda result: outlet.done(finish(result)), on_error=outlet.failed, owner=owner,
            priority=body.priority, session=req.session, model=name, constraint=constraint, on_text=text_out,
            cancelled=outlet.cancelled, prepare_ms=round((time.perf_counter() - t0) * 1000, 3))

    def on_tokenize(self, req: Request, _) -> dict:
        """The ``tokenize`` message: the default model's token ids of a text."""
        return {"tokens": self.lexicon(None)[1].tokenize(req.body["text"])}

    def params(self, body: GenerateRequest | ChatRequest) -> GenerateParams:
        """Sampling parameters (checked as the body was decoded), defaults filled in."""
        p = GenerateParams(max_tokens=body.max_tokens or self.config.engine.default_max_tokens,
                           cache_prompt=body.cache_prompt, stop=body.stop or [])
        for name in ("temperature", "top_p", "top_k", "seed"):
            if (value := getattr(body, name)) is not None:
                setattr(p, name, value)
        return p


#: Well above the longest token text of any vocabulary: a prompt_shm longer than n_ctx of these cannot fit.
_MAX_BYTES_PER_TOKEN = 256


def _with_messages(req: Request, body: ChatRequest, n_ctx: int) -> ChatRequest:
    """A chat body with its messages inline, read from ``messages_shm`` when they came that way."""
    if body.messages_shm is not None:
        data = shm.take_bytes(body.messages_shm, req.session, max_bytes=n_ctx * _MAX_BYTES_PER_TOKEN)
        return msgspec.structs.replace(body, messages=decode_messages(data, req.id), messages_shm=None)
    if body.messages is not None:
        return body
    raise ProtocolError(ErrorCode.BAD_REQUEST, "missing required field 'messages' (or 'messages_shm')")


def _prompt_text(req: Request, body: GenerateRequest, n_ctx: int) -> str:
    if body.prompt_shm is not None:
        cap = n_ctx * _MAX_BYTES_PER_TOKEN  # checked before a byte is read: more could never fit the context
        try:
            return shm.take_bytes(body.prompt_shm, req.session, max_bytes=cap).decode()
        except UnicodeDecodeError:
            raise ProtocolError(ErrorCode.BAD_REQUEST, "prompt_shm does not hold UTF-8 text") from None
    if body.prompt is not None:
        return body.prompt
    raise ProtocolError(ErrorCode.BAD_REQUEST, "missing required field 'prompt' (or 'prompt_shm')")
