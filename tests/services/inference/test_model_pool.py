"""Model slots bookkeeping (ModelPool) with fake engines: LRU, count and memory budget, busy models."""

import pytest

from services.inference.models import ModelPool
from shared.config import EngineConfig
from shared.protocol import ProtocolError


class FakeModel:
    def __init__(self, cfg: EngineConfig, opened: list):
        self.cfg, self.memory_bytes, self.is_busy, self.closed = cfg, 100 << 20, False, False
        opened.append(cfg.model_path.name)

    def busy(self):
        return self.is_busy

    def close(self):
        self.closed = True


@pytest.fixture
def files(tmp_path):
    paths = {}
    for name in ("a", "b", "c"):
        paths[name] = tmp_path / f"{name}.gguf"
        paths[name].write_bytes(b"\0" * 1024)
    return paths


def pool_of(files, opened, **cfg):
    config = EngineConfig(model_path=files["a"], models={"b": files["b"], "c": files["c"]}, **cfg)
    return ModelPool(config, lambda c: FakeModel(c, opened))


def test_default_model_is_loaded_at_start_and_resident_models_cost_no_reload(files):
    opened = []
    pool = pool_of(files, opened)
    assert opened == ["a.gguf"] and list(pool.resident) == ["default"]
    engine, ms = pool.get(None)
    assert ms == 0 and pool.get("default")[0] is engine and opened == ["a.gguf"]
    _, ms = pool.get("b")
    assert ms > 0 and opened == ["a.gguf", "b.gguf"]
    assert pool.get("b")[1] == 0 and pool.get("default")[1] == 0 and pool.loads == 2


def test_least_recently_used_idle_model_is_unloaded_beyond_max_models(files):
    opened = []
    pool = pool_of(files, opened, max_models=2)
    first = pool.get("default")[0]
    pool.get("b")
    pool.get("default")  # b is now the least recently used
    pool.get("c")
    assert list(pool.resident) == ["default", "c"] and not first.closed


def test_a_generating_model_is_never_evicted(files):
    pool = pool_of(files, [], max_models=2)
    pool.get("default")[0].is_busy = True
    pool.get("b")[0].is_busy = True
    with pytest.raises(ProtocolError) as err:
        pool.get("c")
    assert err.value.code == "busy"
    with pytest.raises(ProtocolError) as err:
        pool.unload("b")
    assert err.value.code == "busy"


def test_memory_budget_evicts_after_measuring_the_real_size(files):
    pool = pool_of(files, [], max_models=3, models_memory_mb=250)  # two 100 MiB engines fit, three do not
    pool.get("b")
    pool.get("c")
    assert list(pool.resident) == ["b", "c"] and pool.used_bytes() == 200 << 20


def test_a_model_bigger_than_the_budget_alone_is_refused(files):
    with pytest.raises(ProtocolError) as err:
        pool_of(files, [], models_memory_mb=64)  # the fake engine takes 100 MiB
    assert err.value.code == "bad_request" and "does not fit" in err.value.message


def test_unknown_model_and_missing_file(files):
    pool = pool_of(files, [])
    with pytest.raises(ProtocolError) as err:
        pool.get("nope")
    assert err.value.code == "not_found" and "configured: b, c, default" in err.value.message
    files["c"].unlink()
    with pytest.raises(FileNotFoundError):
        pool.get("c")


def test_switch_changes_the_default_and_unload_frees(files):
    pool = pool_of(files, [])
    assert pool.switch("b") > 0 and pool.default == "b" and pool.get(None)[0] is pool.resident["b"]
    assert pool.unload("default") is True and pool.unload("default") is False
    described = pool.describe()
    assert described["default"] == "b"
    assert {m["name"]: m["resident"] for m in described["models"]} == {"b": True, "c": False, "default": False}
