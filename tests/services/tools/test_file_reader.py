"""file_reader under attack (issue 34, finding 7): a directory swapped for a symlink while it is read, names
the kernel would cut short, kernel interfaces under a broad root; on openat2 and on the walk that stands in
for it where the kernel refuses openat2.
"""

from __future__ import annotations

import errno
import os
import threading
import time
from pathlib import Path

import pytest

from services.tools import beneath, builtins
from shared.protocol import ErrorCode, ProtocolError


def _refused_by_kernel(*_args):
    raise OSError(errno.ENOSYS, os.strerror(errno.ENOSYS))


def _no_walk(*_args):
    raise AssertionError("the walk ran: openat2 was refused here")


@pytest.fixture(params=["openat2", "walk"])
def opener(request, monkeypatch):
    """Which of beneath's two ways opens: the other one fails if it is ever used."""
    monkeypatch.setattr(beneath, "openat2_works", True)
    if request.param == "openat2":
        monkeypatch.setattr(beneath, "_walk", _no_walk)
    else:
        monkeypatch.setattr(beneath, "_openat2", _refused_by_kernel)
    return request.param


def read(path: str, root: Path | str) -> str:
    return builtins.read_file(path, [Path(root)], 10000, [])


def refusal(path: str, root: Path | str) -> str:
    with pytest.raises(ProtocolError) as info:
        read(path, root)
    assert info.value.code == ErrorCode.TOOL_FAILED and info.value.message.startswith("refused:"), info.value
    return info.value.message


def test_a_directory_swapped_for_a_symlink_never_leads_outside(tmp_path, opener):
    """The finding: the path was resolved, then opened, and O_NOFOLLOW guarded only the last component, so a
    directory swapped for a symlink in between escaped the root (47 times in 10 s)."""
    root, outside = tmp_path / "root", tmp_path / "outside"
    (root / "d").mkdir(parents=True)
    outside.mkdir()
    (root / "d" / "f.txt").write_text("inside")
    (outside / "f.txt").write_text("OUTSIDE SECRET")
    stop = threading.Event()

    def swap():
        while not stop.is_set():
            os.rename(root / "d", root / "d.real")
            os.symlink(outside, root / "d")
            os.unlink(root / "d")
            os.rename(root / "d.real", root / "d")

    swapper = threading.Thread(target=swap, daemon=True)
    swapper.start()
    reads = refused = escapes = 0
    deadline = time.monotonic() + 10
    try:
        while time.monotonic() < deadline:
            try:
                output = read("d/f.txt", root)
            except ProtocolError as err:
                assert err.code == ErrorCode.TOOL_FAILED and err.message.startswith("refused:"), err
                refused += 1
                continue
            reads += 1
            escapes += output != "inside"
    finally:
        stop.set()
        swapper.join()
    assert escapes == 0, f"{escapes} escapes in {reads} reads ({refused} refused)"
    assert reads > 0 and refused > 0, (reads, refused)  # the reader met both states of the swap


def test_every_refusal_is_typed_and_names_its_reason(tmp_path, opener):
    """A NUL byte raised an untyped ``internal`` (and would cut the name short in the kernel)."""
    root = tmp_path / "root"
    (root / "d").mkdir(parents=True)
    (root / "d" / "f.txt").write_text("inside")
    (tmp_path / "secret.txt").write_text("OUTSIDE SECRET")
    os.symlink(tmp_path, root / "up")
    os.symlink("d/f.txt", root / "alias.txt")
    os.mkfifo(root / "pipe")
    (root / "big.txt").write_text("x" * 10001)
    assert read("d/f.txt", root) == "inside"
    for path, why in (("d/f.txt\0.png", "NUL byte"), ("up/secret.txt", "symlink"), ("alias.txt", "symlink"),
                      ("pipe", "not a regular file"), ("d", "not a regular file"), ("big.txt", "the limit is 10000"),
                      ("d/missing.txt", "no such file"), ("d/f.txt/x", "not a directory"),
                      ("../secret.txt", "contains '..'"), (str(tmp_path / "secret.txt"), "outside the allowed roots")):
        assert why in refusal(path, root), path


def test_proc_sys_and_dev_are_never_read_even_under_root_slash(opener):
    """With a broad root /proc/self/environ was readable (the MCP header secrets are in the environment), and
    /proc/self/mem raised an untyped ``internal``."""
    for path in ("/proc/self/environ", "proc/self/environ", "/proc/self/mem", "/proc/1/cmdline",
                 "/sys/kernel/mm/transparent_hugepage/enabled", "/dev/null", "/dev/shm"):
        assert "/proc, /sys or /dev" in refusal(path, "/"), path
    assert "/proc, /sys or /dev" in refusal("self/environ", "/proc")  # a root inside them shows nothing either
    assert read("/etc/passwd", "/") == Path("/etc/passwd").read_text()  # the rest of a broad root reads
