"""What is trained and how: the model and a client task's local training."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import Field, field_validator, model_validator

from flasync.config._base import _Section


class LoraAdapter(_Section):
    """Low-rank adapters (LoRA, Hu et al., ICLR 2022) put on the model with the ``peft`` library.

    Each targeted linear (or convolution) layer ``W`` becomes ``W + (alpha / r) B A`` with ``A`` (``r x in``) drawn
    at random and ``B`` (``out x r``) zero, so training starts from the model as built. ``W`` is frozen: only the
    adapters (and the layers ``modules_to_save`` names) train and travel.
    """

    kind: Literal["lora"] = "lora"
    r: int = Field(4, ge=1, description="Rank of each adapter.")
    alpha: float = Field(8.0, gt=0.0, description="LoRA's scale numerator: an adapter adds (alpha / r) B A.")
    target: tuple[str, ...] = Field(
        min_length=1,
        description="Layers that get an adapter, by module name or name suffix (peft's target_modules; "
        "e.g. 'layers.0' of the MLP).",
    )
    modules_to_save: tuple[str, ...] = Field(
        (), description="Layers trained and exchanged whole beside the adapters (e.g. the classifier head)."
    )


class PruneConfig(_Section):
    """Magnitude pruning of the global model on a schedule (a mask over the flat vector, sent with the model)."""

    target_density: float = Field(
        gt=0.0,
        lt=1.0,
        description="Share of each weight tensor's values kept in the end (tensors of two or more dimensions; "
        "biases and normalization parameters are kept whole).",
    )
    every_versions: int = Field(20, ge=1, description="Versions between two pruning events.")
    steps: int = Field(
        1,
        ge=1,
        description="Pruning events that bring the density to its target: the i-th keeps "
        "target_density ** (i / steps); later events choose the mask again at the target.",
    )


class _ModelSection(_Section):
    """What every model section shares: which of its tensors train and travel."""

    exchange: tuple[str, ...] | Literal["trainable"] | None = Field(
        None,
        description="Partial-model exchange: name patterns (fnmatch, against a parameter's full name, any of its "
        "dotted parts or a module prefix) of the parameters that train and travel, or 'trainable' for those that "
        "require grad. The others stay at their initial values. None: every parameter (or, with model.adapter, "
        "'trainable').",
    )
    adapter: LoraAdapter | None = Field(None, description="Put LoRA adapters on the model (None: none).")
    prune: PruneConfig | None = Field(
        None,
        description="Prune the global model by magnitude on a schedule; clients train the kept weights only, and "
        "weights and updates travel sparse (None: no pruning).",
    )

    @field_validator("exchange", mode="before")
    @classmethod
    def _pattern_list(cls, value: Any) -> Any:
        if isinstance(value, str) and value != "trainable":
            raise ValueError("must be a list of name patterns or 'trainable'")
        if isinstance(value, list | tuple) and (not value or any(not pattern for pattern in value)):
            raise ValueError("needs at least one non-empty name pattern (or 'trainable')")
        return value

    @property
    def partial(self) -> bool:
        """Whether only part of the model trains and travels (``exchange`` or ``adapter`` set)."""
        return self.exchange is not None or self.adapter is not None


class MLPModel(_ModelSection):
    """Fully connected ReLU network."""

    kind: Literal["mlp"] = "mlp"
    hidden: tuple[int, ...] = Field((64,), description="Widths of the hidden layers.")

    @model_validator(mode="after")
    def _positive(self) -> MLPModel:
        if any(h < 1 for h in self.hidden):
            raise ValueError("hidden widths must be >= 1")
        return self


class SmallCNNModel(_ModelSection):
    """Two conv layers and a linear head; flat inputs are reshaped to ``(C, H, W)``."""

    kind: Literal["cnn"] = "cnn"
    in_channels: int = Field(1, ge=1, description="Input channels of the images.")
    image_size: tuple[int, int] = Field(
        (8, 8),
        description="Height and width of the images: each sample's features are read as in_channels x height x width.",
    )
    channels: tuple[int, int] = Field((16, 32), description="Output channels of the two convolution layers.")


class GRUModel(_ModelSection):
    """A character-level language model: embedding, GRU, linear head over the characters (task = 'language_model')."""

    kind: Literal["gru"] = "gru"
    embed: int = Field(32, ge=1, le=4096, description="Width of a character's embedding.")
    hidden: int = Field(128, ge=1, le=8192, description="Width of the GRU's state.")
    layers: int = Field(1, ge=1, le=8, description="Stacked GRU layers.")


ModelConfig = Annotated[MLPModel | SmallCNNModel | GRUModel, Field(discriminator="kind")]


class FedBNPersonal(_Section):
    """FedBN (Li et al., ICLR 2021): named layers are trained by each client and never leave it.

    The server's copy of those layers keeps its initial values; each client keeps its own (bounded in memory, spilled
    to disk, checkpointed) and trains from them at every task. The other layers are federated as usual.
    """

    kind: Literal["fedbn"] = "fedbn"
    layers: tuple[str, ...] | None = Field(
        None,
        description="Name patterns of the local layers' parameters and buffers (fnmatch against a full dotted name, "
        "any of its parts or a module prefix, as model.exchange). None: every normalization layer (BatchNorm, "
        "LayerNorm, GroupNorm, InstanceNorm).",
    )
    max_in_memory: int = Field(1024, ge=1, description="Clients' local layers kept in memory; older ones spill.")
    spill_dir: str | None = Field(None, description="Where clients' local layers spill (default: a temporary folder).")

    @field_validator("layers", mode="before")
    @classmethod
    def _pattern_list(cls, value: Any) -> Any:
        if isinstance(value, str):
            raise ValueError("must be a list of name patterns")
        if isinstance(value, list | tuple) and (not value or any(not pattern for pattern in value)):
            raise ValueError("needs at least one non-empty name pattern (or leave it out: normalization layers)")
        return value


class FineTunePersonal(_Section):
    """Local fine-tuning: each evaluating client evaluates the downloaded model after ``steps`` local SGD steps on
    its own training samples (``client_eval/personal/*``, beside the downloaded model's figures); its training and
    its update are unchanged. It reports through client-side evaluation (``eval.clients``)."""

    kind: Literal["finetune"] = "finetune"
    steps: int = Field(5, ge=1, description="Local SGD steps (batches of client.batch_size) of the fine-tuning.")
    lr: float | None = Field(None, gt=0.0, description="Fine-tuning learning rate (None: client.lr).")


class DittoPersonal(_Section):
    """Ditto (Li et al., ICML 2021): beside its usual update of the global model, each client trains a personal model
    on its own samples with the proximal term ``lambda/2 ||v - w||^2`` towards the downloaded model ``w``, and keeps
    it (bounded in memory, spilled to disk, checkpointed). Client-side evaluation (``eval.clients``) reports it as
    ``personal/*``."""

    kind: Literal["ditto"] = "ditto"
    lam: float = Field(0.1, gt=0.0, description="lambda: weight of the proximal term towards the global model.")
    steps: int | None = Field(
        None, ge=1, description="Local SGD steps of the personal model per task (None: those of the global update)."
    )
    lr: float | None = Field(None, gt=0.0, description="The personal model's learning rate (None: client.lr).")
    max_in_memory: int = Field(1024, ge=1, description="Personal models kept in memory; older ones spill.")
    spill_dir: str | None = Field(None, description="Where personal models spill (default: a temporary folder).")


PersonalConfig = Annotated[FedBNPersonal | FineTunePersonal | DittoPersonal, Field(discriminator="kind")]
"""How clients personalize the federated model (``client.personal``)."""


class ClientConfig(_Section):
    """Local training of one client task: SGD over the client's own samples."""

    epochs: int = Field(5, ge=1, description="Passes over its samples a client makes per task.")
    max_steps: int | None = Field(None, ge=1, description="Cap on local steps per task (None: whole epochs).")
    batch_size: int = Field(16, ge=1, description="Samples per local step.")
    lr: float = Field(0.1, gt=0.0, description="Local SGD learning rate.")
    momentum: float = Field(0.0, ge=0.0, lt=1.0, description="Local SGD momentum (0: plain SGD), reset at every task.")
    weight_decay: float = Field(0.0, ge=0.0, description="Local L2 weight decay.")
    clip_norm: float | None = Field(None, gt=0.0, description="Clip the gradient's global L2 norm.")
    proximal_mu: float = Field(
        0.0,
        ge=0.0,
        description="FedProx (Li et al., MLSys 2020): add mu/2 ||w - w_base||^2 to the local objective (0: off).",
    )
    precision: Literal["fp32", "bf16", "fp16"] = Field(
        "fp32", description="bf16 = autocast of the forward pass; fp16 = autocast with dynamic loss scaling (CUDA)."
    )
    personal: PersonalConfig | None = Field(
        None, description="Personalization: each client keeps part of the model as its own (None: one global model)."
    )
    checkpoint_segments: int = Field(
        0,
        ge=0,
        description="Gradient checkpointing: recompute each nn.Sequential block in this many segments (0: off).",
    )
