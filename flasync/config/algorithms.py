"""What guards and corrects the updates: resilience checks, SCAFFOLD and central differential privacy."""

from __future__ import annotations

from pydantic import Field, model_validator

from flasync.config._base import _FieldError, _Section


class ResilienceConfig(_Section):
    """How the server copes with failing clients and suspicious updates."""

    task_timeout_s: float | None = Field(
        None, gt=0.0, description="A task not answered this many seconds after dispatch is abandoned (timed out)."
    )
    round_quorum: float = Field(
        1.0, gt=0.0, le=1.0, description="Sync: a round closes once this share of clients_per_round answered."
    )
    round_deadline_s: float | None = Field(
        None, gt=0.0, description="Sync: a round closes this many seconds after it started, with who answered."
    )
    over_selection: float = Field(
        0.0, ge=0.0, le=10.0, description="Sync: sample ceil((1 + x) * clients_per_round) clients per round."
    )
    max_update_norm: float | None = Field(None, gt=0.0, description="Reject updates whose L2 norm is larger.")
    zscore_threshold: float | None = Field(
        None, gt=0.0, description="Reject updates whose norm's robust z-score over recent updates is larger."
    )
    zscore_window: int = Field(50, ge=3, description="Accepted update norms the robust z-score looks at.")
    zscore_min_history: int = Field(10, ge=3, description="Norms needed before the z-score check applies.")
    norm_bound_factor: float | None = Field(
        None,
        gt=1.0,
        description="Refuse updates whose norm exceeds this multiple of the median of recently accepted norms (a "
        "reference refused updates cannot move); needs zscore_min_history accepted updates first.",
    )
    clip_update_norm: float | None = Field(None, gt=0.0, description="Scale accepted updates down to this norm.")


class ScaffoldConfig(_Section):
    """SCAFFOLD (Karimireddy et al., ICML 2020), option II: local steps are corrected by ``c - c_i``, the server's
    and the client's control variates; each client keeps ``c_i`` (bounded in memory, spilled to disk, checkpointed)
    and uploads ``Delta c_i`` beside its delta; the server adds ``sum Delta c_i / N`` to ``c`` at each version and
    sends ``c`` with the model. Both travel through the codecs and count on the wire."""

    enabled: bool = Field(False, description="Train with SCAFFOLD's control variates (Karimireddy et al. 2020).")
    max_in_memory: int = Field(1024, ge=1, description="Client variates held in memory; older ones spill to disk.")
    spill_dir: str | None = Field(None, description="Where client variates spill (default: a temporary folder).")


class PrivacyConfig(_Section):
    """Central differential privacy (DP-FedAvg, McMahan et al. 2018; DP-FedBuff): every update is clipped to
    ``clip_norm``, each version's sum gets Gaussian noise of standard deviation ``noise_multiplier * clip_norm``
    and is divided by the fixed count (``clients_per_round`` or ``buffer_size``). The privacy spent, epsilon at
    ``delta``, is computed by Google's dp-accounting (``pip install 'flasync[privacy]'``) and logged per version."""

    enabled: bool = Field(
        False,
        description="Central differential privacy: clipped updates, Gaussian noise on each version's sum, epsilon"
        " tracked.",
    )
    clip_norm: float = Field(1.0, gt=0.0, description="C: the L2 norm every client update is clipped to.")
    noise_multiplier: float | None = Field(
        None, gt=0.0, description="z: noise standard deviation over clip_norm (or give target_epsilon)."
    )
    target_epsilon: float | None = Field(
        None, gt=0.0, description="Pick the smallest z whose epsilon after stop.max_versions versions is this."
    )
    delta: float = Field(1e-5, gt=0.0, lt=1.0, description="The delta epsilon is reported at (keep it < 1/clients).")

    @model_validator(mode="after")
    def _one_noise_source(self) -> PrivacyConfig:
        if self.enabled and (self.noise_multiplier is None) == (self.target_epsilon is None):
            raise _FieldError(("privacy", "noise_multiplier"), "give exactly one of noise_multiplier, target_epsilon")
        return self
