"""A warm start for MLflow writer processes: a server process, MLflow imported once, forks each new writer.

A writer process (:mod:`flasync.tracking._child`) spends its first seconds of CPU importing MLflow, SQLAlchemy and
Alembic (about 4 s on a 2-core AMD EPYC) while the run it serves imports torch and trains beside it, and each tracked
``flasync run`` from the shell starts one. The first such writer, MLflow imported, forks this server
(:func:`fork_server`: where :data:`VARIABLE` is ``1``, which the command line sets), detached, and goes on with its
run: the server waits on a Unix socket from the first command's first seconds, at the cost of a fork. A writer asked
for later, by any process of the same user running the same Python, flasync and MLflow (:func:`fork_writer`), is a
fork of the server: it gets the two pipes its parent talks to it on, that parent's environment, working folder, import
path and file mode mask, and serves exactly as a writer started with ``python -m flasync.tracking._child`` would, with
nothing left to import. It runs with the server's priority and limits. ``python -m flasync.tracking._child --server
PATH`` starts a server on its own (:func:`serve`).

What travels is JSON and two file descriptors: nothing is pickled. The socket lies in a folder only its user can
enter (``$XDG_RUNTIME_DIR``, else ``/tmp/flasync-UID``), and the server serves only processes of its own user (the
kernel's peer credentials). Its name holds a digest of the Python, the flasync sources (their sizes and times) and
the installed MLflow: a server of another install is never asked, and ends when idle. The server ends after
:data:`IDLE_S` seconds without a writer of its own alive, or when its socket is removed or replaced (a newer server
of the same install took the name). ``FLASYNC_WRITER_SERVER=0`` in the environment keeps flasync from starting or
asking one. Only Linux has it (``os.pidfd_open``; forking after MLflow's import is safe there, see
:data:`flasync.tracking._child.FORKS_HELPER`).
"""

from __future__ import annotations

import contextlib
import gc
import hashlib
import importlib
import importlib.util
import json
import os
import select
import signal
import socket
import stat
import struct
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import IO, NamedTuple

__all__ = [
    "IDLE_S",
    "VARIABLE",
    "Forked",
    "Request",
    "address",
    "enabled",
    "fork_server",
    "fork_writer",
    "listen",
    "listens",
    "serve",
    "starts",
]

VARIABLE = "FLASYNC_WRITER_SERVER"
"""The environment variable that, set to ``0``, keeps flasync from starting or asking a writer server; set to ``1``
(the command line's default), a writer process started on its own also starts one (:func:`fork_server`); unset, a
server is asked where one listens but none is started."""
IDLE_S = 600.0
"""How long a server waits, with no writer of its own alive, before it ends."""
_MAX_MESSAGE = 1 << 20
"""The largest request a server reads (an environment and an import path, as JSON)."""
_CONNECT_TIMEOUT_S = 2.0
_SUN_PATH = 108
"""The bytes a Unix socket's path may take on Linux, its final NUL included."""
_PREIMPORTS = (
    "mlflow",
    "mlflow.tracking",
    "mlflow.store.tracking.sqlalchemy_store",
    "mlflow.store.db.utils",
    "mlflow.store.artifact.local_artifact_repo",
    "mlflow.system_metrics.system_metrics_monitor",
    "flasync.tracking._runs",
    "flasync.tracking.sqlite_metrics",
    "flasync.tracking.model_metrics",
)
"""What a writer imports on its way to a run's metrics, imported by the server once for every writer it forks."""


def enabled(env: Mapping[str, str] | None = None) -> bool:
    """Tell whether writer servers may be started and asked: on Linux, unless ``env`` (this process's environment
    by default) sets :data:`VARIABLE` to ``0``."""
    env = os.environ if env is None else env
    return sys.platform.startswith("linux") and hasattr(os, "pidfd_open") and env.get(VARIABLE, "1") != "0"


def starts(env: Mapping[str, str] | None = None) -> bool:
    """Tell whether a writer process started on its own should start a server (see :func:`fork_server`): where
    servers are :func:`enabled` and ``env`` (this process's environment by default) sets :data:`VARIABLE` to ``1``."""
    env = os.environ if env is None else env
    return enabled(env) and env.get(VARIABLE) == "1"


def _root() -> Path:
    """The folder flasync's package is imported from (the one holding ``flasync/``, a checkout or site-packages)."""
    spec = importlib.util.find_spec("flasync")
    origin = spec.origin if spec is not None else None
    return Path(origin).resolve().parents[1] if origin is not None else Path(__file__).resolve().parents[2]


def _digest() -> str:
    """Return what tells this install from another: the Python, flasync's sources and MLflow's first module (each
    file's path, size and time) and the time of the folder MLflow is installed in (an install or removal there
    changes it)."""
    root = _root()
    what: list[object] = [sys.executable, sys.version, str(root)]
    package = root / "flasync"
    for folder, names, files in os.walk(package, followlinks=True):
        names[:] = sorted(name for name in names if name != "__pycache__")
        for name in sorted(files):
            if name.endswith(".py"):
                info = os.stat(os.path.join(folder, name))
                what.append((os.path.relpath(os.path.join(folder, name), package), info.st_size, info.st_mtime_ns))
    try:  # an install or upgrade rewrites MLflow's first module and changes the folder of the installed packages
        spec = importlib.util.find_spec("mlflow")
        if spec is not None and spec.origin is not None:
            for path in (Path(spec.origin), Path(spec.origin).parents[1]):
                info = os.stat(path)
                what.append((str(path), info.st_size, info.st_mtime_ns))
    except (OSError, ValueError):
        what.append(None)
    return hashlib.sha256(json.dumps(what).encode()).hexdigest()[:16]


def _private_folder() -> Path | None:
    """Return a folder only this user can enter, for the socket: ``$XDG_RUNTIME_DIR``, else ``/tmp/flasync-UID``
    (made if missing); None when neither is one (owned by another user, or open to others)."""
    runtime = os.environ.get("XDG_RUNTIME_DIR")
    folder = Path(runtime) if runtime else Path("/tmp") / f"flasync-{os.getuid()}"
    if not runtime:
        with contextlib.suppress(FileExistsError, OSError):
            folder.mkdir(mode=0o700)
    try:
        info = os.lstat(folder)
    except OSError:
        return None
    private = stat.S_ISDIR(info.st_mode) and info.st_uid == os.getuid() and not info.st_mode & 0o077
    return folder if private else None


def address() -> Path | None:
    """Return the socket path of this install's writer server (whether one listens there or not); None where no
    private folder holds it, or its path is too long for a Unix socket."""
    folder = _private_folder()
    if folder is None:
        return None
    path = folder / f"flasync-writer-{_digest()}.sock"
    return path if len(os.fsencode(path)) + len(".4194304") < _SUN_PATH else None


class Forked:
    """A writer process forked by the server, as :class:`subprocess.Popen` shows one to its parent: its pipes
    (``stdin``, ``stdout``), ``pid``, :meth:`poll`, :meth:`wait` and :meth:`kill`.

    It is the server's child, not its parent's: its end is seen through a pidfd the server sent, and its exit
    status is not known here (:meth:`poll` and :meth:`wait` give 0 once it ended).
    """

    def __init__(self, pid: int, pidfd: int, stdin: IO[str], stdout: IO[str]) -> None:
        self.pid = pid
        self.stdin: IO[str] | None = stdin
        self.stdout: IO[str] | None = stdout
        self.returncode: int | None = None
        self._pidfd = pidfd
        self._lock = threading.Lock()

    def _ended(self, timeout: float | None) -> bool:
        with self._lock:
            if self.returncode is None:
                readable, _, _ = select.select([self._pidfd], [], [], timeout)
                if not readable:
                    return False
                self.returncode = 0
                os.close(self._pidfd)
            return True

    def poll(self) -> int | None:
        """Return None while the process runs, else 0."""
        return self.returncode if self._ended(0) else None

    def wait(self, timeout: float | None = None) -> int:
        """Wait for the process to end; return 0.

        Raises:
            subprocess.TimeoutExpired: It still runs after ``timeout`` seconds.
        """
        if not self._ended(timeout):
            raise subprocess.TimeoutExpired("flasync writer", timeout or 0.0)
        return 0

    def kill(self) -> None:
        """Kill the process (if it still runs)."""
        with self._lock:
            if self.returncode is None:
                with contextlib.suppress(ProcessLookupError):
                    signal.pidfd_send_signal(self._pidfd, signal.SIGKILL)


def fork_writer(env: Mapping[str, str], stdin: int, stdout: int) -> tuple[int, int] | None:
    """Ask this install's writer server, if one listens, for a writer process that reads ``stdin`` and answers on
    ``stdout`` (file descriptors; the caller closes its own copies) with the environment ``env``, this process's
    working folder and import path; return its pid and a pidfd of it, or None (no server, or it did not answer: start
    the writer the usual way)."""
    if not enabled(env):
        return None
    path = address()
    if path is None or not path.exists():
        return None
    request = json.dumps({"env": dict(env), "cwd": os.getcwd(), "path": list(sys.path), "umask": _umask()}).encode()
    if len(request) > _MAX_MESSAGE:
        return None
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET) as connection:
            connection.settimeout(_CONNECT_TIMEOUT_S)
            connection.connect(str(path))
            socket.send_fds(connection, [request], [stdin, stdout])
            answer, fds, _, _ = socket.recv_fds(connection, 64, 1)
    except OSError:
        return None
    word, _, pid = answer.decode(errors="replace").partition(" ")
    if word != "pid" or not pid.isdigit() or len(fds) != 1:
        for fd in fds:
            os.close(fd)
        return None
    return int(pid), fds[0]


def _umask() -> int:
    """Return this process's file mode mask (read, not set: threads may be creating files)."""
    with contextlib.suppress(OSError, ValueError), open("/proc/self/status", encoding="ascii") as status:
        for line in status:
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    return 0o022


def listens(path: Path) -> bool:
    """Tell whether a server listens at ``path``."""
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET) as probe:
            probe.settimeout(_CONNECT_TIMEOUT_S)
            probe.connect(str(path))
    except OSError:
        return False
    return True


def serve(path: Path, writer: Callable[[Request, int, int], None], idle_s: float = IDLE_S) -> None:
    """Import what a writer needs, then :func:`listen` at ``path`` (runs in a server process started on its own,
    ``python -m flasync.tracking._child --server PATH``)."""
    _preimport()
    if threading.active_count() == 1:  # a fork copies one thread: never fork where others run
        listen(path, writer, idle_s)


def fork_server(writer: Callable[[Request, int, int], None], idle_s: float = IDLE_S) -> int | None:
    """In a writer process started on its own, before it opens a store or starts a thread: where :func:`starts` says
    so and no server listens, import what a writer needs (this writer needs it too) and fork a server, detached (its
    own session, ``/`` its folder, its standard streams ``/dev/null``, no other file of the writer's), that listens
    at once (:func:`listen`, with ``writer`` and ``idle_s``). Return the server's pid (None: none forked). The fork
    costs the writer a few milliseconds; a server started on its own imports MLflow again (some 3 s of CPU)."""
    if not starts():
        return None
    path = address()
    if path is None or listens(path):
        return None
    _preimport()
    if threading.active_count() != 1:
        return None
    for stream in (sys.stdout, sys.stderr, sys.__stdout__, sys.__stderr__):
        with contextlib.suppress(Exception):
            if stream is not None:
                stream.flush()
    read, write = os.pipe()
    middle = os.fork()
    if middle == 0:  # pragma: no cover - a fork (the server tested through what it serves)
        try:
            os.close(read)
            os.setsid()
            server = os.fork()
            if server == 0:
                os.close(write)
                _detach()
                listen(path, writer, idle_s)
            else:
                os.write(write, str(server).encode())
        finally:
            os._exit(0)
    os.close(write)
    try:
        with open(read, "rb") as answer:
            told = answer.read()
    finally:
        os.waitpid(middle, 0)
    return int(told) if told.isdigit() else None


def _preimport() -> None:
    """Import what a writer needs on its way to a run's metrics (:data:`_PREIMPORTS`), the cyclic collector off:
    nearly everything the imports make lives as long as the process (see ``_serve`` of
    :mod:`flasync.tracking._child`)."""
    gc.disable()
    for name in _PREIMPORTS:
        with contextlib.suppress(Exception):  # one this MLflow lacks is left to the writer that needs it
            importlib.import_module(name)


def _detach() -> None:
    """Point this process's standard streams at ``/dev/null``, close its other files and point its folder at ``/``:
    a server forked by a writer keeps neither its parent's pipes (whose end the parent waits for), nor those to the
    writer's helpers, nor a folder the user may remove. (The objects that held those files are never collected:
    the collector is off and frozen, and the server ends with ``os._exit``.)"""
    null = os.open(os.devnull, os.O_RDWR)
    for fd in (0, 1, 2):
        os.dup2(null, fd)
    os.close(null)
    os.closerange(3, os.sysconf("SC_OPEN_MAX"))
    os.chdir("/")
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def listen(path: Path, writer: Callable[[Request, int, int], None], idle_s: float = IDLE_S) -> None:
    """Listen at ``path`` and fork a writer for each request of this user, until idle for ``idle_s`` seconds or
    ``path`` is another's (runs in the server process, what a writer needs imported, no other thread running).

    Args:
        path: The socket's path (see :func:`address`).
        writer: What the fork runs, given the request and the two ends of its parent's pipes (it never returns).
        idle_s: How long to wait with no writer alive before ending.
    """
    signal.signal(signal.SIGTERM, _stop)  # ``kill PID``: remove the socket on the way out
    _remove_dead_sockets(path.parent)
    gc.freeze()  # the forks share these pages instead of copying them at their first collection
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    staged = path.with_name(f"{path.name}.{os.getpid()}")
    listener.bind(str(staged))
    os.chmod(staged, 0o600)
    listener.listen(64)
    os.replace(staged, path)  # the name is taken at once, from a server of the same install that may hold it
    mine = os.stat(path).st_ino
    listener.settimeout(1.0)
    writers: set[int] = set()
    last = time.monotonic()
    try:
        while True:
            writers = {pid for pid in writers if not _reaped(pid)}
            now = time.monotonic()
            if writers:
                last = now
            if now - last > idle_s or not _holds(path, mine):
                return
            try:
                connection, _ = listener.accept()
            except TimeoutError:
                continue
            with connection:
                pid = _answer(connection, listener, writer)
            if pid is not None:
                writers.add(pid)
                last = time.monotonic()
    finally:
        if _holds(path, mine):
            with contextlib.suppress(OSError):
                path.unlink()
        listener.close()


def _stop(signum: int, frame: object) -> None:
    """End the server as its idle time would (its socket removed)."""
    raise SystemExit(0)


def _remove_dead_sockets(folder: Path) -> None:
    """Remove the sockets of writer servers (of any install) that no server answers at any more: one killed, or
    its machine restarted with the folder kept."""
    for path in folder.glob("flasync-writer-*.sock"):
        if not listens(path):
            with contextlib.suppress(OSError):
                path.unlink()


def _reaped(pid: int) -> bool:
    """Reap the writer ``pid`` if it ended; tell whether it did."""
    try:
        done, _ = os.waitpid(pid, os.WNOHANG)
    except ChildProcessError:
        return True
    return done == pid


def _holds(path: Path, inode: int) -> bool:
    """Tell whether ``path`` is still this server's socket."""
    try:
        return os.stat(path).st_ino == inode
    except OSError:
        return False


def _answer(
    connection: socket.socket, listener: socket.socket, writer: Callable[[Request, int, int], None]
) -> int | None:
    """Read one request from ``connection`` and fork its writer; return the writer's pid (None: refused)."""
    connection.settimeout(_CONNECT_TIMEOUT_S)
    credentials = connection.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    if struct.unpack("3i", credentials)[1] != os.getuid():
        return None
    try:
        message, fds, _, _ = socket.recv_fds(connection, _MAX_MESSAGE, 2)
    except OSError:
        return None
    try:
        request = Request.of(json.loads(message)) if len(fds) == 2 else None
        if request is None:
            return None
        for stream in (sys.stdout, sys.stderr):
            stream.flush()
        pid = os.fork()
        if pid == 0:  # pragma: no cover - the writer (tested through the runs it serves)
            try:
                signal.signal(signal.SIGTERM, signal.SIG_DFL)
                listener.close()
                connection.close()
                writer(request, fds[0], fds[1])
            finally:
                os._exit(1)
        pidfd = os.pidfd_open(pid)
        try:
            socket.send_fds(connection, [f"pid {pid}".encode()], [pidfd])
        except OSError:
            os.kill(pid, signal.SIGKILL)  # its parent is gone: nothing will talk to it
        finally:
            os.close(pidfd)
        return pid
    except ValueError:
        return None
    finally:
        for fd in fds:
            os.close(fd)


class Request(NamedTuple):
    """What a writer is forked with: its parent's environment, working folder, import path and file mode mask."""

    env: dict[str, str]
    cwd: str
    path: list[str]
    umask: int

    @classmethod
    def of(cls, request: object) -> Request | None:
        """Return ``request`` (a JSON value) as a request; None where it is not one."""
        if not isinstance(request, dict):
            return None
        env, cwd, path, umask = (request.get(key) for key in cls._fields)
        if not (
            isinstance(env, dict)
            and all(isinstance(k, str) and isinstance(v, str) for k, v in env.items())
            and isinstance(cwd, str)
            and isinstance(path, list)
            and all(isinstance(entry, str) for entry in path)
            and type(umask) is int
            and 0 <= umask <= 0o777
        ):
            return None
        return cls(env, cwd, path, umask)
