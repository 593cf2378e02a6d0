"""What an intervention op is: one `Op` object per op (models/ops/<op>.py), registered in models/ops/__init__.py.

An op carries everything the lab needs of it, so nothing outside models/ops/ asks an intervention for its name:

- `schema`: the request item (a pydantic model; app/schemas.py builds the request's discriminated union from the
  registry) and `fields`, the op's own fields beside the scope (layers, heads, kind);
- its checks: `validate` (the engine's, on an `Intervention`), and the declarations app/interventions.py checks a
  request item against the model with: `scoped` (False: layers and heads must be null), `tokens_index` (whether
  `tokens` names keys or query rows) and `patch_source` (a kept run's head outputs or residual stream);
- its contribution to a layer's plan (`plan`: what it does to β, the key mask, the causal flags, head ablation and
  the q/k perturbations), which short runs (models/interventions.py) and the blockwise atlas (models/atlas.py) both
  read, and `touches_outputs`/`head_outputs` when it acts on head outputs (models/head_ops.py);
- `record`: what a kept run's file keeps of it (app/runfile.py);
- how a Whisper run applies it (`for_whisper`, `for_keys_so_far`: models/adapters/whisper.py).

An op file imports this module (and what it acts with: another op's file, models/run_context.py), never
models/ops/__init__.py nor models/interventions.py: the engine's Intervention reaches it as a value, so the registry
has no import circle.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Annotated, Any, ClassVar, Literal

import torch
from pydantic import BaseModel, ConfigDict, Field

# A run id as app/ids.py makes it: `<replica>.<32 hex>` (tests/unit/test_op_registry.py keeps the two the same).
RUN_ID_FORM = r"^([a-z0-9]{4,16})\.[0-9a-f]{32}$"
# Each index is checked against the model and the input (app/interventions.py), whose sizes the settings bound: no
# length cap here. Settings are the only source of limits; schemas carry types.
IndexList = list[Annotated[int, Field(ge=0)]]
AttentionKind = Literal["encoder", "decoder", "cross"]


class StrictItem(BaseModel):
    # Python's JSON parser accepts NaN/Infinity: refuse them here so they end in a 422. strict: no coercion
    # ("heads": [true] is not head 1, "seed": false is not 0): a wrong type is a 422.
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False, strict=True)


class ScopedItem(StrictItem):
    """The scope every request item has: which layers and heads (null = all), and for encoder–decoders the kind."""

    layers: IndexList | None = Field(None, description="layers the intervention applies to (null = all)")
    heads: IndexList | None = Field(None, description="heads the intervention applies to (null = all; always query heads)")
    kind: AttentionKind | None = Field(
        None, description="encoder–decoder models: the attention kind targeted (null = all kinds; see /guide#s9); "
        "layers count within the kind. Other models: must be null"
    )


@dataclass
class LayerPlan:
    """What the interventions ask of one layer, gathered once before the scores are formed."""

    beta: torch.Tensor  # (H,) inverse temperature per head
    key_mask: torch.Tensor  # (H, T_k) bool, True = masked key
    causal: torch.Tensor  # (H,) bool
    ablate: torch.Tensor  # (H,) bool
    key_perturbations: list[Any] = field(default_factory=list)  # Interventions, applied in order
    query_perturbations: list[Any] = field(default_factory=list)


class Op:
    """One intervention op. Subclasses set the class attributes and override what the op does; the defaults are
    an op that does nothing to a layer's plan, head outputs or a Whisper run."""

    name: ClassVar[str] = ""
    schema: ClassVar[type[BaseModel]]
    fields: ClassVar[tuple[str, ...]] = ()  # the op's own fields (besides layers/heads): what a run file keeps
    scoped: ClassVar[bool] = True  # False: acts before any layer (the input embeddings); layers/heads must be null
    unscoped_why: ClassVar[str] = ""  # the 422's reason when a scope is given to an op that takes none
    tokens_index: ClassVar[Literal["keys", "rows"]] = "keys"  # what `tokens` names: key columns or query rows
    patch_source: ClassVar[Literal["heads", "residual"] | None] = None  # a kept run's part it reads (app/patch_sources.py)
    reseeded: ClassVar[bool] = False  # samples > 1 move its `seed` (a noise draw per sample)
    patches_residual: ClassVar[bool] = False  # replaces the residual stream after its layers (models/head_ops.py)

    # ---- the engine's check -------------------------------------------------------------------------
    def validate(self, iv: Any) -> None:
        """Raise ValueError when `iv` (a models/interventions.py Intervention of this op) cannot run."""

    # ---- what it does -------------------------------------------------------------------------------
    def plan(self, iv: Any, plan: LayerPlan, heads: list[int], n_keys: int) -> None:
        """Its part of one layer's plan (the heads are checked already); later items override earlier ones."""

    def touches_outputs(self, iv: Any) -> bool:
        """Whether it acts on the head outputs H = PV before W_O (then `head_outputs` is called)."""
        return False

    def head_outputs(self, iv: Any, output: torch.Tensor, layer: int, sources: Any, query_offset: int) -> torch.Tensor:
        """H (B, H, T_q, d_v) after this op, at a layer it applies to; row r is token position query_offset + r."""
        return output

    def continuation_refusal(self, item: Any) -> tuple[str, str] | None:
        """(field, why) when a continuation (one new token per step) cannot apply this request item, else None."""
        return None

    # ---- a Whisper run ------------------------------------------------------------------------------
    def for_whisper(self, iv: Any, query_scale: float) -> Any:
        """The item on Whisper's pre-scaled queries q/√d (query_scale = 1/√d)."""
        return iv

    def for_keys_so_far(self, iv: Any, n_keys: int, decoder_layers: set[int]) -> Any:
        """The item while decoding with `n_keys` decoder keys so far (None: nothing of it applies yet)."""
        return iv

    # ---- what a run keeps ---------------------------------------------------------------------------
    def record(self, iv: Any) -> dict[str, Any]:
        """What a kept run's file keeps of `iv`: its op, its scope and its own fields."""
        return {"op": iv.op, "layers": iv.layers, "heads": iv.heads, **{name: getattr(iv, name) for name in self.fields}}


def replaced(iv: Any, **changes: Any) -> Any:
    return dataclasses.replace(iv, **changes)


def registry(*ops: Op) -> dict[str, Op]:
    """The ops by name, in the order given (the request schema's order); a name given twice is an error."""
    table: dict[str, Op] = {}
    for op in ops:
        if not op.name or op.name in table:
            raise ValueError(f"op name {op.name!r} is empty or registered twice")
        table[op.name] = op
    return table
