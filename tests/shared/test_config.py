import pytest

from shared.config import ConfigError, load_config, parse_config


def test_defaults_run_out_of_the_box(monkeypatch):
    monkeypatch.delenv("MAGNITUDE_CONFIG", raising=False)
    cfg = load_config()
    assert cfg.engine.n_ctx == 4096 and cfg.engine.kv_cache_type == "f16" and cfg.agent.max_iterations == 8
    assert cfg.runtime.endpoint("inference").startswith("ipc://")


def test_yaml_file(tmp_path):
    path = tmp_path / "m.yaml"
    path.write_text("engine:\n  n_ctx: 1024\n  kv_cache_type: q8_0\nagent:\n  max_iterations: 3\n")
    cfg = load_config(path)
    assert (cfg.engine.n_ctx, cfg.engine.kv_cache_type, cfg.agent.max_iterations) == (1024, "q8_0", 3)


@pytest.mark.parametrize("data,needle", [
    ({"engine": {"n_ctx": 5}}, "engine.n_ctx"),
    ({"engine": {"kv_cache_type": "fp8"}}, "engine.kv_cache_type"),
    ({"engine": {"max_batch_size": 64, "prefill_chunk_size": 128}}, "must be <= max_batch_size"),
    ({"engine": {"n_threads": "lots"}}, "engine.n_threads"),
    ({"engine": {"typo_field": 1}}, "engine.typo_field"),
    ({"engine": {"spec_drafter": "model"}}, "needs engine.draft_model_path"),
    ({"agent": {"max_iterations": 0}}, "agent.max_iterations"),
    ({"runtime": {"endpoints": {"inference": "http://x"}}}, "ipc:// or tcp://"),
    ({"runtime": {"endpoints": {"nosuch": "tcp://127.0.0.1:1"}}}, "unknown service"),
    ([1, 2], "top level must be a mapping"),
])
def test_bad_values_are_named(data, needle):
    with pytest.raises(ConfigError) as info:
        parse_config(data, "test.yaml")
    assert needle in str(info.value)


def test_unreadable_and_invalid_yaml(tmp_path):
    with pytest.raises(ConfigError, match="cannot read"):
        load_config(tmp_path / "missing.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("engine: [unclosed")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config(bad)
