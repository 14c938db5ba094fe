"""Central differential privacy: the mechanism, the accountant against the library, the plan and its errors."""

from __future__ import annotations

import pytest
import torch

from flasync import codecs
from flasync.aggregation import BufferedAggregator, ConstantStaleness, EqualExampleWeight, ServerOptimizer
from flasync.aggregation.privacy import (
    GaussianMechanism,
    PrivacyAccountant,
    calibrate_noise_multiplier,
    sampling_rate,
)
from flasync.algorithms.privacy import CentralPrivacy
from flasync.codecs.validation import UpdateValidator
from flasync.core import seeding
from flasync.core.errors import ConfigError
from flasync.core.events import ClientId, UpdateUploaded, Version
from flasync.core.snapshots import ModelSnapshot
from flasync.runtime.prepare import plan_privacy
from flasync.server import Admitted, Intake, Refused
from flasync.testing import small_config

dp_accounting = pytest.importorskip("dp_accounting")

pytestmark = pytest.mark.timeout(60)


def _library_epsilon(z: float, q: float, versions: int, delta: float) -> float:
    """Epsilon as dp-accounting computes it when composing every version, with its default orders."""
    accountant = dp_accounting.rdp.RdpAccountant()
    gaussian = dp_accounting.GaussianDpEvent(z)
    event = gaussian if q >= 1 else dp_accounting.PoissonSampledDpEvent(q, gaussian)
    accountant.compose(dp_accounting.SelfComposedDpEvent(event, versions))
    return float(accountant.get_epsilon(delta))


# ------------------------------------------------------------------------------------------------ accountant
@pytest.mark.parametrize(("z", "q", "versions"), [(1.1, 0.01, 1000), (0.8, 0.1, 150), (2.0, 1.0, 50)])
def test_the_accountant_agrees_with_the_library_composing_every_version(z: float, q: float, versions: int) -> None:
    """Scaling one version's RDP by T gives the library's epsilon of T composed versions (its own orders)."""
    ours = PrivacyAccountant(noise_multiplier=z, sampling_rate=q, delta=1e-5).epsilon(versions)
    theirs = _library_epsilon(z, q, versions, 1e-5)
    # Our order grid differs from the library's default one: epsilon is a minimum over orders, so close, not equal.
    assert ours == pytest.approx(theirs, rel=0.05)


def test_the_accountant_matches_a_published_figure() -> None:
    """Abadi et al. (CCS 2016), MNIST: q = 0.01, sigma = 4, 10,000 steps (100 epochs): epsilon about 1.26 at 1e-5
    with the moments accountant; RDP (Mironov 2017) is at least as tight."""
    eps = PrivacyAccountant(noise_multiplier=4.0, sampling_rate=0.01, delta=1e-5).epsilon(10_000)
    assert 0.9 < eps <= 1.3


def test_epsilon_grows_with_versions_and_shrinks_with_noise_and_sampling() -> None:
    """More versions cost more; more noise or a smaller sampling rate cost less; nothing costs nothing."""
    base = PrivacyAccountant(noise_multiplier=1.0, sampling_rate=0.1, delta=1e-5)
    assert base.epsilon(0) == 0.0
    assert 0 < base.epsilon(10) < base.epsilon(100) < base.epsilon(1000)
    noisier = PrivacyAccountant(noise_multiplier=2.0, sampling_rate=0.1, delta=1e-5)
    full = PrivacyAccountant(noise_multiplier=1.0, sampling_rate=1.0, delta=1e-5)
    assert noisier.epsilon(100) < base.epsilon(100) < full.epsilon(100)


def test_calibration_reaches_the_target_epsilon() -> None:
    """The calibrated noise multiplier spends the target epsilon (from below) over the planned versions."""
    z = calibrate_noise_multiplier(target_epsilon=4.0, delta=1e-5, sampling_rate=0.1, versions=200)
    spent = PrivacyAccountant(noise_multiplier=z, sampling_rate=0.1, delta=1e-5).epsilon(200)
    assert spent == pytest.approx(4.0, rel=0.01)
    assert spent <= 4.0 + 1e-6


def test_the_accountant_refuses_meaningless_parameters() -> None:
    """Zero noise, a rate outside (0, 1] or a delta outside (0, 1) are errors."""
    for kwargs in (
        {"noise_multiplier": 0.0, "sampling_rate": 0.1, "delta": 1e-5},
        {"noise_multiplier": 1.0, "sampling_rate": 1.5, "delta": 1e-5},
        {"noise_multiplier": 1.0, "sampling_rate": 0.1, "delta": 1.0},
    ):
        with pytest.raises(ValueError, match="must be"):
            PrivacyAccountant(**kwargs)  # type: ignore[arg-type]


def test_sampling_amplifies_only_under_uniform_sampling() -> None:
    """q = clients per version / population under uniform sampling, capped at 1; 1 otherwise."""
    assert sampling_rate(per_version=10, num_clients=100, uniform=True) == pytest.approx(0.1)
    assert sampling_rate(per_version=10, num_clients=5, uniform=True) == 1.0
    assert sampling_rate(per_version=10, num_clients=100, uniform=False) == 1.0


# ------------------------------------------------------------------------------------------------- mechanism
def _mechanism(z: float = 2.0, c: float = 0.5, k: int = 4) -> GaussianMechanism:
    return GaussianMechanism(
        clip_norm=c, noise_multiplier=z, denominator=k, generator=lambda step: seeding.torch_stream(7, 99, step)
    )


def test_the_mechanism_adds_noise_of_std_z_c_and_divides_by_the_fixed_count() -> None:
    """(S + N(0, (zC)^2)) / K, the noise drawn from the version's own stream."""
    mech = _mechanism()
    total = torch.arange(100_000, dtype=torch.float32) / 1e5
    out = mech.privatize(total, step=3)
    expected_noise = torch.randn(100_000, generator=seeding.torch_stream(7, 99, 3)) * 1.0
    torch.testing.assert_close(out, (total + expected_noise) / 4)
    noise = out * 4 - total
    assert float(noise.std()) == pytest.approx(1.0, rel=0.02)
    assert not torch.equal(mech.privatize(total, step=4), out)  # another version, other noise
    assert torch.equal(mech.privatize(total, step=3), out)  # the same version, the same noise


def test_a_private_buffer_steps_with_the_noised_sum_over_k() -> None:
    """The optimizer sees (sum_k s_k delta_k + noise) / K, not the weighted mean, and counts its steps."""
    weights = torch.zeros(6)
    mech = _mechanism(z=1.0, c=1.0, k=4)
    agg = BufferedAggregator(
        weights,
        size=4,
        optimizer=ServerOptimizer.sgd(weights, lr=1.0),
        staleness=ConstantStaleness(),
        example_weight=EqualExampleWeight(),
        release=mech.privatize,
    )
    deltas = [torch.full((6,), 0.1 * (i + 1)) for i in range(3)]  # three updates of K = 4 arrived
    for d in deltas:
        agg.add(d, staleness=0, num_samples=10, base=weights)
    agg.step()
    noise = torch.randn(6, generator=seeding.torch_stream(7, 99, 0))
    torch.testing.assert_close(weights, -(sum(deltas) + noise) / 4)
    assert agg.steps == 1 and agg.state_dict()["steps"] == 1


# ------------------------------------------------------------------------------------------------- intake
def _upload(task_id: int, client: int, base: int) -> UpdateUploaded:
    return UpdateUploaded(
        task_id=task_id,
        client_id=ClientId(client),
        base_version=Version(base),
        num_samples=10,
        payload=codecs.Pipeline().encode(torch.full((4,), 3.0)).payload,
        train_loss=0.0,
        simulated_s=0.0,
        sent_wall_s=0.0,
    )


class _AnyTask:
    def base(self, version: Version) -> ModelSnapshot:
        weights = torch.zeros(4)
        return ModelSnapshot(version=version, weights=weights, exact=weights, download_bytes=0)

    def release(self, message: UpdateUploaded) -> bool:
        return True


def test_one_update_per_client_per_version_clipped() -> None:
    """A client's second update into the same version is refused as 'repeat'; the next version takes it."""
    privacy = CentralPrivacy(PrivacyAccountant(noise_multiplier=1.0, sampling_rate=0.1, delta=1e-5))
    intake = Intake(
        registry=_AnyTask(),  # type: ignore[arg-type]
        codec=codecs.Pipeline(),
        num_params=4,
        device=torch.device("cpu"),
        validator=UpdateValidator(4),
        max_staleness=None,
        clip_norm=1.0,
        wall=lambda: 0.0,
        plugins=[privacy],
    )
    first = intake.admit(_upload(0, 5, 2), version=2)
    assert isinstance(first, Admitted)
    assert float(torch.linalg.vector_norm(first.delta)) == pytest.approx(1.0)
    again = intake.admit(_upload(1, 5, 2), version=2)
    assert isinstance(again, Refused) and again.reason == "repeat"
    assert isinstance(intake.admit(_upload(2, 6, 2), version=2), Admitted)
    state = privacy.state_dict()
    assert state["joined"] == [2, [5, 6]]
    assert isinstance(intake.admit(_upload(3, 5, 2), version=3), Admitted)
    privacy.load_state_dict(state)  # a checkpoint taken in version 2 restores who is in it
    assert isinstance(intake.admit(_upload(4, 6, 2), version=2), Refused)


# ------------------------------------------------------------------------------------------------ config
@pytest.mark.parametrize(
    ("overrides", "field"),
    [
        (["privacy.enabled=true"], "privacy.noise_multiplier"),
        (
            ["privacy.enabled=true", "privacy.noise_multiplier=1", "privacy.target_epsilon=3"],
            "privacy.noise_multiplier",
        ),
        (["privacy.enabled=true", "privacy.noise_multiplier=1", "server={kind: fedasync}"], "privacy.enabled"),
        (
            ["privacy.enabled=true", "privacy.noise_multiplier=1", "server={kind: fedavg, aggregation: median}"],
            "privacy.enabled",
        ),
        (["privacy.enabled=true", "privacy.noise_multiplier=1", "server.example_weight=samples"], "privacy.enabled"),
        (["privacy.enabled=true", "privacy.noise_multiplier=-1"], "privacy.noise_multiplier"),
        (["privacy.enabled=true", "privacy.noise_multiplier=1", "privacy.delta=1"], "privacy.delta"),
    ],
)
def test_bad_privacy_settings_are_one_line_errors_naming_the_field(overrides: list[str], field: str) -> None:
    """Each inconsistent setting is refused with one line that names the field."""
    with pytest.raises(ConfigError) as info:
        small_config(*overrides)
    message = str(info.value)
    assert "\n" not in message and message.startswith(field)


def test_the_plan_counts_the_clients_a_version_may_hold() -> None:
    """FedBuff: q = K / N, the noised sum divided by K; FedAvg with over-selection: q counts the whole cohort."""
    buff = plan_privacy(small_config("privacy.enabled=true", "privacy.noise_multiplier=1.5"), 20)
    assert (buff.sampling_rate, buff.denominator, buff.noise_multiplier) == (pytest.approx(4 / 20), 4, 1.5)
    avg = plan_privacy(
        small_config(
            "privacy.enabled=true",
            "privacy.noise_multiplier=1.5",
            "server={kind: fedavg, clients_per_round: 5}",
            "resilience.over_selection=0.4",
        ),
        20,
    )
    assert (avg.sampling_rate, avg.denominator) == (pytest.approx(7 / 20), 5)
    weighted = plan_privacy(
        small_config("privacy.enabled=true", "privacy.noise_multiplier=1.5", "population.sampling=weighted"), 20
    )
    assert weighted.sampling_rate == 1.0
