"""The writer server's pieces that need no server: when it is on, where its socket goes, what a request is, what
tells one install from another, and how a forked writer is seen (see :mod:`flasync.tracking._server`)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from flasync.tracking import _server

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="writer servers run on Linux only")


def test_servers_are_on_unless_the_variable_says_0() -> None:
    assert _server.enabled({})
    assert _server.enabled({_server.VARIABLE: "1"})
    assert not _server.enabled({_server.VARIABLE: "0"})


def test_only_a_variable_of_1_has_a_writer_start_a_server(monkeypatch: pytest.MonkeyPatch) -> None:
    """A library's tracked run (the variable unset) asks a listening server but starts none; the command line's
    ``1`` starts one; ``0`` neither."""
    assert _server.starts({_server.VARIABLE: "1"})
    assert not _server.starts({})
    assert not _server.starts({_server.VARIABLE: "0"})
    assert not _server.starts({_server.VARIABLE: "yes"})
    monkeypatch.setenv(_server.VARIABLE, "0")
    assert _server.fork_server(lambda request, down, up: None) is None  # nothing forked


@pytest.fixture
def short(tmp_path: Path) -> Iterator[Path]:
    """A private folder of a short path (a Unix socket's path is at most 107 bytes, a test's folder's may be more)."""
    folder = Path(tempfile.mkdtemp(prefix="flasync-test-"))
    yield folder
    shutil.rmtree(folder, ignore_errors=True)


def test_the_socket_goes_to_a_private_folder_only(short: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    folder = short
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(folder))
    path = _server.address()
    assert path is not None and path.parent == folder and path.name.startswith("flasync-writer-")
    folder.chmod(0o755)  # others may enter: no socket there, and no server is asked
    assert _server.address() is None
    assert _server.fork_writer({}, 0, 1) is None
    deep = short / ("d" * 80)
    deep.mkdir(mode=0o700)
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(deep))
    assert _server.address() is None  # too long a path for a Unix socket


def test_without_a_runtime_folder_the_socket_goes_to_a_folder_of_its_own_in_tmp(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv("XDG_RUNTIME_DIR")
    path = _server.address()
    assert path is not None
    assert path.parent == Path("/tmp") / f"flasync-{os.getuid()}"
    assert not path.parent.stat().st_mode & 0o077


def test_a_changed_source_file_changes_the_socket_name(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    source = tmp_path / "flasync" / "module.py"
    source.parent.mkdir()
    source.write_text("x = 1\n")
    monkeypatch.setattr(_server, "_root", lambda: tmp_path)
    before = _server._digest()
    assert _server._digest() == before
    source.write_text("x = 22\n")
    assert _server._digest() != before


def test_a_request_is_an_environment_a_folder_an_import_path_and_a_mask() -> None:
    good = {"env": {"A": "1"}, "cwd": "/x", "path": ["/y"], "umask": 0o022}
    assert _server.Request.of(good) == _server.Request({"A": "1"}, "/x", ["/y"], 0o022)
    for bad in (
        [],
        {**good, "env": {"A": 1}},
        {**good, "cwd": None},
        {**good, "path": "/y"},
        {**good, "umask": 0o1000},
        {**good, "umask": True},
        {"env": {}, "cwd": "/"},
    ):
        assert _server.Request.of(bad) is None


def test_a_forked_writer_is_seen_as_a_process_is() -> None:
    """poll() is None while it runs, kill() ends it, wait() then returns 0 (its status is its server's to know)."""
    process = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    pidfd = os.pidfd_open(process.pid)
    read, write = os.pipe()
    forked = _server.Forked(process.pid, pidfd, open(write, "w"), open(read))  # noqa: SIM115
    try:
        assert forked.poll() is None
        with pytest.raises(subprocess.TimeoutExpired):
            forked.wait(0.05)
        forked.kill()
        process.wait(10)  # reaped by its parent, as the server reaps its writers
        assert forked.wait(10) == 0
        assert forked.poll() == 0
        forked.kill()  # gone: nothing to kill
    finally:
        for stream in (forked.stdin, forked.stdout):
            assert stream is not None
            stream.close()
        if process.poll() is None:
            process.kill()
            process.wait()
