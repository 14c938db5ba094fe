"""The documentation's code blocks: every command and sample is marked, and the runnable ones run as written.

A fenced ``bash``, ``python``, ``toml`` or ``yaml`` block in ``docs/`` is preceded by a marker comment that says
what its test does with it:

- ``<!-- docs-test: run -->``: run it (a shell block with ``bash``, a Python block with ``python``) in the page's
  temporary folder; ``run tracked`` keeps MLflow on (a temporary store), ``run needs=MODULE`` skips the page when
  ``MODULE`` is not installed;
- ``<!-- docs-test: file NAME -->``: write the block to ``NAME`` in that folder, for the blocks after it;
- ``<!-- docs-test: config -->``: validate the block as a (partial) run config;
- ``<!-- docs-test: skip: REASON -->``: leave it, for the reason given.

A page's blocks run in order in one temporary folder holding a copy of ``examples/``, as a reader would run them
from a clone. Shell blocks run with tiny settings: ``flasync run``, ``flasync serve`` and ``flasync sweep`` (whose
blocks are ``tracked``) get ``--set stop.max_versions=2``, and ``--no-tracking`` unless the block is ``tracked``,
where they get ``--set tracking.log_model=false`` (a final model's export, 4 CPU seconds a run, is tested in
``tests/unit/cli`` and ``tests/integration/tracking``); each ``--port N`` of a block, with its ``127.0.0.1:N``,
becomes a free port. Every command tracks to a temporary MLflow store, never to ``./mlruns`` of the checkout.

A shell block made only of ``python -m flasync run|sweep|compare|report|tracking ...`` and ``python examples/NAME.py
...`` lines (no Ray) runs them in the test's process, as does every Python block: a command through the ``main()``
that ``python -m flasync`` calls, a script or block with :mod:`runpy` as ``__main__``, with the same folder,
environment and arguments. A cold interpreter importing torch for each of them would cost seconds a command, and the
entry point's own exit path is tested in ``tests/unit/cli``. Every other shell block (servers, clients, loops,
pipes, Ray) runs in ``bash``, in a subprocess.
"""

from __future__ import annotations

import importlib.util
import os
import re
import runpy
import shlex
import shutil
import socket
import subprocess
import sys
import tomllib
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from flasync.config import validate

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs"
MARKED_LANGUAGES = {"bash", "sh", "shell", "console", "python", "py", "toml", "yaml"}
TINY = "--set stop.max_versions=2"
TRACKED = "--set tracking.log_model=false"

_MARKER = re.compile(r"^<!--\s*docs-test:\s*(?P<spec>.*?)\s*-->$")
_FENCE_OPEN = re.compile(r"^(?P<indent>\s*)```(?P<lang>[\w-]*)")
_FLASYNC_RUN = re.compile(r"^(?P<command>(?:python -m )?flasync (?:run|serve|sweep)\b.*?)(?P<tail>\s*&)?\s*$")
_COMMENT = re.compile(r"\s{2,}#.*$")
_IN_PROCESS = re.compile(
    r"python (?P<args>(?:-m flasync (?:run|sweep|compare|report|tracking)\b|examples/\w+\.py\b)[^&|;<>`$\\]*)"
)


@dataclass(frozen=True)
class Block:
    """One fenced code block of a page, with what its marker asks."""

    page: str
    line: int
    lang: str
    code: str
    action: str | None
    options: tuple[str, ...] = field(default=())

    def __str__(self) -> str:
        return f"{self.page}:{self.line} ({self.lang})"


def _pages() -> list[Path]:
    return [ROOT / "README.md", *sorted(path for path in DOCS.rglob("*.md") if "_hooks" not in path.parts)]


def _blocks(page: Path) -> list[Block]:
    """Return the fenced blocks of a page, each with the marker on the line before it (blank lines skipped)."""
    lines = page.read_text().splitlines()
    found: list[Block] = []
    previous = ""
    i = 0
    while i < len(lines):
        opening = _FENCE_OPEN.match(lines[i])
        if not opening:
            if lines[i].strip():
                previous = lines[i].strip()
            i += 1
            continue
        start = i
        i += 1
        body: list[str] = []
        while i < len(lines) and lines[i].strip() != "```":
            body.append(lines[i])
            i += 1
        i += 1
        marker = _MARKER.match(previous)
        action, options = None, ()
        if marker:
            words = marker.group("spec").split()
            action = words[0].rstrip(":") if words else None
            options = tuple(words[1:])
        found.append(
            Block(
                page=str(page.relative_to(ROOT)),
                line=start + 1,
                lang=opening.group("lang").lower(),
                code="\n".join(body) + "\n",
                action=action,
                options=options,
            )
        )
        previous = ""
    return found


ALL_BLOCKS = [block for page in _pages() for block in _blocks(page)]
CONFIG_BLOCKS = [block for block in ALL_BLOCKS if block.action == "config"]
RUN_PAGES = sorted({block.page for block in ALL_BLOCKS if block.action == "run"})


def test_every_command_and_sample_is_marked() -> None:
    """Every shell, Python and config block says how it is tested, and a skip says why."""
    unmarked = [str(b) for b in ALL_BLOCKS if b.lang in MARKED_LANGUAGES and b.action is None]
    assert not unmarked, f"blocks without a <!-- docs-test: ... --> marker: {unmarked}"
    unknown = [str(b) for b in ALL_BLOCKS if b.action not in (None, "run", "file", "config", "skip")]
    assert not unknown, f"blocks with an unknown docs-test action: {unknown}"
    silent_skips = [str(b) for b in ALL_BLOCKS if b.action == "skip" and not b.options]
    assert not silent_skips, f"skipped blocks that do not say why: {silent_skips}"


def test_there_are_blocks_to_run() -> None:
    """The collector finds the runnable blocks (a broken marker syntax would leave none)."""
    assert len([b for b in ALL_BLOCKS if b.action == "run"]) >= 20


@pytest.mark.parametrize("block", CONFIG_BLOCKS, ids=str)
def test_config_block_is_a_valid_config(block: Block) -> None:
    """A config block validates as a run config (the sections it leaves out take their defaults)."""
    loaded = tomllib.loads(block.code) if block.lang == "toml" else __import__("yaml").safe_load(block.code)
    validate(loaded)


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def tiny(code: str, *, tracked: bool) -> str:
    """Return a shell block with tiny settings: a short ``flasync run``/``serve``, and a free port for a server."""
    extra = f"{TINY} {TRACKED}" if tracked else f"{TINY} --no-tracking"
    out: list[str] = []
    for line in code.splitlines():
        match = _FLASYNC_RUN.match(_COMMENT.sub("", line).strip()) if "flasync" in line else None
        if match and "--resume" not in line:
            indent = line[: len(line) - len(line.lstrip())]
            line = f"{indent}{match.group('command')} {extra}{match.group('tail') or ''}"
        out.append(line)
    text = "\n".join(out) + "\n"
    for port in set(re.findall(r"--port (\d+)", text)):
        free = str(_free_port())
        text = text.replace(f"--port {port}", f"--port {free}").replace(f"127.0.0.1:{port}", f"127.0.0.1:{free}")
    return text


def _environment(folder: Path) -> dict[str, str]:
    """The pages' commands' environment: a store and cache in ``folder``, and this interpreter's ``python`` and
    scripts first on ``PATH`` (the suite run as ``.venv/bin/python -m pytest`` without the environment activated)."""
    env = dict(os.environ)
    env.update(
        PATH=os.pathsep.join([str(Path(sys.executable).parent), env.get("PATH", "")]),
        PYTHONPATH=os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")]),
        MLFLOW_TRACKING_URI=f"sqlite:///{folder / 'store' / 'mlflow.db'}",
        XDG_CACHE_HOME=str(folder / "cache"),
        COLUMNS="120",
    )
    (folder / "store").mkdir()
    return env


def in_process_commands(code: str) -> list[list[str]] | None:
    """Return the arguments ``python`` gets in each command of a shell block (after :func:`tiny`) that is only
    commands the test's process can run (``-m flasync`` without a server or client, ``examples/NAME.py``; no shell
    syntax, no Ray), or None."""
    commands: list[list[str]] = []
    for line in code.splitlines():
        command = _COMMENT.sub("", line).strip()
        if not command or command.startswith("#"):
            continue
        match = _IN_PROCESS.fullmatch(command)
        if match is None or "ray" in command:
            return None
        commands.append(shlex.split(match.group("args")))
    return commands


def _python_in_process(argv: list[str]) -> int:
    """Do in this process what ``python ARGV`` does (``-m flasync ...`` or a script); return the exit status."""
    if argv[:2] == ["-m", "flasync"]:
        from flasync.cli import main

        return main(argv[2:])
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(sys, "argv", argv)
        patch.syspath_prepend(str(Path(argv[0]).resolve().parent))
        try:
            runpy.run_path(argv[0], run_name="__main__")
        except SystemExit as exit_:
            return exit_.code if isinstance(exit_.code, int) else int(exit_.code is not None)
    return 0


def _run_in_process(
    block: Block, commands: list[list[str]], env: dict[str, str], capsys: pytest.CaptureFixture[str]
) -> None:
    """Run a block's commands one after another in this process, in the page's folder (the caller's working
    directory) with the subprocesses' environment; each must exit 0, as ``bash -e`` would ask."""
    with pytest.MonkeyPatch.context() as patch:
        for name in ("MLFLOW_TRACKING_URI", "XDG_CACHE_HOME", "COLUMNS"):
            patch.setenv(name, env[name])
        for argv in commands:
            status = _python_in_process(argv)
            out, err = capsys.readouterr()
            assert status == 0, (
                f"{block}: python {shlex.join(argv)} exited {status}\n--- stdout\n{out[-4000:]}"
                f"\n--- stderr\n{err[-4000:]}"
            )


def _run(block: Block, folder: Path, env: dict[str, str], capsys: pytest.CaptureFixture[str]) -> None:
    if block.lang in ("python", "py"):
        script = folder / f"block_{block.line}.py"
        script.write_text(block.code)
        _run_in_process(block, [[script.name]], env, capsys)
        return
    code = tiny(block.code, tracked="tracked" in block.options)
    commands = in_process_commands(code)
    if commands is not None:
        _run_in_process(block, commands, env, capsys)
        return
    command = ["bash", "-euo", "pipefail", "-c", code]
    done = subprocess.run(command, cwd=folder, env=env, capture_output=True, text=True, timeout=600, check=False)
    assert done.returncode == 0, (
        f"{block} exited {done.returncode}\n--- code\n{command[-1]}\n--- stdout\n{done.stdout[-4000:]}"
        f"\n--- stderr\n{done.stderr[-4000:]}"
    )


@pytest.mark.slow
@pytest.mark.timeout(1800)
@pytest.mark.parametrize("page", RUN_PAGES)
def test_page_runs_as_written(
    page: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """The page's runnable blocks run in order, in a fresh folder with a copy of examples/, and exit 0."""
    blocks = [b for b in ALL_BLOCKS if b.page == page and b.action in ("run", "file")]
    for block in blocks:
        for option in block.options:
            if option.startswith("needs=") and importlib.util.find_spec(option.removeprefix("needs=")) is None:
                pytest.skip(f"{block} needs {option.removeprefix('needs=')}, which is not installed")
    shutil.copytree(ROOT / "examples", tmp_path / "examples")
    env = _environment(tmp_path)
    monkeypatch.chdir(tmp_path)
    for block in blocks:
        if block.action == "file":
            (tmp_path / block.options[0]).write_text(block.code)
        else:
            _run(block, tmp_path, env, capsys)


def test_only_plain_flasync_commands_run_in_process() -> None:
    """A block of ``python -m flasync run|compare`` and ``python examples/NAME.py`` lines runs in the test's process
    with its tiny settings; a server, a client, a loop, a pipe, a background job or Ray sends the whole block to a
    subprocess."""
    plain = "python -m flasync run examples/fedbuff.toml --set server.staleness='{kind: constant}'  # a comment\n"
    code = plain + "\npython -m flasync compare --experiment x\npython examples/make.py --out d\n"
    staleness = "server.staleness={kind: constant}"
    assert in_process_commands(tiny(code, tracked=False)) == [
        ["-m", "flasync", "run", "examples/fedbuff.toml", "--set", staleness, *TINY.split(), "--no-tracking"],
        ["-m", "flasync", "compare", "--experiment", "x"],
        ["examples/make.py", "--out", "d"],
    ]
    for code in (
        "python -m flasync serve remote.toml --port 8080 &\n",
        "python -m flasync client --server http://127.0.0.1:8080\n",
        "python -m flasync run --set executor.kind=ray\n",
        "python -m flasync compare --experiment x | head\n",
        "python -m flasync run\nmkdir out\n",
        "for i in 0 1; do\n  python -m flasync run\ndone\n",
        "python -m flasync run --set seed=$SEED\n",
        "python -c 'import flasync'\n",
        "python other/script.py\n",
    ):
        assert in_process_commands(tiny(code, tracked=True)) is None, code
    shell_blocks = [b for b in ALL_BLOCKS if b.action == "run" and b.lang not in ("python", "py")]
    assert any(in_process_commands(tiny(b.code, tracked=False)) is None for b in shell_blocks)
    assert any(in_process_commands(tiny(b.code, tracked=False)) is not None for b in shell_blocks)
