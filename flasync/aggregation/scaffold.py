"""SCAFFOLD's control variates (Karimireddy et al., "SCAFFOLD: Stochastic Controlled Averaging for Federated
Learning", ICML 2020, Algorithm 1 with option II).

Every local step is corrected by ``c - c_i``: ``y <- y - eta_l (g_i(y) - c_i + c)``, so each client drifts towards
the global direction instead of its own optimum. After ``K`` local steps from ``x``, option II sets the client's
variate from what training did, ``c_i+ = c_i - c + (x - y) / (K eta_l)``, and the client sends
``Delta c_i = c_i+ - c_i``; the server adds ``(1 / N) sum_{i in S} Delta c_i`` to ``c``, which keeps ``c`` the mean
of all ``N`` clients' variates.

Under buffered asynchronous aggregation the same rule applies per version: each client's ``Delta c_i`` is a change
of its own variate, computed against the ``c`` it downloaded, and is added once, whenever it arrives, so ``c`` stays
the mean of the clients' variates whatever the staleness. (The model's delta is staleness-weighted as usual.)
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["ControlVariate", "control_delta"]


def control_delta(delta: torch.Tensor, server: torch.Tensor, *, steps: int, lr: float) -> torch.Tensor:
    """Return ``Delta c_i = c_i+ - c_i = (x - y) / (K eta_l) - c`` (option II), a new tensor.

    Args:
        delta: ``x - y``: the client's delta (base weights minus trained weights).
        server: ``c``: the server's variate the client trained with.
        steps: ``K``: local steps taken (at least 1).
        lr: ``eta_l``: the local learning rate.
    """
    return delta.div(max(steps, 1) * lr).sub_(server)


class ControlVariate:
    """The server's control variate ``c``: ``c <- c + (1 / N) sum Delta c_i`` at every version.

    Args:
        num_params: Length of the flat model.
        num_clients: ``N``: the population's size.
        device: Where ``c`` lives (the global weights' device).
    """

    def __init__(self, num_params: int, *, num_clients: int, device: torch.device | str = "cpu") -> None:
        if num_clients < 1:
            raise ValueError(f"num_clients must be >= 1, got {num_clients}")
        self.value = torch.zeros(num_params, device=device)
        self.num_clients = num_clients
        self._pending = torch.zeros(num_params, device=device)
        self.count = 0

    def add(self, delta_c: torch.Tensor) -> None:
        """Fold one client's ``Delta c_i`` into the next version's change."""
        self._pending.add_(delta_c)
        self.count += 1

    def step(self) -> None:
        """Apply the folded changes to ``c`` and start afresh."""
        if self.count:
            self.value.add_(self._pending, alpha=1.0 / self.num_clients)
            self._pending.zero_()
            self.count = 0

    @property
    def nbytes(self) -> int:
        """Bytes of ``c`` and the pending sum."""
        return 2 * self.value.numel() * self.value.element_size()

    def state_dict(self) -> dict[str, Any]:
        """Return ``c`` and the changes not applied yet."""
        return {"value": self.value.clone(), "pending": self._pending.clone(), "count": self.count}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict`."""
        self.value.copy_(state["value"])
        self._pending.copy_(state["pending"])
        self.count = int(state["count"])
