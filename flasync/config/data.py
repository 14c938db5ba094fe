"""Where the samples come from (digits, diabetes, synthetic, your own files) and how they are split over clients."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import Field, field_validator, model_validator

from flasync.config._base import _FieldError, _Section


class DigitsData(_Section):
    """scikit-learn's handwritten digits: 1797 images of 8x8 pixels, 10 classes, shipped with the package."""

    kind: Literal["digits"] = "digits"
    test_fraction: float = Field(0.2, gt=0.0, lt=1.0, description="Held-out share, stratified by label.")


class DiabetesData(_Section):
    """scikit-learn's diabetes regression data: 442 patients, 10 features, a standardized real target (offline)."""

    kind: Literal["diabetes"] = "diabetes"
    test_fraction: float = Field(0.2, gt=0.0, lt=1.0, description="Held-out share, drawn at random.")


class SyntheticData(_Section):
    """The tutorials' generator: ``x ~ N(0, 1)``, ``y`` uniform, ``x[y mod d] += 2``."""

    kind: Literal["synthetic"] = "synthetic"
    samples_per_client: int = Field(200, ge=1, le=10_000_000, description="Training samples generated per client.")
    num_features: int = Field(32, ge=1, le=1_000_000, description="Features per synthetic sample.")
    num_classes: int = Field(10, ge=2, le=1_000_000, description="Classes of the synthetic labels.")
    test_samples: int = Field(
        2000, ge=1, le=10_000_000, description="Samples of the held-out split the server evaluates on."
    )
    lazy: bool = Field(
        False,
        description="Draw each client's samples when it is sampled, from its own stream (for millions of clients). "
        "Every client holds samples_per_client (quantity: that many on average) and iid, dirichlet and shards do "
        "not apply; label_quantity and feature_skew apply to each client's own draw.",
    )


FILE_FORMATS = (".npz", ".pt", ".csv", ".parquet", ".txt")
"""The file suffixes ``data.kind = "files"`` reads (the format follows from the suffix, case-insensitively)."""


class FilesData(_Section):
    """Your own data, read from a ``.npz``, ``.pt``, ``.csv`` or ``.parquet`` file, or a ``.txt`` file of text.

    Arrays (``.npz``, ``.pt``): ``features`` names one array of shape ``(N, ...)``, ``label`` one of shape ``(N,)``,
    ``client_column`` (if set) one of shape ``(N,)``. Tables (``.csv`` with a header row, ``.parquet``): ``features``
    lists feature columns (default: every column but the label and client columns). Features become float32, labels
    are integer class ids or (tables and ``.npz``) text mapped to ids in sorted order. A relative path in a config
    file is read from that file's folder; one given by ``--set`` or in Python, from the working directory.

    Text (``.txt``, UTF-8, ``task = "language_model"``): every character after the first ``context`` is a sample
    predicting it from the ``context`` before it; ``partition.kind = "line_blocks"`` gives each client a block of
    consecutive lines.
    """

    kind: Literal["files"] = "files"
    train: str = Field(min_length=1, description="Training data: a .npz, .pt, .csv or .parquet file.")
    test: str | None = Field(
        None, min_length=1, description="Held-out data in the same layout (default: a test_fraction split of train)."
    )
    test_fraction: float = Field(
        0.2,
        gt=0.0,
        lt=1.0,
        description="Held-out share when test is unset: stratified by label, or by client with by_column.",
    )
    features: tuple[str, ...] | None = Field(
        None,
        description="Arrays: the one feature key (default 'x'); tables: the feature columns (default: all others).",
    )
    label: str = Field("y", min_length=1, description="The label key or column.")
    client_column: str | None = Field(
        None, min_length=1, description="The key or column naming each sample's client (user, device) for by_column."
    )
    num_classes: int | None = Field(None, ge=2, le=1_000_000, description="Default: inferred from the labels.")
    context: int = Field(
        32,
        ge=1,
        le=4096,
        description="A .txt file (task = 'language_model'): characters each sample sees before the one it predicts.",
    )

    @property
    def text(self) -> bool:
        """Whether the data is a text file (``.txt``): next-character samples for ``task = "language_model"``."""
        return Path(self.train).suffix.lower() == ".txt"

    @field_validator("features", mode="before")
    @classmethod
    def _one_name_is_a_list(cls, value: Any) -> Any:
        return (value,) if isinstance(value, str) else value

    @model_validator(mode="after")
    def _check_files(self) -> FilesData:
        for name in ("train", "test"):
            path: str | None = getattr(self, name)
            if path is not None and Path(path).suffix.lower() not in FILE_FORMATS:
                raise _FieldError(("data", name), f"unsupported format of {path!r} (use {', '.join(FILE_FORMATS)})")
        if self.test is not None and (Path(self.test).suffix.lower() == ".txt") != self.text:
            raise _FieldError(("data", "test"), "must be a .txt file exactly when data.train is one")
        if self.test is not None and self.test_fraction != FilesData.model_fields["test_fraction"].default:
            raise _FieldError(("data", "test_fraction"), "is not used when data.test is set; remove one of them")
        if self.features is not None:
            if not self.features or any(not name for name in self.features):
                raise _FieldError(("data", "features"), "must name at least one key or column, none empty")
            arrays = [p for p in (self.train, self.test) if p and Path(p).suffix.lower() in (".npz", ".pt")]
            if arrays and len(self.features) != 1:
                raise _FieldError(("data", "features"), f"{arrays[0]!r} holds its features in one array; name one key")
            for column in (self.label, self.client_column):
                if column in self.features:
                    raise _FieldError(("data", "features"), f"{column!r} is the label or client column")
        if self.client_column is not None and self.client_column == self.label:
            raise _FieldError(("data", "client_column"), f"{self.label!r} is already the label")
        return self


DataSource = Annotated[DigitsData | DiabetesData | SyntheticData | FilesData, Field(discriminator="kind")]


class IIDPartition(_Section):
    """Shuffle and deal samples evenly."""

    kind: Literal["iid"] = "iid"


class DirichletPartition(_Section):
    """Per-label Dirichlet(alpha) proportions over clients (Hsu et al. 2019); small alpha = more skew."""

    kind: Literal["dirichlet"] = "dirichlet"
    alpha: float = Field(
        0.5,
        gt=0.0,
        description="Dirichlet concentration: small values give each client few labels (non-IID), large ones near IID.",
    )
    min_samples: int = Field(
        1,
        ge=1,
        description="Fewest training samples a client may get (short clients are redrawn, then topped up).",
    )


class ShardsPartition(_Section):
    """Sort by label, cut into shards, deal ``shards_per_client`` to each client (McMahan et al. 2017)."""

    kind: Literal["shards"] = "shards"
    shards_per_client: int = Field(
        2, ge=1, description="Label-sorted shards each client gets (McMahan et al. 2017's pathological non-IID split)."
    )


class ByColumnPartition(_Section):
    """The data's natural partition: one client per distinct value of ``data.client_column`` (a user, a device).

    Clients are numbered in sorted order of those values and keep their samples in file order. The population size
    is the number of clients kept: leave ``population.num_clients`` unset, or set it to that number.
    """

    kind: Literal["by_column"] = "by_column"
    min_samples: int = Field(
        1, ge=1, description="Drop clients with fewer training samples (their samples go unused), as LEAF does."
    )


class LabelQuantityPartition(_Section):
    """Each client holds samples of exactly ``labels_per_client`` labels (NIID-Bench's ``#C=k``, Li et al. 2022).

    Client ``i`` holds label ``i mod C`` and ``labels_per_client - 1`` others drawn at random; each label's samples
    are dealt evenly among the clients holding it.
    """

    kind: Literal["label_quantity"] = "label_quantity"
    labels_per_client: int = Field(2, ge=1, le=1_000_000, description="Distinct labels every client holds (k).")


class QuantityPartition(_Section):
    """Labels spread IID, but client sizes drawn from a lognormal or a power law (quantity skew).

    ``lognormal``: sizes in proportion to ``exp(N(0, sigma^2))``; ``powerlaw``: in proportion to Pareto draws of
    density ``(a - 1) w^-a`` (``a = exponent``). Every client first gets ``min_samples``.
    """

    kind: Literal["quantity"] = "quantity"
    distribution: Literal["lognormal", "powerlaw"] = Field(
        "lognormal", description="Law of the client sizes: lognormal (sigma) or power law (exponent)."
    )
    sigma: float | None = Field(
        None, ge=0.0, le=10.0, description="Log-space spread of the lognormal sizes (default 1; lognormal only)."
    )
    exponent: float | None = Field(
        None, gt=1.0, le=100.0, description="The power law's exponent a > 1 (default 2; powerlaw only)."
    )
    min_samples: int = Field(1, ge=1, description="Fewest training samples a client gets.")

    @model_validator(mode="after")
    def _parameter_of_its_law(self) -> QuantityPartition:
        unused = "exponent" if self.distribution == "lognormal" else "sigma"
        if getattr(self, unused) is not None:
            raise _FieldError(("partition", unused), f"is not used with distribution = {self.distribution!r}")
        return self


class FeatureSkewPartition(_Section):
    """An IID split whose clients see different features: Gaussian noise growing with the client id, rotations.

    Client ``k`` of ``K`` gets noise of standard deviation ``noise * (k + 1) / K`` on every feature (NIID-Bench's
    noise-based feature skew) after its features are rotated by the random orthogonal matrix of group
    ``k mod rotations`` (group 0 unrotated). The held-out data stays clean.
    """

    kind: Literal["feature_skew"] = "feature_skew"
    noise: float = Field(0.0, ge=0.0, le=1000.0, description="The largest client's noise standard deviation.")
    rotations: int = Field(1, ge=1, le=64, description="Groups of clients with their own random rotation (1: none).")

    @model_validator(mode="after")
    def _some_skew(self) -> FeatureSkewPartition:
        if self.noise == 0 and self.rotations == 1:
            raise _FieldError(("partition", "noise"), "feature_skew needs noise > 0 or rotations > 1")
        return self


class LineBlocksPartition(_Section):
    """A text file's natural partition (``.txt``): ``population.num_clients`` blocks of consecutive lines."""

    kind: Literal["line_blocks"] = "line_blocks"


PartitionConfig = Annotated[
    IIDPartition
    | DirichletPartition
    | ShardsPartition
    | ByColumnPartition
    | LabelQuantityPartition
    | QuantityPartition
    | FeatureSkewPartition
    | LineBlocksPartition,
    Field(discriminator="kind"),
]
