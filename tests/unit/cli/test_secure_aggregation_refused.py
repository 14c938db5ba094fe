"""``flasync run`` with secure aggregation on and what it cannot combine with: one line on stderr, exit status 2,
before any run starts."""

from __future__ import annotations

import pytest

from flasync.cli import main


@pytest.mark.parametrize(
    ("extra", "reason"),
    [
        (["--set", "server.kind=fedasync"], "FedAsync applies each update alone"),
        (["--set", "codec.upload=[{kind: topk, ratio: 0.1}]"], "masks only cancel over the same coordinates"),
    ],
)
def test_secure_aggregation_is_refused_in_one_line(
    capsys: pytest.CaptureFixture[str], store: str, extra: list[str], reason: str
) -> None:
    """The refusal names secure_aggregation.enabled and its reason, exit 2, one error line."""
    status = main(["run", "--set", "secure_aggregation.enabled=true", *extra, "--tracking-uri", store])
    err = capsys.readouterr().err
    lines = [line for line in err.strip().splitlines() if " run.phase " not in line]
    assert status == 2 and len(lines) == 1, err
    assert lines[0].startswith("flasync: error: secure_aggregation.enabled:") and reason in lines[0]
