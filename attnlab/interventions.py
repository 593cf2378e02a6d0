"""The API's interventions as small dataclasses (docs/api.md "Interventions"): one class per `op`, its fields the
request's, each with `to_json()` giving the item the server takes. The server checks them (a layer, head or token
out of range is its 422, raised here as LabError naming `interventions[i]...`); these classes only spell them.

Every op has the same optional scope: `layers` and `heads` (None = all; heads are query heads) and, for
encoder–decoders and Whisper, `kind` ("encoder", "decoder" or "cross"; None = every kind).
"""
from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any, ClassVar, Sequence

Indices = Sequence[int] | None


def _indices(value: Indices) -> list[int] | None:
    return None if value is None else [int(v) for v in value]


@dataclass(frozen=True)
class Intervention:
    """The common scope. Subclasses set `op` and add their fields."""

    op: ClassVar[str] = ""

    def to_json(self) -> dict[str, Any]:
        """The request item: `op` first, then every field that is not left at None."""
        item: dict[str, Any] = {"op": self.op}
        for spec in fields(self):
            value = getattr(self, spec.name)
            if value is None:
                continue
            if spec.name in ("layers", "heads", "tokens"):
                value = _indices(value)
            item[spec.name] = value
        return item


@dataclass(frozen=True)
class Temperature(Intervention):
    """Set β (the inverse temperature of the softmax, 0 < β ≤ 1e4) of the scoped heads (science.md §2)."""

    beta: float
    layers: Indices = None
    heads: Indices = None
    kind: str | None = None
    op: ClassVar[str] = "temperature"


@dataclass(frozen=True)
class MaskKeys(Intervention):
    """M[:, j] = −∞ for each listed key j: no query of the scoped heads may attend to them (§3)."""

    tokens: Sequence[int]
    layers: Indices = None
    heads: Indices = None
    kind: str | None = None
    op: ClassVar[str] = "mask_keys"


@dataclass(frozen=True)
class Causal(Intervention):
    """M[i, j] = −∞ for j > i: the scoped heads of an encoder see only earlier tokens (§3)."""

    layers: Indices = None
    heads: Indices = None
    kind: str | None = None
    op: ClassVar[str] = "causal"


@dataclass(frozen=True)
class AblateHeads(Intervention):
    """The scoped heads' outputs become 0 ("zero") or their mean over positions ("mean") before W_O."""

    mode: str | None = None  # None: the server's default, "zero"
    layers: Indices = None
    heads: Indices = None
    kind: str | None = None
    op: ClassVar[str] = "ablate_heads"


@dataclass(frozen=True)
class _Perturb(Intervention):
    tokens: Indices = None  # None = all
    noise_std: float = 0.0  # σ of ε ~ N(0, σ² I)
    scale: float = 1.0  # α in x̂ = α x + ε
    seed: int = 0  # the same request always draws the same ε
    layers: Indices = None
    heads: Indices = None
    kind: str | None = None


@dataclass(frozen=True)
class PerturbKeys(_Perturb):
    """k̂_j = α k_j + ε for the listed keys (§4)."""

    op: ClassVar[str] = "perturb_keys"


@dataclass(frozen=True)
class PerturbQueries(_Perturb):
    """q̂_i = α q_i + ε for the listed query rows (§4)."""

    op: ClassVar[str] = "perturb_queries"


@dataclass(frozen=True)
class PatchHeads(Intervention):
    """The scoped heads' outputs replaced by those of a kept clean run (`source`: a patching result's run id)."""

    source: str
    layers: Indices = None
    heads: Indices = None
    op: ClassVar[str] = "patch_heads"


@dataclass(frozen=True)
class PatchResidual(Intervention):
    """The residual stream after the scoped layers, at positions `tokens` (None = all), replaced by the source run's."""

    source: str
    layers: Indices = None
    tokens: Indices = None
    op: ClassVar[str] = "patch_residual"


@dataclass(frozen=True)
class Positions(Intervention):
    """The model's positions switched off ("off": absolute position embeddings zeroed, rotary embeddings at position
    0) or permuted among the tokens by `seed` ("shuffle"); encoders, decoder LMs and ViTs (science.md "Positions
    off"). Acts on the input embeddings: it has no layers or heads."""

    mode: str = "off"
    seed: int = 0
    op: ClassVar[str] = "positions"


OPS: dict[str, type[Intervention]] = {cls.op: cls for cls in (
    Temperature, MaskKeys, Causal, AblateHeads, PerturbKeys, PerturbQueries, PatchHeads, PatchResidual, Positions)}


def to_items(interventions: Sequence[Intervention | dict] | None) -> list[dict[str, Any]]:
    """The request's list: dataclasses as their JSON, dicts (an op the client has no class for yet) as they are."""
    items = []
    for index, item in enumerate(interventions or ()):
        if isinstance(item, Intervention):
            items.append(item.to_json())
        elif isinstance(item, dict):
            items.append(dict(item))
        else:
            raise TypeError(f"interventions[{index}]: an attnlab intervention (Temperature, MaskKeys, …) or a dict, "
                            f"not {type(item).__name__}")
    return items
