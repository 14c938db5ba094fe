"""Central differential privacy's server side as a plug-in: one update per client in a version, and the privacy spent.

The sensitivity of a version's sum is the clipping norm only when each client's update counts once in it, so a
second update of a client into the same version is refused (``repeat``). Updates are clipped by the intake (the
run's clipping bound is at most ``privacy.clip_norm``), and the Gaussian noise is added by the aggregator
(:class:`~flasync.aggregation.privacy.GaussianMechanism`); the accountant's epsilon is logged with every version.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from flasync.aggregation.privacy import PrivacyAccountant
from flasync.core.events import UpdateUploaded
from flasync.training.plugins import Refusal, ServerPlugin

__all__ = ["CentralPrivacy"]


class CentralPrivacy(ServerPlugin):
    """Admit at most one update per client into a version; log the privacy spent (checkpoint component ``privacy``).

    Args:
        accountant: The privacy spent after a number of versions.
    """

    name = "privacy"

    def __init__(self, accountant: PrivacyAccountant) -> None:
        """Bind the accountant."""
        self.accountant = accountant
        self._joined: tuple[int, set[int]] = (-1, set())  # a version and the clients admitted into it

    def admit(self, message: UpdateUploaded, version: int) -> Refusal | None:
        """Refuse a second update of a client into ``version``."""
        joined_version, clients = self._joined
        if joined_version != version:
            clients = set()
            self._joined = (version, clients)
        if int(message.client_id) in clients:
            return Refusal("repeat", f"client {message.client_id} already has an update in this version")
        return None

    def admitted(self, message: UpdateUploaded, version: int) -> None:
        """Count the client in ``version``."""
        self._joined[1].add(int(message.client_id))

    def version_made(self, version: int, log: Any) -> None:
        """Log epsilon after ``version`` versions."""
        log.debug("server.privacy", step=version, epsilon=self.accountant.epsilon(version))

    def state_dict(self) -> dict[str, Any]:
        """Return the clients already in the current version."""
        version, clients = self._joined
        return {"joined": [version, sorted(clients)]}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore :meth:`state_dict`."""
        version, clients = state["joined"]
        self._joined = (int(version), {int(c) for c in clients})
