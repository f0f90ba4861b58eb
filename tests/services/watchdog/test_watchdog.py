"""The watchdog's logic without a running stack: big-core detection, restart decisions and backoff, docker backend."""

from __future__ import annotations

from pathlib import Path

import pytest

from shared.health import ServiceStatus
from services.watchdog.backends import PROJECT_LABEL, SERVICE_LABEL, BackendError, DockerBackend
from services.watchdog.priority import big_cores
from services.watchdog.supervisor import Supervisor
from shared.config import SERVICE_NAMES, ConfigError, parse_config


def fake_sysfs(root: Path, max_freqs: dict[int, int | None]) -> Path:
    for cpu, freq in max_freqs.items():
        d = root / "devices" / "system" / "cpu" / f"cpu{cpu}"
        d.mkdir(parents=True)
        if freq is not None:
            (d / "cpufreq").mkdir()
            (d / "cpufreq" / "cpuinfo_max_freq").write_text(f"{freq}\n")
    (root / "devices" / "system" / "cpu" / "cpufreq").mkdir()  # siblings that are not cores are ignored
    return root


def test_big_cores_are_the_fastest_ones(tmp_path):
    # RK3588-like: 4 little A55 at 1.8 GHz, 4 big A76 at 2.4 GHz
    root = fake_sysfs(tmp_path, {0: 1800000, 1: 1800000, 2: 1800000, 3: 1800000,
                                 4: 2400000, 5: 2400000, 6: 2400000, 7: 2400000})
    cores, why = big_cores(root)
    assert cores == {4, 5, 6, 7} and "4 of 8" in why
    assert big_cores(root, allowed={0, 1, 5})[0] == {5}  # only CPUs we may run on


def test_equal_or_missing_frequencies_mean_no_pinning(tmp_path):
    cores, why = big_cores(fake_sysfs(tmp_path / "eq", {0: 2000000, 1: 2000000}))
    assert cores is None and "same max frequency" in why
    cores, why = big_cores(fake_sysfs(tmp_path / "none", {0: None, 1: None}))
    assert cores is None and "no cpu*/cpufreq" in why
    assert big_cores(tmp_path / "absent")[0] is None


class FakeBackend:
    """Processes as a dict: name -> pid (None = dead); records what the supervisor asked for."""

    kind = "fake"
    replaces_exited = False

    def __init__(self):
        self.pids = {name: 100 + i for i, name in enumerate(SERVICE_NAMES)}
        self.memory = {name: 50.0 for name in SERVICE_NAMES}
        self.calls: list[tuple] = []
        self.next_pid = 1000

    def pid(self, name):
        return self.pids[name]

    def memory_mb(self, name):
        return self.memory[name]

    def _new(self, name):
        self.next_pid += 1
        self.pids[name] = self.next_pid

    def start(self, name):
        self.calls.append(("start", name))
        self._new(name)

    def restart(self, name, hard):
        self.calls.append(("restart", name, hard))
        self._new(name)

    def set_nice(self, name, nice):
        self.calls.append(("nice", name, nice))
        raise PermissionError("not allowed")

    def pin(self, name, cpus):
        self.calls.append(("pin", name, tuple(sorted(cpus))))


class Clock:
    def __init__(self):
        self.now = 1000.0

    def __call__(self):
        return self.now


class Log:
    def __init__(self):
        self.events: list[tuple[str, dict]] = []

    def _record(self, event, **kw):
        self.events.append((event, kw))

    info = warning = error = _record

    def named(self, event):
        return [kw for e, kw in self.events if e == event]


@pytest.fixture(autouse=True)
def any_cpu_allowed(monkeypatch):
    """The fake sysfs trees name CPUs this test process may not be allowed to use."""
    monkeypatch.setattr("services.watchdog.supervisor.allowed_cpus", lambda: None)


def make_supervisor(tmp_path, watchdog: dict | None = None, healthy=None):
    config = parse_config({"watchdog": {"sysfs_root": str(fake_sysfs(tmp_path, {0: 1000, 1: 2000})),
                                        "backoff_reset_s": 30, **(watchdog or {})}})
    backend, clock, log = FakeBackend(), Clock(), Log()
    healthy = healthy if healthy is not None else {name: True for name in SERVICE_NAMES}
    probe = lambda name: ServiceStatus(name, healthy[name], {}, None if healthy[name] else "timeout: no reply")
    return Supervisor(config, backend, log, probe=probe, clock=clock), backend, clock, log, healthy


def test_dead_service_restarts_with_doubling_backoff_that_resets(tmp_path):
    sup, backend, clock, log, _ = make_supervisor(tmp_path, {"backoff_max_s": 4})
    sup.tick()
    assert all(r["state"] == "healthy" for r in sup.status()["services"].values())
    starts = []
    for _ in range(40):  # tools dies right after each restart, for 40 beats of 0.5 s
        backend.pids["tools"] = None
        sup.tick()
        if backend.calls and backend.calls[-1] == ("start", "tools"):
            starts.append(clock.now)
            backend.calls.clear()
        clock.now += 0.5
    gaps = [b - a for a, b in zip(starts, starts[1:])]
    assert gaps[:4] == [1.0, 2.0, 4.0, 4.0]  # 1 s doubling, capped at backoff_max_s
    tools = sup.status()["services"]["tools"]
    assert tools["restarts"] == len(starts) and tools["last_reason"] == "dead"
    restarted = log.named("service_restarted")
    assert restarted[-1]["service"] == "tools" and restarted[-1]["attempt"] == len(starts)
    # Healthy for backoff_reset_s: the next death restarts at once again.
    for _ in range(80):
        sup.tick()
        clock.now += 0.5
    assert sup.states["tools"].attempt == 0
    backend.pids["tools"] = None
    sup.tick()
    assert backend.calls[-1] == ("start", "tools") and sup.states["tools"].attempt == 1


def test_hung_service_is_killed_after_hung_checks(tmp_path):
    sup, backend, clock, log, healthy = make_supervisor(tmp_path, {"hung_checks": 3})
    sup.tick()
    healthy["embedding"] = False
    for _ in range(2):
        sup.tick()
        clock.now += 1
    assert ("restart", "embedding", True) not in backend.calls
    assert sup.status()["services"]["embedding"]["state"] == "unhealthy"
    sup.tick()
    assert ("restart", "embedding", True) in backend.calls  # hard: SIGKILL
    assert sup.status()["services"]["embedding"]["last_reason"] == "hung"
    assert sup.status()["services"]["embedding"]["state"] == "starting"


def test_live_process_without_its_socket_is_restarted_at_once(tmp_path):
    sup, backend, _, _, _ = make_supervisor(tmp_path, {"hung_checks": 3})
    sup.tick()
    sup.probe = lambda name: ServiceStatus(name, name != "retrieval", {},
                                           "unavailable: no service listening at ipc://..." if name == "retrieval"
                                           else None)
    sup.tick()  # the process is alive, but no client can reach it: no point in waiting for hung_checks
    assert [c for c in backend.calls if c[0] == "restart"] == [("restart", "retrieval", True)]
    assert sup.states["retrieval"].last_reason == "unreachable"
    sup.tick()  # a restarted one is starting: its socket may not exist yet
    assert len([c for c in backend.calls if c[0] == "restart"]) == 1


def test_a_stopping_service_is_left_to_exit_and_ended_only_past_its_stop_timeout(tmp_path):
    """SIGTERM'd, a service drains and saves (inference: its sessions), its socket closing before it exits: the
    watchdog neither takes that for unreachable nor hung (killing it would lose what it saves) until the stop
    timeout a stopper gives it (runtime.stop_timeout_s) has passed."""
    sup, backend, clock, log, _ = make_supervisor(tmp_path, {"hung_checks": 1})
    sup.tick()
    stopping = ServiceStatus("inference", True, {"stopping": True}, None)
    closed = ServiceStatus("inference", False, {}, "unavailable: no service listening at ipc://...")
    for seen in (stopping, closed, closed):
        sup.probe = lambda name, seen=seen: seen if name == "inference" else ServiceStatus(name, True, {}, None)
        sup.tick()
        clock.now += 2
    assert not [c for c in backend.calls if c[0] in ("restart", "start")]
    assert sup.status()["services"]["inference"]["state"] == "stopping" and log.named("service_stopping")
    backend.pids["inference"] = None  # it has exited: started again (this backend does not replace it)
    sup.tick()
    assert backend.calls[-1] == ("start", "inference") and sup.states["inference"].last_reason == "dead"
    sup.probe = lambda name: stopping if name == "inference" else ServiceStatus(name, True, {}, None)
    sup.tick()  # the new one is told to stop too, and stays
    clock.now += sup.stop_timeout_s + 1
    sup.tick()
    assert backend.calls[-1] == ("restart", "inference", True) and sup.states["inference"].last_reason == "hung"


def test_a_platform_that_replaces_exited_services_is_left_to_it_and_a_hung_one_is_still_ended(tmp_path):
    """Swarm replaces a task that exits: the watchdog must not start one beside it, nor count its work."""
    healthy = {name: True for name in SERVICE_NAMES}
    sup, backend, clock, log, _ = make_supervisor(tmp_path, healthy=healthy)
    backend.replaces_exited = True
    sup.tick()
    backend.calls.clear()  # inference prioritized
    backend.pids["tools"] = None  # the task exited; Swarm is replacing it
    for _ in range(10):
        clock.now += 2
        sup.tick()
    assert backend.calls == [] and sup.status()["services"]["tools"]["state"] == "dead"
    assert sup.status()["services"]["tools"]["restarts"] == 0
    backend.pids["tools"] = 4242  # Swarm's new task answers
    sup.tick()
    healthy["tools"] = False  # ... then hangs
    for _ in range(5):
        clock.now += 2
        sup.tick()
    assert ("restart", "tools", True) in backend.calls
    assert sup.status()["services"]["tools"]["last_reason"] == "hung"


def test_a_process_that_dies_during_its_heartbeat_is_dead_not_unreachable(tmp_path):
    """SIGKILL closes the socket before the process is gone from the table: the probe fails first."""
    sup, backend, _, _, _ = make_supervisor(tmp_path)
    sup.tick()

    def probe_as_it_dies(name):
        if name == "tools":
            backend.pids["tools"] = None  # gone by the time the supervisor looks again
            return ServiceStatus(name, False, {}, "unavailable: no service listening at ipc://...")
        return ServiceStatus(name, True, {})
    sup.probe = probe_as_it_dies
    sup.tick()
    assert sup.states["tools"].last_reason == "dead" and ("start", "tools") in backend.calls


def test_slow_start_is_not_hung_until_start_timeout(tmp_path):
    sup, backend, clock, _, healthy = make_supervisor(tmp_path, {"hung_checks": 1, "start_timeout_s": 10})
    healthy["inference"] = False  # loading its model
    for _ in range(10):
        sup.tick()
        clock.now += 1
    assert not [c for c in backend.calls if c[1] == "inference"]
    clock.now += 1
    sup.tick()
    assert ("restart", "inference", True) in backend.calls
    assert sup.states["inference"].last_reason == "start_timeout"


def test_memory_ceiling_restarts_gracefully(tmp_path):
    sup, backend, _, log, _ = make_supervisor(
        tmp_path, {"memory_ceiling_mb": 1000, "service_memory_ceiling_mb": {"optimizer": 40}})
    assert sup.ceiling_mb("optimizer") == 40 and sup.ceiling_mb("tools") == 1000
    sup.tick()
    assert ("restart", "optimizer", False) in backend.calls  # graceful: it drains first
    assert [c for c in backend.calls if c[0] == "restart"] == [("restart", "optimizer", False)]
    assert log.named("memory_ceiling_exceeded")[0]["service"] == "optimizer"
    assert sup.status()["services"]["optimizer"]["last_reason"] == "memory"


def test_inference_priority_applied_per_process_and_refusal_warned_once(tmp_path):
    sup, backend, clock, log, _ = make_supervisor(tmp_path)
    assert sup.cores == {1}  # the fake sysfs: cpu1 is faster
    sup.tick()
    sup.tick()
    assert backend.calls.count(("pin", "inference", (1,))) == 1  # once per process, not per beat
    backend.pids["inference"] = None
    for _ in range(3):
        sup.tick()
        clock.now += 1
    assert backend.calls.count(("pin", "inference", (1,))) == 2  # again after the restart
    assert backend.calls.count(("nice", "inference", -5)) == 2
    assert len(log.named("inference_priority_not_applied")) == 1


def test_default_ceiling_is_a_share_of_physical_memory(tmp_path):
    sup, *_ = make_supervisor(tmp_path)
    import psutil
    assert sup.ceiling_mb("inference") == pytest.approx(0.75 * psutil.virtual_memory().total / 2**20)


@pytest.mark.parametrize("data,needle", [
    ({"watchdog": {"backend": "k8s"}}, "watchdog.backend"),
    ({"watchdog": {"interval_s": 0}}, "watchdog.interval_s"),
    ({"watchdog": {"service_memory_ceiling_mb": {"watchdog": 10}}}, "unknown service"),
    ({"watchdog": {"backoff_initial_s": 10, "backoff_max_s": 5}}, "must be >= backoff_initial_s"),
    ({"watchdog": {"inference_nice": -40}}, "watchdog.inference_nice"),
])
def test_bad_watchdog_config_is_named(data, needle):
    with pytest.raises(ConfigError, match=needle):
        parse_config(data)


# --- docker backend against a fake docker client -----------------------------------------------

class FakeContainer:
    def __init__(self, service, project, status="running", pid=4242):
        self.labels = {SERVICE_LABEL: service, PROJECT_LABEL: project}
        self.status = status
        self.attrs = {"State": {"Pid": pid}}
        self.calls: list[tuple] = []

    def stats(self, **kw):
        self.calls.append(("stats", kw))
        return {"memory_stats": {"usage": 300 * 2**20, "stats": {"inactive_file": 100 * 2**20}}}

    def __getattr__(self, action):  # start, kill, restart, update
        return lambda **kw: self.calls.append((action, kw))


class FakeContainers:
    def __init__(self, containers):
        self.containers = containers

    def list(self, all=False, filters=None):
        wanted = dict(label.split("=", 1) for label in filters["label"])
        return [c for c in self.containers if all and wanted.items() <= c.labels.items()]


class FakeDockerClient:
    def __init__(self, containers):
        self.containers = FakeContainers(containers)


def test_docker_backend_finds_containers_by_compose_labels():
    ours = FakeContainer("inference", "magnitude")
    other = FakeContainer("inference", "someone-else", pid=1)
    stopped = FakeContainer("tools", "magnitude", status="exited")
    backend = DockerBackend(FakeDockerClient([other, ours, stopped]), project="magnitude", stop_timeout_s=30)
    assert backend.pid("inference") == 4242
    assert backend.pid("tools") is None  # exited: dead
    assert backend.memory_mb("inference") == 200  # usage minus inactive page cache, like `docker stats`
    assert ours.calls[0] == ("stats", {"stream": False, "one_shot": True})
    with pytest.raises(BackendError, match="com.docker.compose.service=retrieval"):
        backend.pid("retrieval")


def test_docker_backend_restarts_kills_and_pins():
    inference, tools = FakeContainer("inference", "p"), FakeContainer("tools", "p", status="exited")
    restarting = FakeContainer("optimizer", "p", status="restarting")
    backend = DockerBackend(FakeDockerClient([inference, tools, restarting]), project="p", stop_timeout_s=30)
    backend.restart("inference", hard=False)
    assert inference.calls[-1] == ("restart", {"timeout": 30})
    backend.restart("inference", hard=True)
    assert [c[0] for c in inference.calls[-2:]] == ["kill", "start"]
    backend.start("tools")
    assert tools.calls == [("start", {})]
    backend.start("optimizer")  # docker's restart policy is on it already
    assert restarting.calls == []
    backend.pin("inference", {6, 4, 5, 7})
    assert inference.calls[-1] == ("update", {"cpuset_cpus": "4,5,6,7"})
    with pytest.raises(NotImplementedError):
        backend.set_nice("inference", -5)


def test_backend_choice_and_an_unreachable_docker_api(monkeypatch, tmp_path):
    from services.watchdog import backends
    monkeypatch.delenv("MAGNITUDE_WATCHDOG_BACKEND", raising=False)
    monkeypatch.setattr(backends, "DOCKER_SOCKET", tmp_path / "no-docker.sock")
    assert backends.choose_backend(parse_config({}))[0] == "local"  # auto without a docker socket
    monkeypatch.setenv("DOCKER_HOST", f"unix://{tmp_path}/no-docker.sock")
    config = parse_config({"watchdog": {"backend": "docker"}})
    assert backends.choose_backend(config) == ("docker", "watchdog.backend")
    with pytest.raises(ValueError, match="watchdog.backend docker: cannot reach the Docker API"):
        backends.make_backend("docker", config, None)


class FakeDockerAPI:
    """docker.from_env() of a box whose engine answers; ``own`` is the container this process runs in."""

    def __init__(self, own: FakeContainer | None):
        import docker
        self.containers = self
        self.own, self.errors = own, docker.errors

    def ping(self):
        return True

    def get(self, container_id):
        if self.own is None:
            raise self.errors.NotFound(f"no such container: {container_id}")
        return self.own


@pytest.fixture
def container_with_docker_socket(monkeypatch, tmp_path):
    """This process in a container that has /var/run/docker.sock; the test says which container it is."""
    from services.watchdog import backends
    monkeypatch.delenv("MAGNITUDE_WATCHDOG_BACKEND", raising=False)
    socket_path = tmp_path / "docker.sock"
    socket_path.touch()
    monkeypatch.setattr(backends, "DOCKER_SOCKET", socket_path)
    monkeypatch.setattr(backends, "in_container", lambda: True)

    def be_in(own: FakeContainer | None):
        monkeypatch.setattr("docker.from_env", lambda: FakeDockerAPI(own))
    return be_in


def test_auto_on_a_dev_box_container_with_a_docker_socket_is_local(container_with_docker_socket):
    """The bug this guards: a dev machine that is a container with a docker socket picked docker for the
    processes of `magnitude up`, and supervised nothing. Only a compose container means docker."""
    from services.watchdog.backends import choose_backend
    container_with_docker_socket(None)  # the engine does not know this container (it runs elsewhere)
    assert choose_backend(parse_config({})) == ("local", "watchdog.backend auto: not a compose container")
    unlabelled = FakeContainer("x", "p")
    unlabelled.labels = {}  # a container the engine knows, but not one of a compose project
    container_with_docker_socket(unlabelled)
    assert choose_backend(parse_config({}))[0] == "local"
    container_with_docker_socket(FakeContainer("watchdog", "magnitude"))
    kind, why = choose_backend(parse_config({}))
    assert kind == "docker" and "compose container" in why


def test_whoever_starts_the_watchdog_passes_its_backend(container_with_docker_socket, monkeypatch):
    from services.watchdog import backends
    container_with_docker_socket(FakeContainer("watchdog", "magnitude"))  # auto alone would say docker
    monkeypatch.setenv("MAGNITUDE_WATCHDOG_BACKEND", "local")  # what `magnitude up` passes
    for configured in ("auto", "docker"):
        config = parse_config({"watchdog": {"backend": configured}})
        assert backends.choose_backend(config) == ("local", "$MAGNITUDE_WATCHDOG_BACKEND")
        assert backends.make_backend("local", config, None).kind == "local"
    monkeypatch.setenv("MAGNITUDE_WATCHDOG_BACKEND", "docker")  # what compose.yaml passes
    assert backends.choose_backend(parse_config({"watchdog": {"backend": "local"}}))[0] == "docker"
    monkeypatch.setenv("MAGNITUDE_WATCHDOG_BACKEND", "k8s")
    with pytest.raises(ValueError, match="MAGNITUDE_WATCHDOG_BACKEND='k8s'"):
        backends.choose_backend(parse_config({}))


def test_launcher_passes_the_local_backend_to_the_watchdog_only():
    from magnitude.launcher import PROCESS_ENV
    from shared.config import WATCHDOG_NAME
    assert PROCESS_ENV == {WATCHDOG_NAME: {"MAGNITUDE_WATCHDOG_BACKEND": "local"}}
