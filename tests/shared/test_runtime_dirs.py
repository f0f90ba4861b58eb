"""Runtime and data directories that another uid created first, or can write, are refused with a message that says
what to do; our own are created and kept 0700."""
import os

import pytest

from shared.security import SecurityError, private_dir


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to create a directory as another uid")
def test_directory_owned_by_another_uid_is_refused(tmp_path):
    foreign = tmp_path / "run"
    foreign.mkdir(mode=0o777)
    os.chown(foreign, 65534, 65534)
    with pytest.raises(SecurityError, match="owned by uid 65534"):
        private_dir(foreign)


@pytest.mark.parametrize("mode", [0o777, 0o702, 0o1777])
def test_a_directory_other_accounts_can_write_is_refused_even_if_ours(tmp_path, mode):
    """Whoever could write in it may have put files there already (an API key, a pid file, a database)."""
    shared = tmp_path / "data"
    shared.mkdir()
    shared.chmod(mode)
    with pytest.raises(SecurityError, match=f"writable by other accounts.*chmod 700 {shared}"):
        private_dir(shared)


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to give a directory another group")
def test_a_directory_writable_by_another_group_is_refused_and_by_our_own_group_tightened(tmp_path):
    theirs, ours = tmp_path / "theirs", tmp_path / "ours"
    for path in (theirs, ours):
        path.mkdir()
        path.chmod(0o770)
    os.chown(theirs, os.geteuid(), 65534)
    with pytest.raises(SecurityError, match="writable by other accounts"):
        private_dir(theirs)
    assert (private_dir(ours).stat().st_mode & 0o777) == 0o700  # umask 002 makes these: a user's own group


def test_missing_parents_are_made_private_too(tmp_path):
    """mkdir -p would make them by the umask (0775 under umask 002): the next start would refuse its own data."""
    old = os.umask(0o002)
    try:
        private_dir(tmp_path / "home" / "data" / "keys")
    finally:
        os.umask(old)
    for path in (tmp_path / "home", tmp_path / "home" / "data"):
        assert (path.stat().st_mode & 0o777) == 0o700, path
    private_dir(tmp_path / "home" / "data")


def test_own_directory_is_created_and_tightened(tmp_path):
    path = private_dir(tmp_path / "a" / "b")
    assert (path.stat().st_mode & 0o777) == 0o700
    path.chmod(0o755)
    assert (private_dir(path).stat().st_mode & 0o777) == 0o700


def test_symlinked_core_lease_is_refused(tmp_path):
    from shared.cores import CoreLease
    (tmp_path / "cores.lock").symlink_to(tmp_path / "elsewhere")
    with pytest.raises(SecurityError, match="symlink"):
        CoreLease(tmp_path / "cores.lock")
