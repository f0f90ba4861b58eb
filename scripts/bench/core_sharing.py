"""How two llama.cpp processes share this box's cores, under each OpenMP wait policy (shared/cores.py).

For each policy it measures, with the chat model decoding greedily (tok/s) and the embedding model
embedding batches of 8 sentences (batches/s):

  alone       one decoding process
  +embedding  the decoding process while another process embeds
  two decodes two decoding processes at once

Policies: libgomp's short spin without the lease (what the services shipped before), a long spin
without the lease, and the long spin with the core lease the services now take around every
llama.cpp computation (``shared.cores.CoreLease``). Each worker is a fresh process, since libgomp
reads its wait policy once.

    .venv/bin/python -m scripts.bench.core_sharing
    .venv/bin/python -m scripts.bench.core_sharing --tokens 40  # quicker, noisier
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import tempfile
import time
from contextlib import nullcontext
from pathlib import Path

from scripts.bench import REPO
from shared import catalog
from shared.config import Config
from shared.cores import LEASED_SPIN_COUNT, UNLEASED_SPIN_COUNT, CoreLease

#: (name, GOMP_SPINCOUNT, whether the workers take the lease)
POLICIES = [
    (f"PASSIVE + {UNLEASED_SPIN_COUNT} spins, no lease", UNLEASED_SPIN_COUNT, False),
    (f"PASSIVE + {LEASED_SPIN_COUNT} spins, no lease", LEASED_SPIN_COUNT, False),
    (f"PASSIVE + {LEASED_SPIN_COUNT} spins, lease (shipped)", LEASED_SPIN_COUNT, True),
]


def work(kind: str, model: str, tokens: int, threads: int, lease_path: str | None, go: Path) -> None:
    """A worker process: decode ``tokens`` tokens, or embed until SIGTERM; prints its rate.

    The clocks start together: a decoder creates ``go`` once its model is loaded, an embedder waits for it."""
    import llama_cpp

    lease = CoreLease(Path(lease_path)) if lease_path else nullcontext()
    if kind == "embed":
        llm = llama_cpp.Llama(model, embedding=True, n_threads=threads, n_threads_batch=threads, n_ctx=512,
                              verbose=False)
        stopped = []
        signal.signal(signal.SIGTERM, lambda *_: stopped.append(True))
        while not go.exists() and not stopped:
            time.sleep(0.01)
        start, batches = time.perf_counter(), 0
        while not stopped:
            with lease:
                llm.embed([f"the robot checked room {batches} and found it clear, sentence {i}" for i in range(8)])
            batches += 1
        print(f"{batches / (time.perf_counter() - start):.2f}", flush=True)
        return
    llm = llama_cpp.Llama(model, n_threads=threads, n_threads_batch=threads, n_ctx=1024, verbose=False)
    with lease:
        llm.eval(llm.tokenize(b"Once upon a time, in a small village by the sea, there lived"))
    go.touch()
    start = time.perf_counter()
    for _ in range(tokens):
        token = llm.sample(temp=0.0)
        with lease:
            llm.eval([token])
    print(f"{tokens / (time.perf_counter() - start):.2f}", flush=True)


def spawn(kind: str, model: str, tokens: int, threads: int, spin: str, lease: str | None, go: Path) -> subprocess.Popen:
    env = {**os.environ, "OMP_WAIT_POLICY": "PASSIVE", "GOMP_SPINCOUNT": spin}
    cmd = [sys.executable, "-m", __spec__.name, "--worker", kind, "--model", model, "--tokens", str(tokens),
           "--threads", str(threads), "--go", str(go)] + (["--lease", lease] if lease else [])
    return subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, text=True, cwd=REPO)


def rate(proc: subprocess.Popen) -> float:
    out, _ = proc.communicate()
    if proc.returncode != 0:
        sys.exit(f"a worker failed (exit {proc.returncode})")
    return float(out.strip())


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=str(catalog.get(catalog.DEFAULT_AGENT_MODEL).path()),
                        help="chat model that decodes (default: the default agent model)")
    parser.add_argument("--embedding-model", default=str(Config().memory.resolved_embedding_model_path()),
                        help="embedding model of the other process (default: the configured one)")
    parser.add_argument("--tokens", type=int, default=80, help="tokens each decoding process writes")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--worker", choices=["decode", "embed"], help=argparse.SUPPRESS)
    parser.add_argument("--lease", help=argparse.SUPPRESS)
    parser.add_argument("--go", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        work(args.worker, args.model, args.tokens, args.threads, args.lease, args.go)
        return 0
    for path in (args.model, args.embedding_model):
        if not Path(path).is_file():
            sys.exit(f"{path} not found (scripts/setup pulls the models)")

    rows = []
    with tempfile.TemporaryDirectory(prefix="magcores") as tmp:
        for name, spin, leased in POLICIES:
            lease = str(Path(tmp) / "cores.lock") if leased else None
            go = Path(tmp) / f"go-{len(rows)}"
            print(f"{name}: alone", file=sys.stderr, flush=True)
            alone = rate(spawn("decode", args.model, args.tokens, args.threads, spin, lease, go))
            print(f"{name}: beside an embedding process", file=sys.stderr, flush=True)
            go.unlink()
            embedder = spawn("embed", args.embedding_model, 0, args.threads, spin, lease, go)
            try:
                beside = rate(spawn("decode", args.model, args.tokens // 2, args.threads, spin, lease, go))
            finally:  # also when the decoder failed: the embedder embeds until told to stop
                embedder.terminate()
            embeds = rate(embedder)
            print(f"{name}: two decoding processes", file=sys.stderr, flush=True)
            pair = [spawn("decode", args.model, args.tokens // 2, args.threads, spin, lease, go) for _ in range(2)]
            two = [rate(p) for p in pair]
            rows.append((name, alone, beside, embeds, two))

    print(f"\n{Path(args.model).name}, {args.threads} threads; decode tok/s, embedding batches/s of 8 sentences")
    print("| wait policy | alone | beside an embedding process | two decoding processes |")
    print("|---|---:|---:|---:|")
    for name, alone, beside, embeds, two in rows:
        print(f"| {name} | {alone:.1f} | {beside:.1f} (embedding {embeds:.0f}/s) | {two[0]:.1f} + {two[1]:.1f} |")
    print("\nreproduce: .venv/bin/python -m scripts.bench.core_sharing" + "".join(
        f" {a}" for a in sys.argv[1:]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
