"""The inference scheduler: one queue, one loop, and per step ONE llama_decode that carries every running generation.

Like llama.cpp's server (tools/server), requests run in *slots* (one llama.cpp sequence of a model's context
each, ``sessions.Slot``), and every step builds one batch per resident model from

* the next token of every generation that is decoding, plus its speculative draft tokens, and
* chunks of the prompts being read in (prefill),

under a token budget (``max_batch_size``). Every decoding generation gets its token in every step, so a long
prompt cannot stall them: while a generation at least as urgent as a prompt decodes, prompts are read at most
``prefill_chunk_size`` tokens per step (else a whole batch). The one exception is priority's: while work of
more than one class runs, the less urgent shares a step only as often as keeps the most urgent at
``engine.priority_pace`` of its speed alone (``pace.py``). Those prompt tokens
go to prompts in every step whatever is decoding, so decodes cannot starve a prompt either, and they are shared
out evenly between the prompts being read (a short follow-up step is not stuck behind a long document; equal
chunks also suit llama.cpp's split of a batch into sub-batches), the most urgent class's first. Drafts get
what is left.

A request (``Task``) moves through these states:

    WAITING  -- a slot is free, its session's own slot is idle, no earlier control message holds it --> PREFILL
    PREFILL  -- its whole prompt has KV; the first token is sampled (TTFT) ----------------------------> DECODE
    DECODE   -- end of generation, a stop string or max_tokens: the reply goes, the slot becomes idle
    DECODE   -- a more urgent request, or another owner short of its share, needs the slot: paused --> WAITING
    WAITING  -- (paused) a slot is free: its KV is copied back, it decodes on where it stopped -----> DECODE

**Priorities and fair shares** (docs/scheduler.md). Every request has a class (``priority``: interactive,
normal, background) and an owner. A free slot goes to the most urgent class first, within it to the owner
holding the fewest of its slots, then to the earliest. When every slot is busy, a waiting request pauses a
decoding generation of a less urgent class, or of its own class whose owner holds two more of its slots
(``_make_room``): the paused one's KV goes to RAM and it resumes later with the same tokens. A request counts
one class more urgent for every ``engine.priority_aging_s`` since it arrived, so background work finishes.

A WAITING request that shares a prefix with a prompt another slot is prefilling right now stays WAITING until
that prefix is in, then copies its KV instead of computing it again. Where a request's KV comes from (its
session's slot, a PARKED session's copy in RAM or on disk, another sequence's shared prefix) is
``sessions.py``'s business.

Control messages (``Control``: ``engine.configure``, ``model.*``) run between steps. One that rebuilds a
context or loads/unloads a model waits until no generation runs, and everything queued after it waits behind
it, in order; a configure of hot settings only (threads, chunk size, drafting, pause) runs at the next step.

**The seam for request types.** A request arrives *prepared* (``prepare.py``, on the service's preparing
workers, never on this loop): a ``GenerationRequest`` holds the prompt's token ids, ``GenerateParams``, the
model's name, an optional ``constraint`` (``constraint.Constraint``: which tokens may come next, e.g. a grammar
or a tool-call shape), who owns it and its session, and callbacks: ``on_text(piece)`` for streamed text,
``on_done(result)`` with the text and its stats, ``on_error(exc)``, and ``cancelled()``, asked at every step
(a cancelled request ends with a ``cancelled`` error and frees its slot at once). Tokens the constraint forces
are decoded like drafts that cannot be rejected. The scheduler only runs generations; it never calls back into
the service. The path of a request: ``shared/service/zmq_router.py`` (socket) and ``workers.py`` (queue) ->
``service.py`` and ``prepare.py`` (request -> ``GenerationRequest``) -> this file -> ``engine.py``
(``llama_decode``), on the ``ResidentModel`` of the request's model (``resident.py``: its engine, session table
and drafting policy, ``drafting.py``).
"""

from __future__ import annotations

import enum
import time
from collections import Counter, deque
from dataclasses import dataclass, field
from typing import Any, Callable, TypedDict

import structlog

from shared.config import EngineConfig
from shared.cores import LeaseTimeout
from shared.protocol import DEFAULT_PRIORITY, PRIORITIES, ErrorCode, GenerateResult, Priority, ProtocolError, Stats
from services.inference.drafting import DraftState
from services.inference.models import ModelPool
from services.inference.pace import UrgentPace
from services.inference.resident import ResidentModel
from services.inference.constraint import Constraint, LlamaGrammar
from services.inference.sampling import TokenSampler
from services.inference.sessions import Acquired, Paused, Slot
from services.inference.text_stream import TextStream


#: A priority's rank: 0 is the most urgent class.
RANKS = {name: rank for rank, name in enumerate(PRIORITIES)}


class State(enum.Enum):
    WAITING = "waiting"  # queued: no slot yet, its session's slot is busy, or a shared prefix is being prefilled
    PREFILL = "prefill"  # in a slot; its prompt is read in chunks, step by step
    DECODE = "decode"  # generating: one token (plus drafts) per step


@dataclass
class GenerateParams:
    max_tokens: int = 256
    temperature: float = 0.0
    top_p: float = 0.95
    top_k: int = 40
    seed: int = 0
    stop: list[str] = field(default_factory=list)
    cache_prompt: bool = True  # reuse KV (the session's, a parked copy, a shared prefix); False: compute it all


def _never() -> bool:
    return False


@dataclass
class GenerationRequest:
    """One prepared generation, as it reaches the scheduler (see the module docstring)."""

    prompt: list[int]
    params: GenerateParams
    on_done: Callable[[GenerateResult], None]
    on_error: Callable[[Exception], None]
    owner: str = "local"  # whose KV it may reuse (sessions.py), and whose fair share of slots it counts in
    priority: Priority = DEFAULT_PRIORITY  # its class: shared.protocol.PRIORITIES, most urgent first
    session: str | None = None  # a session id of that owner
    model: str | None = None  # a model slot's name; None: the default model
    constraint: Constraint | LlamaGrammar | None = None
    on_text: Callable[[str], None] | None = None
    cancelled: Callable[[], bool] = _never
    prepare_ms: float = 0.0  # how long its preparation took (its stats report it)

    @property
    def session_key(self) -> tuple[str, str] | None:
        return None if self.session is None else (self.owner, self.session)


@dataclass
class Control:
    """A control message: ``run`` answers it; ``needs_drain`` says whether it must wait until nothing runs."""

    run: Callable[[], None]
    needs_drain: Callable[[], bool]


@dataclass(eq=False)
class Task:
    """One generation inside the scheduler: its state, slot, sampler, text stream and figures."""

    request: GenerationRequest
    t_start: float = field(default_factory=time.perf_counter)
    state: State = State.WAITING
    resident: ResidentModel | None = None  # the model it runs on: engine, session table, drafting policy
    model: str = ""  # that model's name in the pool
    load_ms: float = 0.0
    prompt: list[int] = field(default_factory=list)
    slot: Slot | None = None
    acquired: Acquired | None = None
    sampler: TokenSampler | None = None
    stream: TextStream | None = None
    max_tokens: int = 0
    fed: int = 0  # prompt tokens whose KV is in the slot
    generated: int = 0
    pending: int = -1  # sampled, not yet decoded
    drafts: DraftState = field(default_factory=DraftState)  # its speculative drafts and their figures
    forced: int = 0  # tokens the constraint forced, decoded as drafts (never sampled)
    step_forced: int = 0  # how many of this step's drafts were forced ones
    peak_batch: int = 0  # most generations decoded in one step together with this one (itself included)
    last_step: int = 0  # the step that last decoded its token
    ttft: float | None = None
    t_prefill: float = 0.0
    prefill_s: float = 0.0
    t_decode: float = 0.0
    t_end: float = 0.0
    stop_reason: str | None = None
    paused: Paused | None = None  # its KV while it waits to resume (a more urgent request took its slot)
    pauses: int = 0

    def emit(self, piece: str) -> None:
        if piece and self.request.on_text:
            self.request.on_text(piece)

    def result(self) -> GenerateResult:
        decode_s = self.t_end - self.t_decode
        total_s = self.t_end - self.t_start
        prefill = len(self.prompt) - self.acquired.cached
        return GenerateResult(text=self.stream.text, stats=Stats(
            stop_reason=self.stop_reason,
            prompt_tokens=len(self.prompt),
            cached_tokens=self.acquired.cached,
            prefill_tokens=prefill,
            completion_tokens=self.generated,
            kv_source=self.acquired.source,
            kv_switch_ms=self.acquired.switch_ms,
            shared_tokens=self.acquired.shared,
            ttft_s=round(self.ttft if self.ttft is not None else total_s, 4),
            prefill_tps=round(prefill / self.prefill_s, 1) if self.prefill_s > 0 else None,
            decode_tps=round(self.generated / decode_s, 1) if self.generated and decode_s > 0 else None,
            total_s=round(total_s, 4),
            draft_tokens=self.drafts.drafted,
            accepted_tokens=self.drafts.accepted,
            forced_tokens=self.forced,
            peak_batch=self.peak_batch,
            priority=self.request.priority,
            pauses=self.pauses,
            model=self.model,
            model_load_ms=self.load_ms,
            prepare_ms=self.request.prepare_ms,
        ))


def fair_shares(needs: list[int], budget: int) -> list[int]:
    """Split ``budget`` prompt tokens between prompts that need ``needs`` more: evenly, and what one needs
    less than its share of goes to the others."""
    shares = [0] * len(needs)
    order = sorted(range(len(needs)), key=lambda i: needs[i])
    for k, i in enumerate(order):
        shares[i] = min(needs[i], budget // (len(order) - k))
        budget -= shares[i]
    return shares


class Counters(TypedDict):
    """The scheduler's figures (``Scheduler.describe``)."""

    steps: int
    mixed_steps: int
    max_batch_seen: int
    shared_prefix_tokens: int
    decode_s: float
    waiting: int
    prefill: int
    decode: int
    pauses: int


class Scheduler:
    def __init__(self, models: ModelPool[ResidentModel], log: Any):
        self.models = models
        self.log = log
        self.queue: deque[Task | Control] = deque()  # arrival order: WAITING tasks and control messages
        self.running: list[Task] = []  # PREFILL and DECODE tasks
        self.paces: dict[str, UrgentPace] = {}  # per model file: how often less urgent work shares a step
        #: Read by health from the I/O thread, so only ints, set by this loop (never iterate the queues there).
        self.counters: Counters = {"steps": 0, "mixed_steps": 0, "max_batch_seen": 0, "shared_prefix_tokens": 0,
                         "decode_s": 0.0, "waiting": 0, "prefill": 0, "decode": 0, "pauses": 0}

    @property
    def busy(self) -> bool:
        return bool(self.queue or self.running)

    def submit(self, item: GenerationRequest | Control) -> None:
        self.queue.append(Task(item) if isinstance(item, GenerationRequest) else item)

    def describe(self) -> Counters:
        """Steps so far (``mixed_steps``: with prompt chunks and decodes together; ``decode_s``: time inside
        llama_decode), the most generations decoded in one step, KV tokens copied between sequences, generations
        paused to make room, and how many tasks are in each state now (``waiting`` counts paused ones)."""
        return {**self.counters, "decode_s": round(self.counters["decode_s"], 3)}

    def run(self, intake: Callable[[float], None], should_stop: Callable[[], bool]) -> None:
        """The loop: take new work (``intake(wait_s)``, which also beats the worker's heartbeat), admit, decode
        one batch per model; return once idle and ``should_stop()``."""
        for resident in self.models.resident.values():
            try:
                resident.engine.warm_up()  # on this thread, which runs every decode (see Engine.warm_up)
            except LeaseTimeout as exc:  # another process holds the cores: a request warms it up later (_start)
                self.log.warning("warm_up_postponed", error=exc.message)
        while True:
            intake(0.0 if self.running else 0.2)
            if not self.busy and should_stop():
                return
            self.step()

    @classmethod
    def of_one_model(cls, cfg: EngineConfig) -> "Scheduler":
        """A scheduler over ``cfg``'s model without a service around it (benchmarks use it with ``complete``)."""
        return cls(ModelPool(cfg, ResidentModel), structlog.get_logger("scheduler"))

    def complete(self, prompt: str | list[int], params: GenerateParams, **request: Any) -> GenerateResult:
        """Run one generation to its end on the calling thread, without a service (benchmarks use it); the
        result, or its error raised. ``request``: more ``GenerationRequest`` fields (session, constraint...)."""
        outcome: list = []
        if isinstance(prompt, str):
            prompt = self.models.get(request.get("model"))[0].engine.tokenize(prompt)
        self.submit(GenerationRequest(prompt, params, on_done=outcome.append, on_error=outcome.append, **request))
        while not outcome:
            self.step()
        if isinstance(outcome[0], Exception):
            raise outcome[0]
        return outcome[0]

    def step(self) -> None:
        self._drop_cancelled()
        self._admit()
        for resident in {id(t.resident): t.resident for t in self.running}.values():
            self._step(resident, [t for t in self.running if t.resident is resident])
        states = [t.state for t in self.running]
        self.counters.update({"waiting": sum(isinstance(i, Task) for i in self.queue),
                              "prefill": states.count(State.PREFILL), "decode": states.count(State.DECODE)})
        pause_ms = self.models.cfg.decode_pause_ms
        if pause_ms and self.running:
            time.sleep(pause_ms / 1000)

    def _drop_cancelled(self) -> None:
        """End every task whose client cancelled it, queued or running: its slot is free for this step."""
        for item in [i for i in self.queue if isinstance(i, Task) and i.request.cancelled()]:
            self.queue.remove(item)
            self._fail(item, ProtocolError(ErrorCode.CANCELLED, "cancelled by the client"))
        for t in [t for t in self.running if t.request.cancelled()]:  # the slot's KV matches its tokens already
            self._fail(t, ProtocolError(ErrorCode.CANCELLED, "cancelled by the client"))

    # --- admission -----------------------------------------------------------------------
    def _admit(self) -> None:
        """Start what can start. Control messages keep their place in arrival order (nothing passes one that
        waits for the generations to drain); between them, tasks start in ``_order``, and a request of a session
        waits behind that session's earlier one."""
        held_sessions: set[tuple[str, str] | None] = set()
        waited = False
        tasks: list[Task] = []
        for item in [*self.queue, None]:
            if isinstance(item, Task):
                tasks.append(item)
                continue
            waited = self._admit_tasks(tasks, held_sessions) or waited
            tasks = []
            if item is None:
                return
            if item.needs_drain() and (self.running or waited):
                return
            self.queue.remove(item)
            item.run()

    def _admit_tasks(self, tasks: list[Task], held_sessions: set[tuple[str, str] | None]) -> bool:
        """Try ``tasks`` (in arrival order) in ``_order``; whether any of them still waits."""
        waited = False
        ready: list[Task] = []
        for task in tasks:
            session = task.request.session_key
            if session is not None and session in held_sessions:
                waited = True
                continue
            if session is not None:
                held_sessions.add(session)
            ready.append(task)
        now = time.perf_counter()
        while ready:
            held = self._held(now)
            task = min(ready, key=lambda t: self._order(t, held, now))
            ready.remove(task)
            if self._start(task):
                self.queue.remove(task)
            else:
                waited = True
        return waited

    def _rank(self, t: Task, now: float) -> int:
        """``t``'s class (0: the most urgent), one more urgent for every ``priority_aging_s`` since it arrived,
        so a background request under continuous interactive load is served within twice that."""
        rank, aging_s = RANKS[t.request.priority], self.models.cfg.priority_aging_s
        return max(0, rank - int((now - t.t_start) / aging_s)) if aging_s else rank

    def _held(self, now: float, resident: ResidentModel | None = None) -> Counter[tuple[str, int]]:
        """Slots held (of ``resident``, or of every model) by (owner, class)."""
        return Counter((t.request.owner, self._rank(t, now)) for t in self.running
                       if resident is None or t.resident is resident)

    def _order(self, t: Task, held: Counter[tuple[str, int]], now: float) -> tuple[int, int, float]:
        """Who gets a free slot first: the most urgent class; within it the owner holding the fewest of its
        slots (a fair share: an owner with nothing waiting lends its share); then the earliest."""
        rank = self._rank(t, now)
        return rank, held[t.request.owner, rank], t.t_start

    def _make_room(self, task: Task, resident: ResidentModel) -> bool:
        """Every slot is busy: pause the generation ``task`` may displace, if one (True). One of a less urgent
        class, else one of its own class whose owner holds at least two more of its slots than ``task``'s owner
        does (after the swap they differ by at most as much, so nothing swings back); the least urgent, the
        biggest holder's, the latest to arrive goes first. Only decoding generations pause: a prompt being
        read is about to decode."""
        if resident.sessions.resident(task.request.session_key) is not None:
            return False  # its session's own slot is busy: its earlier request runs, and it waits for that
        now = time.perf_counter()
        rank, held = self._rank(task, now), self._held(now, resident)
        mine = held[task.request.owner, rank]
        victims = [(r, held[t.request.owner, r], t.t_start, t) for t in self.running
                   if t.resident is resident and t.state is State.DECODE and (r := self._rank(t, now)) >= rank
                   and (r > rank or held[t.request.owner, r] >= mine + 2)]
        if not victims:
            return False
        self._pause(max(victims, key=lambda v: v[:3])[3])
        return True

    def _pause(self, t: Task) -> None:
        """Take ``t``'s slot: its KV goes to RAM (``SessionTable.pause``), and it waits at the head of the queue
        with everything else it had (sampler, text so far, the token it sampled last), to resume where it
        stopped: the same tokens as if it had never paused."""
        t.paused = t.resident.sessions.pause(t.slot)
        t.slot, t.state = None, State.WAITING
        t.pauses += 1
        self.counters["pauses"] += 1
        self.running.remove(t)
        self.queue.appendleft(t)

    def _paused(self) -> bool:
        """Whether a paused generation waits: it holds its model (``ResidentModel.busy``) as a running one does."""
        return any(isinstance(item, Task) and item.paused is not None for item in self.queue)

    def _resume(self, t: Task, resident: ResidentModel) -> bool:
        if not resident.sessions.idle() and not self._make_room(t, resident):
            return False
        t.slot = resident.sessions.resume(t.paused)
        t.paused, t.state = None, State.DECODE
        self.running.append(t)
        return True

    def _start(self, task: Task) -> bool:
        """Give ``task`` a slot and move it to PREFILL (True), or leave it WAITING (False). A task that cannot
        run at all is answered with its error and counts as started."""
        req = task.request
        try:
            resident, load_ms = self.models.get(req.model)
        except ProtocolError as exc:
            if exc.code == ErrorCode.BUSY and (self.running or self._paused()):
                return False  # every resident model is generating: one will finish
            return self._fail(task, exc)
        except FileNotFoundError as exc:
            return self._fail(task, ProtocolError(ErrorCode.NOT_FOUND, str(exc)))
        except Exception as exc:  # a file llama.cpp cannot load: this request fails, never the loop
            return self._fail(task, ProtocolError(ErrorCode.BAD_REQUEST, f"model {req.model!r} cannot be loaded: "
                                                                         f"{type(exc).__name__}"))
        try:
            engine = resident.engine
            engine.warm_up()  # a model loaded since the loop started
            if task.paused is not None:  # its model stayed resident: a paused generation keeps it busy
                return self._resume(task, task.resident)
            if task.resident is not resident:  # first try, or its model was reloaded meanwhile
                task.resident, task.load_ms = resident, task.load_ms + load_ms
                task.model = next(name for name, m in self.models.resident.items() if m is resident)
                task.prompt = req.prompt
            if req.params.cache_prompt and resident.sessions.worth_waiting(req.owner, task.prompt):
                return False
            if not resident.sessions.can_admit(req.session_key) and not self._make_room(task, task.resident):
                return False
            p = req.params
            task.sampler = TokenSampler(engine.model, engine.ctx, temperature=p.temperature, top_k=p.top_k,
                                        top_p=p.top_p, seed=p.seed, constraint=req.constraint)
            task.acquired = resident.sessions.acquire(req.owner, req.session_key, task.prompt, reuse=p.cache_prompt)
        except Exception as exc:
            return self._fail(task, exc)
        task.slot = task.acquired.slot
        task.slot.planned = task.prompt
        task.stream = TextStream(p.stop)
        task.fed = task.acquired.cached
        task.max_tokens = min(p.max_tokens, engine.cfg.n_ctx - len(task.prompt))
        task.state, task.t_prefill = State.PREFILL, time.perf_counter()
        self.counters["shared_prefix_tokens"] += task.acquired.shared
        self.running.append(task)
        return True

    # --- one step of one model -----------------------------------------------------------
    def _step(self, resident: ResidentModel, tasks: list[Task]) -> None:
        """Build this model's batch (decode tokens, drafts, prompt chunks), decode it once, consume the logits."""
        engine = resident.engine
        budget = engine.cfg.max_batch_size
        decoders, prefills, chunks = self._carried(resident, tasks)
        room = budget - len(decoders) - sum(chunks)
        plan: list[tuple[Task, list[int]]] = []
        for t in decoders:
            try:
                drafts = self._drafts(resident, t, max(min(room, t.max_tokens - t.generated - 1), 0),
                                      budget - room, len(decoders))
            except Exception as exc:  # its constraint or drafter failed: that request, not the step
                self._fail(t, exc)
                continue
            room -= len(drafts)
            plan.append((t, [t.pending] + drafts))
        plan += [(t, t.prompt[t.fed:t.fed + n]) for t, n in zip(prefills, chunks) if n]
        plan.sort(key=lambda item: item[0].slot.seq_id)
        rows = [(t.slot.seq_id, len(t.slot.tokens), tokens,
                 len(tokens) if t.state is State.DECODE else int(t.fed + len(tokens) == len(t.prompt)))
                for t, tokens in plan]
        t0 = time.perf_counter()
        try:
            firsts = engine.decode(rows)
        except Exception as exc:  # the batch's KV is in an unknown state: its tasks fail, their slots are cleared
            for t, _ in plan:
                engine.clear_seq(t.slot.seq_id)
                t.slot.tokens = []
                self._fail(t, exc)
            return
        seconds = time.perf_counter() - t0
        resident.step_costs.observe(sum(len(tokens) for _, tokens in plan), seconds)
        c = self.counters
        c["decode_s"] += seconds
        c["steps"] += 1
        for t in decoders:
            t.last_step = c["steps"]
        c["mixed_steps"] += bool(decoders) and len(plan) > len(decoders)
        c["max_batch_seen"] = max(c["max_batch_seen"], len(decoders))
        for (t, tokens), first in zip(plan, firsts):
            try:
                if t.state is State.PREFILL:
                    self._prefilled(t, tokens, first)
                else:
                    self._decoded(t, tokens, first, len(decoders))
            except Exception as exc:  # a constraint or a callback failed: that request, not the step
                self._fail(t, exc)

    def _shape(self, cfg: EngineConfig, tasks: list[Task]) -> tuple[list[Task], list[Task], list[int]]:
        """The generations that decode a token this step, the prompts being read, and each prompt's chunk."""
        budget = cfg.max_batch_size
        # More generations than batch cells (session_slots > max_batch_size): the longest-waiting ones first.
        decoders = sorted((t for t in tasks if t.state is State.DECODE), key=lambda t: t.last_step)[:budget]
        prefills = [t for t in tasks if t.state is State.PREFILL]
        # Prompt tokens per step: a chunk while generations at least as urgent as a prompt decode (their next
        # token waits for this step), else the whole batch (bigger sub-batches read the weights fewer times).
        now = time.perf_counter()
        urgent_prompt = min((self._rank(t, now) for t in prefills), default=len(RANKS))
        waiting_decoders = any(self._rank(t, now) <= urgent_prompt for t in decoders)
        prompt_budget = budget - len(decoders)
        if waiting_decoders:
            prompt_budget = min(cfg.prefill_chunk_size, prompt_budget)
        return decoders, prefills, self._prompt_chunks(prefills, prompt_budget)

    def _carried(self, resident: ResidentModel, tasks: list[Task]) -> tuple[list[Task], list[Task], list[int]]:
        """The shape (``_shape``) of the step that carries every task, or only the most urgent class's while
        the others would slow it below ``engine.priority_pace`` of its speed alone (``pace.UrgentPace``, by
        measured step costs). Those left out keep their slots and KV, and decode in a later step."""
        now = time.perf_counter()
        ranks = [self._rank(t, now) for t in tasks]
        top = min(ranks)
        urgent = [t for t, rank in zip(tasks, ranks) if rank == top]
        engine = resident.engine
        pace = self.paces.setdefault(engine.model_path.name, UrgentPace())
        together = self._shape(engine.cfg, tasks)
        if len(urgent) == len(tasks):
            pace.reset()
            return together
        alone = self._shape(engine.cfg, urgent)
        cost = resident.step_costs
        if pace.join(engine.cfg.priority_pace, cost(len(alone[0]) + sum(alone[2])),
                     cost(len(together[0]) + sum(together[2]))):
            return together
        return alone

    def _prompt_chunks(self, prefills: list[Task], budget: int) -> list[int]:
        """How many of its prompt's tokens each prompt being read gets this step: the most urgent class's
        prompts share the budget first (``fair_shares``), and what they leave goes to the next class, so an
        interactive request's first token is not slowed by background documents being read."""
        now = time.perf_counter()
        ranks = [self._rank(t, now) for t in prefills]
        chunks = [0] * len(prefills)
        for rank in sorted(set(ranks)):
            mine = [i for i, r in enumerate(ranks) if r == rank]
            for i, n in zip(mine, fair_shares([len(prefills[i].prompt) - prefills[i].fed for i in mine], budget)):
                chunks[i] = n
                budget -= n
        return chunks

    def _prefilled(self, t: Task, chunk: list[int], first: int) -> None:
        t.slot.tokens.extend(chunk)
        t.fed += len(chunk)
        if t.fed == len(t.prompt):
            t.slot.planned = None
            t.t_decode = time.perf_counter()
            t.prefill_s = t.t_decode - t.t_prefill
            t.state = State.DECODE
            self._take(t, t.sampler.sample(first + len(chunk) - 1))

    def _decoded(self, t: Task, tokens: list[int], first: int, batch: int) -> None:
        """The pending token (and drafts) went in: sample at each position while the drafts match the samples."""
        t.peak_batch = max(t.peak_batch, batch)
        t.slot.tokens.append(tokens[0])
        drafts = tokens[1:]
        accepted = 0  # speculative drafts confirmed
        for i in range(len(drafts) + 1):
            token = t.sampler.sample(first + i)
            self._take(t, token)
            if t.stop_reason or i == len(drafts) or token != drafts[i]:
                break
            t.slot.tokens.append(token)  # the draft was right: its KV is already in place
            if i < t.step_forced:
                t.forced += 1
            else:
                accepted += 1
        t.resident.drafting.observe(t.drafts, len(drafts) - t.step_forced, accepted)
        if drafts:  # drop the KV of rejected drafts (and of any past where the generation ended)
            t.resident.engine.trim_seq(t.slot.seq_id, len(t.slot.tokens))

    def _drafts(self, resident: ResidentModel, t: Task, limit: int, batch: int, decoders: int) -> list[int]:
        """Up to ``limit`` tokens to follow the task's pending one: those its constraint forces, whatever the
        settings, then the speculative ones its model's drafting policy proposes for a step of ``batch`` tokens
        that brings ``decoders`` tokens (``DraftPolicy.propose``)."""
        forced = t.sampler.forced()[:limit]
        t.step_forced = len(forced)
        return forced + resident.drafting.propose(t.drafts, t.slot, [t.pending] + forced, limit - len(forced),
                                                  resident.step_costs, batch + len(forced), decoders + len(forced))

    def _take(self, t: Task, token: int) -> None:
        """Stream and account one sampled token; it becomes the pending one unless the generation ends."""
        if t.ttft is None:
            t.ttft = time.perf_counter() - t.t_start
        if t.resident.engine.is_end(token):
            return self._finish(t, "eos")
        t.generated += 1
        t.emit(t.stream.feed(t.resident.engine.token_bytes(token)))
        if t.stream.stopped:
            self._finish(t, "stop")
        elif t.generated >= t.max_tokens:
            self._finish(t, "length")
        else:
            t.pending = token

    # --- the end of a task -----------------------------------------------------------------
    def _finish(self, t: Task, reason: str) -> None:
        t.stop_reason = reason
        t.emit(t.stream.finish())
        t.t_end = time.perf_counter()
        self._release(t)
        self._call(t.request.on_done, t.result())

    def _fail(self, t: Task, exc: Exception) -> bool:
        self._release(t)
        self._call(t.request.on_error, exc)
        return True

    def _release(self, t: Task) -> None:
        if t.sampler is not None:
            t.sampler.close()
            t.sampler = None
        elif t.request.constraint is not None:  # it never started: the constraint has no sampler to close it
            t.request.constraint.close()
        if t.slot is not None:
            t.resident.sessions.release(t.slot)
        if t.paused is not None:
            t.resident.sessions.forget_paused()
            t.paused = None
        if t in self.running:
            self.running.remove(t)

    def _call(self, callback: Callable[[Any], None], arg: Any) -> None:
        """A reply callback that fails (a closed socket) costs that reply, never the loop."""
        try:
            callback(arg)
        except Exception:
            self.log.exception("reply_failed")

    def persist(self) -> int:
        """Write every resident model's sessions to disk (on drain, from the loop's own thread); how many."""
        return sum(resident.sessions.persist() for resident in self.models.resident.values())
