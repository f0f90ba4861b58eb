"""The tool service and its sandbox, as a real process: built-ins, file_reader confinement, misbehaving tools.

Every hostile case must end in a typed error (or a cut-off with a note) within
its limit, and the service must answer health afterwards.
"""

from __future__ import annotations

import os
import time

import pytest

from shared.client import Client, ServiceError
from shared.config import parse_config
from tests.conftest import ServiceProcess, write_config

TOOL_MODULE = '''
import sys, time
def sleepy():
    time.sleep(3600)
def flood():
    chunk = "x" * 65536
    for _ in range(1600):  # 100 MiB
        sys.stdout.write(chunk)
def hog():
    blocks = []
    while True:
        blocks.append(bytearray(1 << 20))
def boom(reason):
    raise RuntimeError(reason)
def double(x):
    return {"doubled": x * 2}
'''


def _py(name, fn, props=None, limits=None):
    return {"name": name, "kind": "python", "target": f"{{module}}:{fn}", "limits": limits or {},
            "parameters": {"type": "object", "properties": props or {}, "additionalProperties": False}}


@pytest.fixture(scope="module")
def tools(run_home):
    home = run_home / "tools"
    root = home / "root"
    (root / "sub").mkdir(parents=True)
    (root / "notes.txt").write_text("buy milk\n")
    (root / "sub" / "deep.txt").write_text("deep\n")
    (root / "long.txt").write_text("y" * 5000)
    (root / "big.bin").write_bytes(b"z" * 20000)
    (home / "secret.txt").write_text("top secret\n")
    os.symlink(home / "secret.txt", root / "escape.txt")
    os.symlink(root / "notes.txt", root / "alias.txt")
    os.symlink("/dev/zero", root / "zero")
    os.mkfifo(root / "pipe")
    module = home / "misbehaving.py"
    module.write_text(TOOL_MODULE)
    specs = [_py("sleepy", "sleepy", limits={"timeout_s": 1.5}),
             _py("flood", "flood", limits={"max_output_bytes": 4096}),
             _py("hog", "hog", limits={"memory_mb": 128}),
             _py("boom", "boom", {"reason": {"type": "string"}}),
             _py("double", "double", {"x": {"type": "integer"}})]
    for s in specs:
        s["target"] = s["target"].format(module=module)
    specs.append({"name": "shout", "kind": "shell", "target": "echo said: {text}",
                  "parameters": {"type": "object", "properties": {"text": {"type": "string"}}, "required": ["text"]}})
    config = parse_config({
        "agent": {"tools": [{"name": "calculator"}, {"name": "file_reader"}, {"name": "memory_search"}, *specs],
                  "file_roots": [str(root)], "max_file_bytes": 10000, "sandbox": {"max_output_bytes": 2048}},
        "runtime": {"runtime_dir": str(home / "run"), "data_dir": str(home / "data")},
    })
    svc = ServiceProcess("tools", write_config(home, config), config).start()
    client = Client(svc.endpoint, timeout_s=30)
    yield client, root
    client.close()
    svc.stop()


def call(client, tool, **args):
    return client.request("tool.call", {"tool": tool, "args": args})


def failure(client, tool, **args) -> ServiceError:
    with pytest.raises(ServiceError) as info:
        call(client, tool, **args)
    assert client.health()["ok"]  # the service survives every failure
    return info.value


def test_list_describes_every_tool_with_a_schema(tools):
    client, _ = tools
    listed = {t["name"]: t for t in client.request("tool.list")["tools"]}
    assert {"calculator", "file_reader", "memory_search", "sleepy", "shout"} <= set(listed)
    assert listed["calculator"]["parameters"]["required"] == ["expression"]


def test_calculator_evaluates_without_eval(tools):
    client, _ = tools
    assert call(client, "calculator", expression="(3 + 4) * 2 ** 3")["output"] == "56"
    assert call(client, "calculator", expression="sqrt(2)")["output"] == "1.4142135624"
    assert call(client, "calculator", expression="mean([42, 36, 45])")["output"] == "41"
    assert call(client, "calculator", expression="09:15 + 85")["output"] == "10:40"
    for hostile in ("__import__('os').system('id')", "().__class__", "9 ** 9 ** 9", "10 ** 100000",
                    "sum([1] * 10 ** 9)", "[1, 2][5]"):
        err = failure(client, "calculator", expression=hostile)
        assert err.code == "tool_failed"
    assert "ZeroDivisionError" in failure(client, "calculator", expression="1/0").message


def test_arguments_are_validated_against_the_schema(tools):
    client, _ = tools
    assert failure(client, "calculator", expr="1").code == "bad_request"
    assert failure(client, "double", x="two").code == "bad_request"
    assert failure(client, "no_such_tool").code == "not_found"
    assert call(client, "double", x=21)["output"] == '{"doubled": 42}'


def test_file_reader_reads_inside_its_roots(tools):
    client, root = tools
    assert call(client, "file_reader", path="notes.txt")["output"] == "buy milk\n"
    assert call(client, "file_reader", path=str(root / "sub" / "deep.txt"))["output"] == "deep\n"
    long = call(client, "file_reader", path="long.txt")
    assert long["truncated"] and "[output truncated" in long["output"]


@pytest.mark.parametrize("path, why", [
    ("../secret.txt", "contains '..'"),
    ("sub/../../secret.txt", "contains '..'"),
    ("/etc/passwd", "outside the allowed roots"),
    ("escape.txt", "symlink"),
    ("zero", "symlink"),
    ("alias.txt", "symlink"),  # even one that stays inside: openat2's RESOLVE_NO_SYMLINKS (issue 34, finding 7)
    ("pipe", "not a regular file"),
    ("sub", "not a regular file"),
    ("big.bin", "the limit is 10000"),
    ("missing.txt", "no such file"),
    ("notes.txt\0.png", "NUL byte"),
])
def test_file_reader_refuses_escapes_devices_and_big_files(tools, path, why):
    client, _ = tools
    err = failure(client, "file_reader", path=path)
    assert err.code == "tool_failed" and err.message.startswith("refused:") and why in err.message


def test_a_tool_that_sleeps_forever_is_killed_at_its_timeout(tools):
    client, _ = tools
    t0 = time.monotonic()
    err = failure(client, "sleepy")
    assert err.message.startswith("timeout:") and time.monotonic() - t0 < 5


def test_a_tool_that_prints_100_mb_is_cut_off(tools):
    client, _ = tools
    t0 = time.monotonic()
    reply = call(client, "flood")
    assert reply["truncated"] and len(reply["output"]) < 4096 + 200
    assert reply["output"].endswith("and was stopped]") and time.monotonic() - t0 < 5
    assert client.health()["ok"]


def test_a_tool_that_allocates_without_bound_hits_its_memory_limit(tools):
    client, _ = tools
    err = failure(client, "hog")
    assert err.message.startswith("memory_limit:") and "128 MB" in err.message


def test_a_tool_that_raises_reports_its_exception(tools):
    client, _ = tools
    assert failure(client, "boom", reason="disk on fire").message == "raised: RuntimeError: disk on fire"


def test_shell_arguments_are_never_interpreted_by_a_shell(tools):
    client, _ = tools
    out = call(client, "shout", text="$(touch /tmp/pwned); `id` && rm -rf /")["output"]
    assert out == "said: $(touch /tmp/pwned); `id` && rm -rf /\n"


def test_memory_search_without_retrieval_is_a_clear_typed_error(tools):
    client, _ = tools
    err = failure(client, "memory_search", query="keys")
    assert err.code == "tool_failed" and err.message.startswith("unavailable: retrieval service unavailable")


def test_misbehaving_calls_in_parallel_leave_the_service_serving(tools):
    client, _ = tools
    from concurrent.futures import ThreadPoolExecutor

    def one(tool):
        with Client(client.endpoint, timeout_s=30) as c:
            try:
                return call(c, tool)["truncated"]
            except ServiceError as err:
                return err.message.split(":")[0]

    with ThreadPoolExecutor(3) as pool:
        results = list(pool.map(one, ["sleepy", "flood", "hog"]))
    assert results == ["timeout", True, "memory_limit"]
    assert call(client, "calculator", expression="1+1")["output"] == "2"
