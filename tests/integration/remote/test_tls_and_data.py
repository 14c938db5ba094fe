"""HTTPS through uvicorn's certificate options (a self-signed certificate made here) and `flasync client --data`."""

from __future__ import annotations

import asyncio
import datetime
import ipaddress
import json
import re
import ssl
import sys
from pathlib import Path

import httpx
import numpy as np
import pytest

from flasync.cli import main
from flasync.clients.remote.client import Client, RemoteError
from flasync.runtime.federation import Federation
from flasync.runtime.serve import serve
from tests.conftest import remote_config

pytestmark = pytest.mark.timeout(180)

x509 = pytest.importorskip("cryptography.x509")


def _self_signed(folder: Path) -> tuple[Path, Path]:
    """Write a self-signed certificate for 127.0.0.1 and its key; return their paths."""
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "127.0.0.1")])
    now = datetime.datetime.now(datetime.UTC)
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]), critical=False)
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .sign(key, hashes.SHA256())
    )
    cert_path, key_path = folder / "cert.pem", folder / "key.pem"
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_path.write_bytes(
        key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())
    )
    return cert_path, key_path


async def _served(federation: Federation, **tls: str) -> tuple[asyncio.Task[object], int]:
    port: asyncio.Future[int] = asyncio.get_running_loop().create_future()
    # Clients still training when the run ends learn it on their upload: a long enough linger on a loaded machine.
    task = asyncio.create_task(serve(federation, port=0, on_ready=port.set_result, linger_s=3.0, **tls))
    return task, await port


@pytest.mark.slow
async def test_clients_train_over_https_with_the_ca_file(tmp_path: Path, tokens: dict[int, str]) -> None:
    """Served with --ssl-certfile/--ssl-keyfile, clients trusting the certificate finish the run; others are refused."""
    cert, key = _self_signed(tmp_path)
    federation = Federation(remote_config(tmp_path / "tokens.txt", stop={"max_versions": 6}))
    served, port = await _served(federation, ssl_certfile=str(cert), ssl_keyfile=str(key))
    url = f"https://127.0.0.1:{port}"
    # Without the CA the handshake fails: the client gives up instead of talking in clear.
    untrusting = Client(url, tokens[0], backoff_s=0.05, max_backoff_s=0.1, give_up_s=0.5)
    with pytest.raises(RemoteError, match="unreachable"):
        await untrusting.run()
    async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}") as plain:
        with pytest.raises(httpx.TransportError):
            await plain.get("/v1/status")  # plain HTTP on the TLS port gets no answer
    trusted = ssl.create_default_context(cafile=str(cert))
    clients = [Client(url, token, verify=trusted, poll_s=2.0, backoff_s=0.05) for token in tokens.values()]
    results = await asyncio.gather(*(client.run() for client in clients))
    summary = await served
    assert summary.versions == 6  # type: ignore[attr-defined]
    assert all(r.finished == "finished" for r in results)


@pytest.mark.slow
async def test_the_client_command_trusts_cafile_and_trains_on_data(tmp_path: Path, tokens: dict[int, str]) -> None:
    """`flasync client --cafile ca.pem --data local.npz` (a process) trains its tasks over HTTPS until the run ends."""
    cert, key = _self_signed(tmp_path)
    # One update makes a version, so this one client drives the run to its end.
    server = {"kind": "fedbuff", "buffer_size": 1, "concurrency": len(tokens)}
    federation = Federation(remote_config(tmp_path / "tokens.txt", server=server, stop={"max_versions": 2}))
    served, port = await _served(federation, ssl_certfile=str(cert), ssl_keyfile=str(key))
    rng = np.random.default_rng(0)
    np.savez(tmp_path / "local.npz", x=rng.normal(size=(60, 64)).astype(np.float32), y=rng.integers(0, 10, 60))
    (tmp_path / "token0.txt").write_text(tokens[0])
    url = f"https://127.0.0.1:{port}"
    command = [sys.executable, "-m", "flasync", "client", "--server", url, "--token-file", str(tmp_path / "token0.txt")]
    command += ["--cafile", str(cert), "--data", str(tmp_path / "local.npz"), "--poll-s", "2"]
    process = await asyncio.create_subprocess_exec(
        *command, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT
    )
    output = (await process.communicate())[0].decode()
    summary = await served
    assert summary.versions == 2  # type: ignore[attr-defined]
    assert process.returncode == 0, output
    assert "flasync client 0: 2 updates delivered of 2 tasks" in output, output
    assert "(the run ended)" in output


@pytest.mark.parametrize(
    ("content", "expected"),
    [
        (None, "--data: .*missing.npz needs arrays x and y"),
        (b"not an npz file", "--data: .*bad.npz needs arrays x and y"),
        ({"x": np.zeros((2, 3))}, "--data: .*nolabels.npz needs arrays x and y"),
    ],
)
def test_bad_data_files_are_one_line_errors(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], content: object, expected: str
) -> None:
    """A --data file that is missing, not an .npz, or without y is refused with one line and status 2."""
    token = tmp_path / "token.txt"
    token.write_text("x" * 32)
    name = {type(None): "missing.npz", bytes: "bad.npz", dict: "nolabels.npz"}[type(content)]
    path = tmp_path / name
    if isinstance(content, bytes):
        path.write_bytes(content)
    elif isinstance(content, dict):
        np.savez(path, **content)
    status = main(["client", "--server", "http://127.0.0.1:9", "--token-file", str(token), "--data", str(path)])
    err = capsys.readouterr().err.strip()
    assert status == 2
    assert len(err.splitlines()) == 1
    assert re.search(expected, err), err


def test_a_bad_cafile_is_a_one_line_error(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A --cafile that is not a certificate is refused with one line and status 2."""
    token = tmp_path / "token.txt"
    token.write_text("x" * 32)
    (tmp_path / "ca.pem").write_text("not a certificate")
    status = main(
        ["client", "--server", "https://127.0.0.1:9", "--token-file", str(token), "--cafile", str(tmp_path / "ca.pem")]
    )
    err = capsys.readouterr().err.strip()
    assert status == 2 and len(err.splitlines()) == 1 and "--cafile" in err


@pytest.mark.slow
async def test_the_serve_command_serves_https(tmp_path: Path, tokens: dict[int, str]) -> None:
    """`flasync serve --ssl-certfile cert.pem --ssl-keyfile key.pem` (a process) serves the run over HTTPS."""
    cert, key = _self_signed(tmp_path)
    config = tmp_path / "remote.yaml"
    config.write_text(json.dumps(remote_config(tmp_path / "tokens.txt", stop={"max_versions": 6})))  # JSON is YAML
    command = [sys.executable, "-m", "flasync", "serve", str(config), "--port", "0", "--no-tracking"]
    command += ["--ssl-certfile", str(cert), "--ssl-keyfile", str(key)]
    server = await asyncio.create_subprocess_exec(*command, stderr=asyncio.subprocess.PIPE)
    assert server.stderr is not None
    url = ""
    while not url:
        line = (await server.stderr.readline()).decode()
        assert line, "the server exited before serving"
        if "serving on" in line:
            url = line.split("serving on ")[1].strip()
    assert url.startswith("https://127.0.0.1:")
    trusted = ssl.create_default_context(cafile=str(cert))
    clients = [Client(url, token, verify=trusted, poll_s=2.0, backoff_s=0.05) for token in tokens.values()]
    results = await asyncio.gather(*(client.run() for client in clients))
    await server.stderr.read()
    assert await server.wait() == 0
    assert all(r.finished == "finished" for r in results)
    assert sum(r.uploads for r in results) >= 18  # 6 versions of 3 updates
