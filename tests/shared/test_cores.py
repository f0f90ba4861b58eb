"""The core lease: one llama.cpp computation at a time across the stack's processes, never left taken."""

from __future__ import annotations

import subprocess
import sys
import threading
import time

import pytest

from shared.client import Client, ServiceError
from shared.config import parse_config
from shared.cores import CoreLease, stack_lease
from shared.security import private_dir
from tests.conftest import MODEL_PATH, REPO, ServiceProcess, make_config, require_model, write_config

HOLD = """
import sys, time
from pathlib import Path
sys.path.insert(0, {repo!r})
from shared.cores import CoreLease
lease = CoreLease(Path({path!r}))
lease.__enter__()
print("held", flush=True)
time.sleep(60)
"""


def _holder(lock_path):
    """Another process (the other service) that holds the lease until killed."""
    proc = subprocess.Popen([sys.executable, "-c", HOLD.format(repo=str(REPO), path=str(lock_path))],
                            stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "held"
    return proc


def _in_thread(work) -> threading.Event:
    done = threading.Event()

    def run():
        work()
        done.set()
    threading.Thread(target=run, daemon=True).start()
    return done


def _acquire_in_thread(lease: CoreLease) -> threading.Event:
    def take():
        with lease:
            pass
    return _in_thread(take)


def test_a_second_process_waits_and_a_dead_holder_frees_the_lease(tmp_path):
    holder = _holder(tmp_path / "cores.lock")
    lease = CoreLease(tmp_path / "cores.lock")
    try:
        got = _acquire_in_thread(lease)
        assert not got.wait(0.5), "the lease was taken while another process held it"
        holder.kill()  # a crashed service: the kernel drops its lock
        holder.wait()
        assert got.wait(5), "a dead holder left the lease taken"
    finally:
        holder.kill()
        lease.close()


def test_threads_of_one_process_take_turns(tmp_path):
    lease = CoreLease(tmp_path / "cores.lock")
    try:
        with lease:
            got = _acquire_in_thread(lease)
            time.sleep(0.3)
            assert not got.is_set(), "two threads of one process held the lease at once"
        assert got.wait(5)
    finally:
        lease.close()


@pytest.mark.model
def test_inference_and_embedding_compute_only_with_the_lease(run_home):
    """While another process holds the stack's lease, neither a decode nor an embedding batch runs."""
    from services.embedding.service import Embedder
    from services.inference.engine import Engine
    require_model(MODEL_PATH)
    config = make_config(run_home, session_slots=1)
    lease = stack_lease(config)
    engine = Engine(config.engine, core_lease=lease)
    embedder = Embedder(config)
    holder = _holder(lease.path)
    try:
        decoded = _in_thread(engine.warm_up)
        embedded = _in_thread(lambda: embedder.embed(["the spare keys are in the blue bowl"]))
        time.sleep(1.0)
        assert not decoded.is_set() and not embedded.is_set(), "computed while another process held the lease"
        holder.kill()
        holder.wait()
        assert decoded.wait(60) and embedded.wait(60), "the lease was not released with its holder"
    finally:
        holder.kill()
        embedder.close()
        engine.close()
        lease.close()


@pytest.mark.model
def test_a_holder_that_never_lets_go_costs_requests_busy_naming_it_never_the_services(run_home):
    """A holder that hangs (a stopped process, a native call that never returns): inference and embedding wait
    runtime.core_lease_wait_s, then answer the requests that needed the cores ``busy`` naming the holder's pid,
    stay healthy, and compute again once it is gone. On 29a46bc they waited for ever."""
    require_model(MODEL_PATH)
    home = run_home / "lease-deadline"
    home.mkdir()
    base = make_config(home, session_slots=1).model_dump(mode="json")
    config = parse_config({**base, "runtime": {**base["runtime"], "core_lease_wait_s": 0.5}})
    path = write_config(home, config)
    holder = _holder(private_dir(config.runtime.run_dir()) / "cores.lock")
    services = []
    try:
        services = [ServiceProcess(name, path, config).start() for name in ("inference", "embedding")]
        with Client(services[0].endpoint, timeout_s=30) as inference, \
                Client(services[1].endpoint, timeout_s=30) as embedding:
            calls = [lambda: inference.generate("The robot", max_tokens=2),
                     lambda: embedding.request("embed", {"texts": ["the spare keys are in the blue bowl"]})]
            for call in calls:
                started = time.monotonic()
                with pytest.raises(ServiceError) as err:
                    call()
                assert err.value.code == "busy" and f"process {holder.pid} holds" in err.value.message, err.value
                assert time.monotonic() - started < 10
            assert inference.health()["ok"] and embedding.health()["ok"]
            holder.kill()
            holder.wait()
            assert inference.generate("The robot", max_tokens=2).stats.completion_tokens == 2
            assert embedding.request("embed", {"texts": ["the spare keys are in the blue bowl"]})["tokens"] > 0
        for svc in services:
            assert f'"holder_pid": {holder.pid}' in svc.log.read_text()  # the log says whom it waited for
    finally:
        holder.kill()
        for svc in reversed(services):
            svc.stop()
