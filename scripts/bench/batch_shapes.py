"""What a llama_decode costs by batch shape and KV layout: the measurements behind the scheduler's choices.

On the bundled model, with 8 sequences of 700 tokens each in one context, it times (median of ``--reps``):

* one decode step of 1, 4 and 8 sequences, in increasing sequence order, shuffled, and with gaps;
* 4 decodes plus a 64- or 256-token prompt chunk of another sequence, together and apart;
* copying a 700-token prefix into another sequence: ``llama_memory_seq_cp`` (a whole KV stream) against
  ``llama_state_seq_get_data`` + ``set_data`` (only that sequence's cells);

once with one KV stream per sequence (``kv_unified`` off, what the engine uses) and once with one unified
buffer. It checks that logits do not depend on how a prompt was cut into batches, and prints where they do.
And it times 4-sequence decode steps on a worker thread, in a fresh process each: with no decode on any other
thread before, and after one decode on the main thread (llama.cpp's CPU backend runs on OpenMP, which keeps a
thread pool per calling thread).

    .venv/bin/python -m scripts.bench.batch_shapes [--reps 10] [--threads 2]
"""

from __future__ import annotations

import argparse
import ctypes
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

import llama_cpp
import numpy as np
from llama_cpp import _internals

from scripts.bench.common import BENCH_MODEL
from scripts.bench import REPO

N_SEQ, HISTORY = 8, 700


@llama_cpp.llama_log_callback
def _silent(level: int, text: bytes, user_data: ctypes.c_void_p) -> None:
    pass


class Context:
    def __init__(self, model: _internals.LlamaModel, unified: bool, threads: int):
        params = llama_cpp.llama_context_default_params()
        params.n_ctx, params.n_seq_max, params.kv_unified, params.swa_full = 4096 * N_SEQ, N_SEQ, unified, True
        params.n_batch = params.n_ubatch = 512
        params.n_threads = params.n_threads_batch = threads
        self.model = model
        self.ctx = _internals.LlamaContext(model=model, params=params, verbose=False)
        self.mem = llama_cpp.llama_get_memory(self.ctx.ctx)
        self.batch = llama_cpp.llama_batch_init(512, 0, 1)

    def decode(self, rows: list[tuple[int, int, list[int], bool]]) -> None:
        """rows: (sequence, first position, tokens, logits for every token)."""
        n = 0
        for seq, pos0, tokens, all_logits in rows:
            for i, tok in enumerate(tokens):
                b = self.batch
                b.token[n], b.pos[n], b.n_seq_id[n], b.seq_id[n][0] = tok, pos0 + i, 1, seq
                b.logits[n] = all_logits or i == len(tokens) - 1
                n += 1
        self.batch.n_tokens = n
        if llama_cpp.llama_decode(self.ctx.ctx, self.batch) != 0:
            raise RuntimeError("llama_decode failed")

    def trim(self, seq: int, keep: int) -> None:
        llama_cpp.llama_memory_seq_rm(self.mem, seq, keep, -1)

    def logits(self, i: int) -> np.ndarray:
        return np.ctypeslib.as_array(llama_cpp.llama_get_logits_ith(self.ctx.ctx, i),
                                     shape=(self.model.n_vocab(),)).copy()


def timed(reps: int, run) -> float:
    run()  # warm
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        run()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1000


def shapes(c: Context, reps: int) -> dict[str, float]:
    tokens = list(range(1000, 1000 + HISTORY))
    for seq in range(N_SEQ):
        for start in range(0, HISTORY, 256):
            c.decode([(seq, start, tokens[start:start + 256], False)])

    def step(decoding: list[int], chunk: tuple[int, int] | None = None):
        def run():
            rows = [(s, HISTORY, [5], True) for s in decoding]
            if chunk:
                rows.append((chunk[0], HISTORY, [7] * chunk[1], False))
            c.decode(sorted(rows) if decoding == sorted(decoding) else rows)
            for s, *_ in rows:
                c.trim(s, HISTORY)
        return run

    out = {
        "decode 1 sequence": timed(reps, step([0])),
        "decode 4, in order 0-3": timed(reps, step([0, 1, 2, 3])),
        "decode 4, order 3,1,0,2": timed(reps, step([3, 1, 0, 2])),
        "decode 4, gaps 0,2,4,6": timed(reps, step([0, 2, 4, 6])),
        "decode 8": timed(reps, step(list(range(8)))),
        "prefill 64 alone": timed(reps, step([], (7, 64))),
        "4 decodes + prefill 64": timed(reps, step([0, 1, 2, 3], (7, 64))),
        "prefill 256 alone": timed(max(3, reps // 3), step([], (7, 256))),
        "4 decodes + prefill 256": timed(max(3, reps // 3), step([0, 1, 2, 3], (7, 256))),
    }

    def copy_stream():
        llama_cpp.llama_memory_seq_cp(c.mem, 0, 6, -1, -1)  # across streams: the whole buffer, at the next decode
        c.trim(6, 600)
        c.decode([(6, 600, [9], True)])
        c.trim(6, 0)

    def copy_state():
        size = llama_cpp.llama_state_seq_get_size(c.ctx.ctx, 0)
        buf = (ctypes.c_uint8 * size)()
        n = llama_cpp.llama_state_seq_get_data(c.ctx.ctx, buf, size, 0)
        llama_cpp.llama_state_seq_set_data(c.ctx.ctx, buf, n, 6)
        c.trim(6, 600)
        c.decode([(6, 600, [9], True)])
        c.trim(6, 0)

    def one_token():
        c.decode([(6, 0, [9], True)])
        c.trim(6, 0)

    c.trim(6, 0)  # sequence 6 receives the copies
    base = timed(reps, one_token)
    out["copy 700-token KV: seq_cp (+1 decode)"] = timed(reps, copy_stream) - base
    out["copy 700-token KV: state get/set (+1 decode)"] = timed(reps, copy_state) - base
    return out


def split_effects(c: Context, prompt: list[int]) -> list[tuple[int, float]]:
    """Largest logit difference when ``prompt`` is evaluated as [first n] + [rest] instead of in one batch."""
    c.trim(0, 0)
    c.decode([(0, 0, prompt, False)])
    whole = c.logits(len(prompt) - 1)
    out = []
    for n in (8, 16, 24, 30, 31, 32, 33, 40):
        c.trim(1, 0)
        c.decode([(1, 0, prompt[:n], False)])
        c.decode([(1, n, prompt[n:], False)])
        out.append((n, float(np.abs(whole - c.logits(len(prompt) - n - 1)).max())))
    return out


def worker_thread_steps(model: _internals.LlamaModel, threads: int, main_first: bool, reps: int) -> float:
    """ms per 4-sequence decode step run on a worker thread (``main_first``: after one decode on the main thread)."""
    c = Context(model, False, threads)
    if main_first:
        c.decode([(7, 0, [2], True)])
    result = []

    def work() -> None:
        for seq in range(4):
            c.decode([(seq, 0, list(range(1000, 1256)), False)])
        steps = [(s, 256, [5], True) for s in range(4)]
        result.append(timed(reps * 3, lambda: (c.decode(steps), [c.trim(s, 256) for s in range(4)])))

    worker = threading.Thread(target=work)
    worker.start()
    worker.join()
    return result[0]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--reps", type=int, default=10)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--model", default=str(BENCH_MODEL))
    parser.add_argument("--thread-case", choices=["clean", "main-first"], help=argparse.SUPPRESS)  # a child run
    args = parser.parse_args()
    llama_cpp.llama_log_set(_silent, ctypes.c_void_p(0))
    llama_cpp.llama_backend_init()
    model = _internals.LlamaModel(path_model=args.model, params=_internals.LlamaModel.default_params(),
                                  verbose=False)
    if args.thread_case:
        print(worker_thread_steps(model, args.threads, args.thread_case == "main-first", args.reps))
        return 0
    results = {}
    for unified in (False, True):
        print(f"measuring kv_unified={unified} ...", file=sys.stderr, flush=True)
        results[unified] = shapes(Context(model, unified, args.threads), args.reps)
    print(f"\nms per llama_decode (median of {args.reps}), {N_SEQ} sequences of {HISTORY} tokens, "
          f"{args.threads} threads, {Path(args.model).name}")
    print(f"{'':<46}{'per-sequence KV':>16}{'unified KV':>12}")
    for name in results[False]:
        print(f"{name:<46}{results[False][name]:>16.1f}{results[True][name]:>12.1f}")
    prompt = model.tokenize(b"<start_of_turn>user\nYou are robot ra. Name three rooms of a house, ra."
                            b"<end_of_turn>\n<start_of_turn>model\nKitchen, bedroom, bathroom.<end_of_turn>\n"
                            b"<start_of_turn>user\nWhich one is the largest?<end_of_turn>\n<start_of_turn>model\n",
                            add_bos=True, special=True)
    print(f"\nlargest logit difference, a {len(prompt)}-token prompt cut after n tokens vs in one batch:")
    print("  " + ", ".join(f"n={n}: {d:.3f}" for n, d in split_effects(Context(model, False, args.threads), prompt)))
    child = [sys.executable, "-m", __spec__.name, "--threads", str(args.threads), "--reps", str(args.reps),
             "--model", args.model]
    per_case = {case: float(subprocess.run(child + ["--thread-case", case], check=True, capture_output=True,
                                           text=True, cwd=REPO).stdout.split()[-1]) for case in ("clean", "main-first")}
    print(f"\n4-sequence decode step on a worker thread: {per_case['clean']:.1f} ms; after one decode on the "
          f"main thread (a second OpenMP pool): {per_case['main-first']:.1f} ms")
    print("\nreproduce: .venv/bin/python -m scripts.bench.batch_shapes " + " ".join(sys.argv[1:]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
