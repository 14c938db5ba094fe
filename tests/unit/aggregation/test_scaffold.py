"""SCAFFOLD's control variates against the paper's equations (Karimireddy et al. 2020, Algorithm 1, option II)."""

from __future__ import annotations

import pytest
import torch

from flasync.aggregation import ControlVariate, control_delta


def test_option_two_gives_the_change_of_the_client_variate() -> None:
    """Delta c_i = c_i+ - c_i with c_i+ = c_i - c + (x - y) / (K eta_l)."""
    x, y = torch.tensor([1.0, 2.0, -1.0]), torch.tensor([0.5, 2.5, -1.0])
    c, c_i = torch.tensor([0.1, -0.2, 0.3]), torch.tensor([0.05, 0.0, -0.1])
    steps, lr = 4, 0.05
    c_plus = c_i - c + (x - y) / (steps * lr)
    got = control_delta(x - y, c, steps=steps, lr=lr)
    torch.testing.assert_close(got, c_plus - c_i)
    torch.testing.assert_close(got, torch.tensor([2.5 - 0.1, -2.5 + 0.2, -0.3]))


def test_the_server_variate_moves_by_the_sum_over_n_once_per_version() -> None:
    """c <- c + (1/N) sum_{i in S} Delta c_i, applied at the step, not at each add."""
    cv = ControlVariate(3, num_clients=4)
    cv.add(torch.tensor([1.0, 0.0, 2.0]))
    cv.add(torch.tensor([3.0, 4.0, -2.0]))
    torch.testing.assert_close(cv.value, torch.zeros(3))  # nothing applied before the version is made
    cv.step()
    torch.testing.assert_close(cv.value, torch.tensor([1.0, 1.0, 0.0]))
    cv.step()  # a version without variates changes nothing
    torch.testing.assert_close(cv.value, torch.tensor([1.0, 1.0, 0.0]))
    assert cv.nbytes == 2 * 3 * 4


def test_c_stays_the_mean_of_the_client_variates() -> None:
    """Starting from zeros, c equals the mean of all N clients' variates after every version (the paper's invariant)."""
    gen = torch.Generator().manual_seed(0)
    n, d = 5, 7
    clients = torch.zeros(n, d)
    cv = ControlVariate(d, num_clients=n)
    for _ in range(6):
        for i in torch.randperm(n, generator=gen)[:3].tolist():
            delta = torch.randn(d, generator=gen)
            change = control_delta(delta, cv.value, steps=3, lr=0.1)
            clients[i] += change
            cv.add(change)
        cv.step()
        torch.testing.assert_close(cv.value, clients.mean(dim=0))


def test_state_round_trips_with_pending_changes() -> None:
    """A checkpoint between two adds restores c, the pending sum and its count."""
    cv = ControlVariate(2, num_clients=2)
    cv.add(torch.tensor([2.0, 2.0]))
    cv.step()
    cv.add(torch.tensor([4.0, 0.0]))
    other = ControlVariate(2, num_clients=2)
    other.load_state_dict(cv.state_dict())
    other.step()
    torch.testing.assert_close(other.value, torch.tensor([3.0, 1.0]))
    with pytest.raises(ValueError, match="num_clients"):
        ControlVariate(2, num_clients=0)
