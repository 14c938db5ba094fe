"""The remote config section, the tokens file and the serve/client commands' one-line errors."""

from __future__ import annotations

from pathlib import Path

import pytest

from flasync.cli import main
from flasync.clients.remote.transport import parse_tokens
from flasync.config import validate
from flasync.core.errors import ConfigError
from tests.conftest import remote_config


def test_remote_needs_the_wall_clock(tmp_path: Path) -> None:
    """A remote run on the virtual clock is refused with a one-line error naming the field."""
    with pytest.raises(ConfigError, match=r"^clock: remote clients need clock = 'wall'") as info:
        validate({**remote_config(tmp_path / "tokens.txt"), "clock": "virtual"})
    assert "\n" not in str(info.value)


def test_remote_needs_a_tokens_file(tmp_path: Path) -> None:
    """remote.enabled without remote.tokens_file is refused."""
    config = remote_config(tmp_path / "tokens.txt")
    config["remote"] = {"enabled": True}
    with pytest.raises(ConfigError, match=r"remote\.tokens_file"):
        validate(config)


def test_remote_needs_a_task_timeout(tmp_path: Path) -> None:
    """Without resilience.task_timeout_s a device that leaves would hold its task for ever: refused by name."""
    config = remote_config(tmp_path / "tokens.txt")
    config["resilience"] = {}
    with pytest.raises(ConfigError, match=r"^resilience\.task_timeout_s: must be set when remote\.enabled"):
        validate(config)


def test_run_refuses_a_remote_config(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """`flasync run` on a remote config exits 2 with one line pointing to `flasync serve` (it would wait for ever)."""
    (tmp_path / "tokens.txt").write_text("0 " + "t" * 24 + "\n")
    config = tmp_path / "remote.toml"
    config.write_text(
        'clock = "wall"\n[remote]\nenabled = true\ntokens_file = "' + str(tmp_path / "tokens.txt") + '"\n'
        "[resilience]\ntask_timeout_s = 5\n"
    )
    assert main(["run", str(config), "--no-tracking"]) == 2
    err = capsys.readouterr().err
    assert "flasync serve" in err and err.count("\n") == 1


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("0 short\n", "16 to 512 characters"),
        ("9 " + "t" * 20 + "\n", "not below population.num_clients"),
        ("zero " + "t" * 20 + "\n", "expected 'CLIENT_ID TOKEN'"),
        ("0 " + "t" * 20 + "\n1 " + "t" * 20 + "\n", "already bound to client 0"),
        ("# nothing\n", "no 'CLIENT_ID TOKEN' line"),
    ],
)
def test_malformed_tokens_files_are_refused(text: str, message: str) -> None:
    """Each malformed tokens file gets a one-line error."""
    with pytest.raises(ConfigError, match=message):
        parse_tokens(text, num_clients=5)


def test_tokens_are_bound_to_their_clients() -> None:
    """A token maps to its client id; an unknown or empty one to nothing."""
    tokens = parse_tokens("# comment\n3 " + "a" * 20 + "  # device\n1 " + "b" * 20 + "\n", num_clients=5)
    assert tokens.client_of("a" * 20) == 3
    assert tokens.client_of("b" * 20) == 1
    assert tokens.client_of("c" * 20) is None
    assert tokens.client_of("") is None


def test_serve_refuses_a_config_without_remote(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """flasync serve on a config without remote.enabled exits 2 with one line."""
    config = tmp_path / "plain.toml"
    config.write_text('clock = "wall"\n')
    assert main(["serve", str(config), "--no-tracking"]) == 2
    err = capsys.readouterr().err
    assert "remote.enabled = true" in err
    assert err.count("\n") == 1


def test_client_refuses_a_missing_token_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """flasync client with an unreadable token file exits 2 with one line."""
    assert main(["client", "--server", "http://127.0.0.1:9", "--token-file", str(tmp_path / "none")]) == 2
    assert "--token-file" in capsys.readouterr().err


@pytest.mark.slow
def test_client_gives_up_on_an_unreachable_server(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A server that never answers ends the client with a one-line error after --give-up-s."""
    token = tmp_path / "token"
    token.write_text("t" * 24)
    argv = ["client", "--server", "http://127.0.0.1:9", "--token-file", str(token), "--give-up-s", "0.3"]
    assert main(argv) == 2
    assert "unreachable" in capsys.readouterr().err


def test_a_relative_tokens_file_is_read_from_the_config_files_folder(tmp_path: Path) -> None:
    """remote.tokens_file in a config file is anchored at the file's folder, as data paths are."""
    from flasync.config import load_config

    folder = tmp_path / "deploy"
    folder.mkdir()
    (folder / "remote.toml").write_text(
        'clock = "wall"\n[remote]\nenabled = true\ntokens_file = "tokens.txt"\n[resilience]\ntask_timeout_s = 5\n'
    )
    assert load_config(folder / "remote.toml").remote.tokens_file == str(folder / "tokens.txt")


def test_a_server_address_without_a_scheme_is_one_line(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    """flasync client --server 127.0.0.1:8080 (no http://) exits 2 at once instead of retrying."""
    token = tmp_path / "token"
    token.write_text("t" * 24)
    assert main(["client", "--server", "127.0.0.1:8080", "--token-file", str(token)]) == 2
    err = capsys.readouterr().err
    assert "--server: expected an http:// or https:// address" in err and err.count("\n") == 1
