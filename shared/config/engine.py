"""The ``engine`` section: the chat model and how llama.cpp runs it; the knobs the optimizer may tune."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any, Literal, Optional

from pydantic import Field, create_model, field_validator, model_validator

from shared import catalog
from shared.config.base import Section
from shared.protocol import MAX_TOKENS



class EngineConfig(Section):
    model_path: Path | None = Field(None, description="GGUF file; default: the catalog's default agent "
                                                    "model (magnitude models list)")
    n_ctx: int = Field(4096, ge=128, le=131072, description="context tokens per session")
    n_threads: int = Field(0, ge=0, le=256, description="0 = one per physical core")
    max_batch_size: int = Field(512, ge=1, le=8192, description="llama.cpp n_batch (tokens per decode call)")
    prefill_chunk_size: int = Field(256, ge=1, le=8192, description="prompt tokens fed per decode step")
    kv_cache_type: Literal["f16", "q8_0", "q4_0"] = "f16"
    session_slots: int = Field(4, ge=1, le=64, description="sessions whose KV stays resident in the context")
    session_cache_mb: int = Field(256, ge=0, le=65536, description="RAM for parked session KV states")
    session_disk_mb: int = Field(1024, ge=0, le=1 << 20, description="disk (DATA_DIR/sessions) for sessions saved "
                                 "on drain and restored after a restart; least recently used go; 0 = off")
    prefix_sharing: bool = Field(True, description="copy a prompt prefix's KV from another sequence that holds it "
                                 "(shared system prompts) instead of computing it again")
    spec_draft_tokens: int = Field(0, ge=0, le=32, description="most draft tokens per decode step (speculative "
                                   "decoding; by lookup, fewer where the session's acceptance says they do not "
                                   "pay); 0 = off")
    spec_ngram_size: int = Field(6, ge=1, le=16, description="longest n-gram matched to find drafts in the "
                                 "session's context (then shorter ones, down to 2)")
    spec_drafter: Literal["lookup", "model"] = Field("lookup", description="where drafts come from: prompt "
                                                     "lookup in the context, or draft_model_path's model")
    draft_model_path: Path | None = Field(None, description="small GGUF with the same vocabulary, for "
                                                            "spec_drafter: model")
    decode_pause_ms: int = Field(0, ge=0, le=1000, description="sleep between decode steps (thermal relief)")
    priority_aging_s: float = Field(30.0, ge=0, le=86400, description="a request that has waited or run this "
                                    "long counts as one class more urgent (twice as long: two), so background "
                                    "work finishes under continuous interactive load; 0 = never")
    priority_pace: float = Field(0.8, ge=0, le=1, description="the most urgent class of the moment decodes at "
                                 "least this fraction of its speed alone: less urgent work shares its steps only "
                                 "as often as that allows, by measured step costs (1: never when it costs; 0: "
                                 "always, plain batching)")
    models: dict[str, Path] = Field(default_factory=dict, description="more GGUF models by name, loadable on "
                                                                      "demand; model_path is named 'default'")
    max_models: int = Field(2, ge=1, le=16, description="models resident at once (model slots)")
    model_load_interval_s: float = Field(5.0, ge=0, le=3600, description="requests may bring in a model that is "
                                         "not resident once per this many seconds (model.load, privileged, is "
                                         "not limited; 0: no limit)")
    models_memory_mb: int = Field(4096, ge=64, le=1 << 20, description="budget for resident models: weights "
                                                                       "and KV; the least recently used goes")
    self_optimize: bool = True
    optimization_window: int = Field(50, ge=5, le=10000, description="requests per optimizer decision")
    default_max_tokens: int = Field(256, ge=1, le=MAX_TOKENS)

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
        """``model_path``, else the catalog's default agent model (``magnitude models pull`` puts it there)."""
        return self.model_path or catalog.get(catalog.DEFAULT_AGENT_MODEL).path()


#: The engine knobs ``engine.configure`` accepts; the optimizer tunes these.
KNOBS = ("n_threads", "prefill_chunk_size", "spec_draft_tokens", "spec_drafter", "decode_pause_ms",
         "priority_pace", "priority_aging_s", "max_batch_size", "kv_cache_type")
#: Knobs that size the llama.cpp context: changing one rebuilds it (the others apply at the next decode step).
REBUILD_KNOBS = ("max_batch_size", "kv_cache_type")


class _Knobs(Section):
    def given(self) -> dict[str, Any]:
        """Only the knobs that have a value."""
        return self.model_dump(exclude_none=True)


#: A set of engine knob values (None = leave as the engine has it). Each knob's type and range is the
#: engine's own field, so engine.configure, strategy files and optimizer overrides validate alike.
def _optional_knob(name: str) -> tuple[Any, Any]:
    engine_field = EngineConfig.model_fields[name]
    kind: Any = engine_field.annotation  # a type expression, built on at run time
    if engine_field.metadata:  # the range (ge/le) applies to a given value, None stays allowed
        kind = Annotated[(kind, *engine_field.metadata)]
    return Optional[kind], Field(None, description=engine_field.description)


_KNOB_FIELDS: dict[str, Any] = {name: _optional_knob(name) for name in KNOBS}
TunableSettings = create_model("TunableSettings", __base__=_Knobs, **_KNOB_FIELDS)
