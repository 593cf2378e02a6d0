"""Why a head attends: the exact query–key attribution of one attention score (docs/science.md "Query–key attribution").

In a pre-norm Transformer the residual stream entering layer l at position p is a sum of parts: the embedding (with
learned positions), each earlier head's output through its slice of W_O, each earlier MLP's output, and the output
biases. Freeze every norm at the scale it actually had at that position (and its mean, for LayerNorm): the norm is
then a linear map, and so is everything between the residual stream and the score — W_Q / W_K and their biases,
Gemma's q/k norms (frozen the same way), RoPE at the position, a perturbation's α. The query q_i and key k_j of one
head are then sums of one term per part, and the score splits exactly:

    β·Ŝ_ij = Σ_a Σ_b β · q_i(a) · k_j(b)

The run is the lab's own (models/hooks.py, with the request's interventions); forward hooks read what it computed:
every block's input, each head's output z before W_O (after any ablation or patch: models/head_ops.py records it),
each MLP's contribution and the attention layer's RoPE tables. A key-side head part can be expanded by the source
positions its head attended to: z_j = Σ_m P[j, m] v_m, each term pushed through the same frozen chain.

Post-norm models (BERT: the norm comes after the residual sum) have no such sum of parts and are refused.
"""
from __future__ import annotations

import contextlib
import contextvars
import dataclasses
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from models.adapters.base import RequestFieldError
from models.anatomy import attention_modules, layer_blocks
from models.head_ops import HeadRun, head_run
from models.interventions import Intervention, noise_for, plan_layer
from models.ops import OPS

# Σ parts must give back what the run computed (its residual stream, its q̂ and k̂) within this, relative to the
# vector's norm: a larger gap means this architecture does something the decomposition does not model
RECONSTRUCTION_TOLERANCE = 1e-4
# A float16/bfloat16 run rounds every intermediate to 11 or 8 bits, which the float64 parts do not: such runs are
# held to what that precision allows
HALF_PRECISION_TOLERANCE = 3e-2
_tolerance: contextvars.ContextVar[float] = contextvars.ContextVar("attnlab_qk_tolerance",
                                                                  default=RECONSTRUCTION_TOLERANCE)
TOP_PAIRS = 10

_capturing: contextvars.ContextVar[dict | None] = contextvars.ContextVar("attnlab_qk_capture", default=None)


class NotPreNorm(RequestFieldError):
    """The model normalises after the residual sum (BERT and other post-norm encoders): refused, naming `model`."""

    def __init__(self, message: str):
        super().__init__("model", message)


class AttributionUnsupported(RequestFieldError):
    """The model's blocks are not of a shape the decomposition knows (named `model`)."""

    def __init__(self, message: str):
        super().__init__("model", message)


# ---- the model's pieces --------------------------------------------------------------------------------------------
@dataclass
class BlockAnatomy:
    """Where one pre-norm block's pieces are. Its update is x + post_attn(attn(input_norm(x))) and then
    + mlp_out(...): `post_attention_norm` is Gemma's sandwich norm on the attention output (None elsewhere);
    `mlp_output` the module whose output is what the MLP adds to the stream (Gemma: post_feedforward_layernorm)."""

    input_norm: nn.Module
    attention: nn.Module
    out_proj: nn.Module
    post_attention_norm: nn.Module | None
    mlp_output: nn.Module


def block_anatomy(block: nn.Module, attention: nn.Module) -> BlockAnatomy:
    input_norm = getattr(block, "input_layernorm", None) or getattr(block, "ln_1", None)
    if input_norm is None:
        if _is_post_norm(block):
            raise NotPreNorm(
                f"{type(block).__name__} is post-norm: its LayerNorm comes after the residual sum "
                "(x ← norm(x + attention(x))), so the stream entering a layer is not a sum of the earlier parts and "
                "the score cannot be split exactly. Query–key attribution is offered for pre-norm decoders "
                "(Llama, Qwen2, Gemma 2/3, GPT-2)")
        raise AttributionUnsupported(f"{type(block).__name__}: no input norm (input_layernorm / ln_1) found; "
                                     "query–key attribution knows pre-norm decoder blocks only")
    out_proj = next((getattr(attention, n) for n in ("o_proj", "c_proj") if hasattr(attention, n)), None)
    if out_proj is None or not hasattr(block, "mlp"):
        raise AttributionUnsupported(f"{type(block).__name__}: no output projection or MLP found")
    sandwich = hasattr(block, "pre_feedforward_layernorm")  # Gemma 2/3: norms on both sides of each sublayer
    return BlockAnatomy(
        input_norm=input_norm, attention=attention, out_proj=out_proj,
        post_attention_norm=block.post_attention_layernorm if sandwich else None,
        mlp_output=getattr(block, "post_feedforward_layernorm", None) if sandwich else block.mlp,
    )


def _is_post_norm(block: nn.Module) -> bool:
    """BERT-style blocks: attention.output.LayerNorm / output.LayerNorm after the residual sum."""
    return any(isinstance(m, nn.LayerNorm) and name.endswith("LayerNorm") for name, m in block.named_modules()) or \
        hasattr(block, "self_attn_layer_norm") or hasattr(block, "final_layer_norm")


def check_pre_norm(model: nn.Module, layer_of: dict[int, int]) -> list[BlockAnatomy]:
    """Every layer's anatomy; NotPreNorm / AttributionUnsupported (naming `model`) when the model has none."""
    blocks = layer_blocks(model, layer_of)
    return [block_anatomy(b, a) for b, a in zip(blocks, attention_modules(model, layer_of))]


def qkv_weights(attention: nn.Module, n_heads: int, n_kv_heads: int, head_dim: int) -> dict[str, tuple]:
    """W and b of the query and key projections, in x @ W + b form, float64: {"q": ((D, H·d), (H·d,)|None),
    "k": ((D, H_kv·d), …)}. Separate q_proj/k_proj (Llama, Qwen2, Gemma) or GPT-2's fused c_attn (Conv1D)."""
    if hasattr(attention, "q_proj"):
        def of(linear: nn.Linear) -> tuple:
            return linear.weight.detach().double().T, None if linear.bias is None else linear.bias.detach().double()
        return {"q": of(attention.q_proj), "k": of(attention.k_proj)}
    if hasattr(attention, "c_attn"):  # GPT-2: Conv1D, weight (D, 3D) already in x @ W form
        weight, bias = attention.c_attn.weight.detach().double(), attention.c_attn.bias.detach().double()
        width = n_heads * head_dim
        return {"q": (weight[:, :width], bias[:width]), "k": (weight[:, width:2 * width], bias[width:2 * width])}
    raise AttributionUnsupported(f"{type(attention).__name__}: no q_proj/k_proj or c_attn found")


def out_weights(proj: nn.Module, n_heads: int, head_dim: int) -> tuple[torch.Tensor, torch.Tensor | None]:
    """W_O as (H, d_v, D) float64 and its bias (D,) or None; nn.Linear or GPT-2's Conv1D."""
    weight = proj.weight.detach().double()
    matrix = weight.T if isinstance(proj, nn.Linear) else weight  # (H·d_v, D)
    bias = getattr(proj, "bias", None)
    return matrix.reshape(n_heads, head_dim, -1), None if bias is None else bias.detach().double()


@dataclass
class FrozenNorm:
    """A norm at one position as the linear map it is there: v ↦ scale ⊙ (v − mean(v) if center else v), plus `bias`
    (a constant, LayerNorm's β) added once."""

    scale: torch.Tensor  # (D,) float64
    center: bool = False
    bias: torch.Tensor | None = None

    def apply(self, parts: torch.Tensor) -> torch.Tensor:
        """The linear part on each row of parts (A, D) → (A, D); the bias is not added."""
        if self.center:
            parts = parts - parts.mean(dim=-1, keepdim=True)
        return parts * self.scale


def freeze_norm(norm: nn.Module, x: torch.Tensor) -> FrozenNorm:
    """`norm` frozen at its value for the vector x (D,) (float64): LayerNorm subtracts x's mean and divides by its
    std; RMSNorm (Llama's g ⊙ x, Gemma's (1 + g) ⊙ x) divides by rms(x). The gain is read by applying the norm to a
    vector of ones (rms 1), so either convention is found; the frozen map is then checked against the norm itself."""
    if isinstance(norm, nn.LayerNorm):
        inv_std = torch.rsqrt(x.var(unbiased=False) + norm.eps)
        weight = norm.weight.detach().double() if norm.weight is not None else torch.ones_like(x)
        frozen = FrozenNorm(weight * inv_std, center=True,
                            bias=None if norm.bias is None else norm.bias.detach().double())
    else:
        eps = getattr(norm, "variance_epsilon", None)
        eps = getattr(norm, "eps", None) if eps is None else eps
        weight = getattr(norm, "weight", None)
        if eps is None or weight is None:
            raise AttributionUnsupported(f"{type(norm).__name__}: a norm without weight/eps cannot be frozen here")
        ones = torch.ones(x.shape[-1], dtype=weight.dtype, device=weight.device)
        gain = norm(ones).detach().double().cpu() * (1.0 + float(eps)) ** 0.5  # rms(ones) = 1
        frozen = FrozenNorm(gain * torch.rsqrt(x.pow(2).mean() + float(eps)))
    actual = norm(x.to(norm.weight.dtype if getattr(norm, "weight", None) is not None else torch.float32)
                  .to(_device_of(norm))).detach().double().cpu()
    mine = frozen.apply(x[None])[0] + (frozen.bias if frozen.bias is not None else 0.0)
    _check_close(mine, actual, f"{type(norm).__name__} frozen at its scale")
    return frozen


def _device_of(module: nn.Module) -> torch.device:
    parameter = next(module.parameters(), None)
    return parameter.device if parameter is not None else torch.device("cpu")


def _check_close(mine: torch.Tensor, actual: torch.Tensor, what: str) -> None:
    gap = float((mine - actual).norm())
    if not gap <= _tolerance.get() * max(float(actual.norm()), 1e-12):
        raise AttributionUnsupported(
            f"{what}: the sum of parts differs from what the run computed by {gap:.3g} (norm {float(actual.norm()):.3g}); "
            "this model's blocks do something the decomposition does not model")


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat([-x[..., half:], x[..., :half]], dim=-1)


# ---- capturing the run ---------------------------------------------------------------------------------------------
@contextlib.contextmanager
def _capture(anatomies: list[BlockAnatomy], blocks: list[nn.Module], layer: int) -> Iterator[dict[str, Any]]:
    """Hooks, for this context's forwards only, recording: the input of blocks 0..layer ("block_in", l → (T, D)),
    each earlier MLP's contribution ("mlp", l → (T, D)), each earlier sandwich norm's input (the attention output,
    "attn_out"), and the RoPE tables and normed input of layer `layer`'s attention ("rope", "attn_in")."""
    captured: dict[str, Any] = {"block_in": {}, "mlp": {}, "attn_out": {}}
    handles = []

    def mine() -> bool:
        return _capturing.get() is captured

    def first_tensor(args, kwargs, name):
        return args[0] if args else kwargs[name]

    for l in range(layer + 1):
        def block_in(_m, args, kwargs, l=l):
            if mine():
                captured["block_in"][l] = first_tensor(args, kwargs, "hidden_states")[0].detach()
        handles.append(blocks[l].register_forward_pre_hook(block_in, with_kwargs=True))
    for l in range(layer):
        def mlp(_m, _args, output, l=l):
            if mine():
                captured["mlp"][l] = (output[0] if isinstance(output, tuple) else output)[0].detach()
        handles.append(anatomies[l].mlp_output.register_forward_hook(mlp))
        if anatomies[l].post_attention_norm is not None:
            def attn_out(_m, args, l=l):
                if mine():
                    captured["attn_out"][l] = args[0][0].detach()
            handles.append(anatomies[l].post_attention_norm.register_forward_pre_hook(attn_out))

    def attention_in(_m, args, kwargs):
        if mine():
            captured["attn_in"] = first_tensor(args, kwargs, "hidden_states")[0].detach()
            captured["rope"] = kwargs.get("position_embeddings")
    handles.append(anatomies[layer].attention.register_forward_pre_hook(attention_in, with_kwargs=True))
    token = _capturing.set(captured)
    try:
        yield captured
    finally:
        _capturing.reset(token)
        for handle in handles:
            handle.remove()


# ---- the attribution ---------------------------------------------------------------------------------------------
@dataclass
class Side:
    """One side (query at i, or key at j) of the score, as one vector per part: rows (A, d) float64."""

    names: list[str]
    vectors: torch.Tensor  # (A, d)


@dataclass
class KeyChain:
    """The frozen linear map from a vector added to the residual stream at position j to the head's key k̂_j (no
    constants): what expands a key-side head part by source position."""

    norm: FrozenNorm
    weight: torch.Tensor  # (D, d) this K/V head's columns of W_K
    qk_scale: torch.Tensor | None  # (d,) Gemma's k norm frozen
    cos: torch.Tensor | None  # (d,)
    sin: torch.Tensor | None
    alpha: float  # the product of the key perturbations' α at this head and position

    def after_projection(self, vectors: torch.Tensor) -> torch.Tensor:
        """(A, d) right after W·x (+ b): the qk norm, RoPE, α."""
        if self.qk_scale is not None:
            vectors = vectors * self.qk_scale
        if self.cos is not None:
            vectors = vectors * self.cos + _rotate_half(vectors) * self.sin
        return vectors * self.alpha

    def push(self, residual_parts: torch.Tensor) -> torch.Tensor:
        """(A, D) residual-stream vectors → (A, d) their terms of the key."""
        return self.after_projection(self.norm.apply(residual_parts) @ self.weight)


@dataclass
class QKAttribution:
    score: float  # β·Ŝ_ij as the run formed it (β included; before masks and soft-cap)
    beta: float
    attention: float  # P[i, j] of the run
    query_parts: list[str]
    key_parts: list[str]
    matrix: torch.Tensor  # (Cq, Ck) float64: β · q_i(a) · k_j(b)
    expanded: list[dict[str, Any]] = field(default_factory=list)
    softcap: float | None = None

    def to_dict(self, tokens: list[str] | None = None) -> dict[str, Any]:
        matrix = self.matrix
        flat = matrix.flatten()
        order = torch.argsort(flat.abs(), descending=True)[:TOP_PAIRS].tolist()
        n_keys = matrix.shape[1]
        return {
            "score": self.score, "beta": self.beta, "attention": self.attention, "softcap": self.softcap,
            "query_parts": self.query_parts, "key_parts": self.key_parts, "matrix": matrix.tolist(),
            "query_totals": matrix.sum(dim=1).tolist(), "key_totals": matrix.sum(dim=0).tolist(),
            "top": [{"query_part": self.query_parts[k // n_keys], "key_part": self.key_parts[k % n_keys],
                     "value": float(flat[k])} for k in order],
            "sum": float(matrix.sum()), "expanded": self.expanded,
        }


def residual_parts(captured: dict[str, Any], anatomies: list[BlockAnatomy], head_outputs: dict[int, torch.Tensor],
                   out_weights_of: list[tuple], layer: int, position: int, n_heads: int) -> tuple[list[str], torch.Tensor, torch.Tensor, dict]:
    """The residual stream entering `layer` at `position` as parts: (names, (A, D) float64, the bias (D,), and per
    earlier layer the frozen sandwich norm at this position (or None)). Checked against the block's actual input."""
    names, rows = ["embed"], [captured["block_in"][0][position].double().cpu()]
    bias = torch.zeros_like(rows[0])
    sandwich: dict[int, FrozenNorm | None] = {}
    for l in range(layer):
        w_o, b_o = out_weights_of[l]
        z = head_outputs[l][0, :, position].double().cpu()  # (H, d_v): each head's output before W_O
        heads = torch.einsum("hd,hdD->hD", z, w_o)  # (H, D)
        layer_bias = b_o if b_o is not None else torch.zeros_like(bias)
        norm = None
        if anatomies[l].post_attention_norm is not None:  # Gemma: the attention output normed before it is added
            norm = freeze_norm(anatomies[l].post_attention_norm, captured["attn_out"][l][position].double().cpu())
            heads, layer_bias = norm.apply(heads), norm.apply(layer_bias[None])[0]
            if norm.bias is not None:
                layer_bias = layer_bias + norm.bias
        sandwich[l] = norm
        bias = bias + layer_bias
        names += [f"L{l}.H{h}" for h in range(n_heads)] + [f"L{l}.mlp"]
        rows += list(heads) + [captured["mlp"][l][position].double().cpu()]
    parts = torch.stack(rows)  # (A, D)
    actual = captured["block_in"][layer][position].double().cpu()
    _check_close(parts.sum(dim=0) + bias, actual, f"the residual stream entering layer {layer} at position {position}")
    return names, parts, bias, sandwich


def _perturbations(plan_items: list[Intervention], layer: int, head: int, n_heads: int, position: int,
                   dim: int) -> tuple[float, torch.Tensor | None]:
    """(the product of α, the noise as a part (d,) or None) of the perturbations at (layer, head, position), applied
    in order as the run applies them: x̂ = α x + ε (models/interventions.py perturb_vectors)."""
    alpha, noise = 1.0, None
    for iv in plan_items:
        if head not in iv.head_list(n_heads) or (iv.tokens is not None and position not in iv.tokens):
            continue
        eps = noise_for(iv.seed, layer, head, [position], dim, iv.noise_std)[0].double()  # (d,)
        noise = eps if noise is None else iv.scale * noise + eps
        alpha *= iv.scale
    return alpha, noise


@dataclass(frozen=True)
class _Projection:
    """One side's way from the residual stream to q̂ or k̂: the layer's input norm, this head's columns of the
    projection (and of its bias), and the q/k norm when the family has one."""
    input_norm: nn.Module
    weight: torch.Tensor  # (d_model, head_dim)
    bias: torch.Tensor | None  # (head_dim,)
    qk_norm: nn.Module | None


def _side(names: list[str], parts: torch.Tensor, bias: torch.Tensor, projection: _Projection, rope: tuple | None,
          position: int, alpha: float, noise: torch.Tensor | None) -> tuple[Side, KeyChain]:
    """Push one position's residual parts through the frozen input norm, the projection (this head's columns), the
    frozen q/k norm, RoPE and the perturbations: one vector per part, "bias" collecting every constant and
    "perturbation" the noise."""
    norm_module, weight, proj_bias, qk_norm = projection.input_norm, projection.weight, projection.bias, projection.qk_norm
    x = parts.sum(dim=0) + bias  # the stream as the run had it (checked)
    norm = freeze_norm(norm_module, x)
    linear = norm.apply(torch.cat([parts, bias[None]])) @ weight  # (A + 1, d); the last row: the bias part so far
    if norm.bias is not None:
        linear[-1] += norm.bias @ weight
    if proj_bias is not None:
        linear[-1] += proj_bias
    qk_scale = None
    if qk_norm is not None:  # frozen at the actual pre-norm vector of this head and position
        qk_scale = freeze_norm(qk_norm, linear.sum(dim=0)).scale
    cos = sin = None
    if rope is not None:
        cos, sin = (t[0, position].double().cpu() for t in rope)  # (d,)
    chain = KeyChain(norm, weight, qk_scale, cos, sin, alpha)
    vectors = chain.after_projection(linear)
    out_names = names + ["bias"]
    if noise is not None:
        vectors = torch.cat([vectors, noise[None]])
        out_names = out_names + ["perturbation"]
    keep = [k for k, name in enumerate(out_names) if name != "bias" or bool(vectors[k].abs().max() > 0)]
    return Side([out_names[k] for k in keep], vectors[keep]), chain


def refuse_residual_patches(interventions: tuple[Intervention, ...], layer: int, positions: set[int]) -> None:
    for index, iv in enumerate(interventions):
        if not OPS[iv.op].patches_residual:
            continue
        touched = positions if iv.tokens is None else positions & set(iv.tokens)
        if touched and any(iv.applies_to_layer(l) for l in range(layer)):
            raise RequestFieldError(
                "interventions", f"interventions[{index}]: patch_residual replaces the residual stream at position(s) "
                f"{sorted(touched)} before layer {layer}, so it is no longer a sum of the earlier parts; attribute a "
                "layer at or before the patch, or patch other positions")


@torch.inference_mode()
def qk_attribution(adapter: Any, input_ids: torch.Tensor, layer: int, head: int, query: int, key: int,
                   interventions: tuple[Intervention, ...] = (), expand: int = 3) -> QKAttribution:
    """The exact split of β·Ŝ[query, key] of (layer, head) over query-side × key-side parts of the residual stream.

    adapter: a decoder LM's adapter (CausalLMAdapter); input_ids: (1, T). The run is the lab's own with
    `interventions`. `expand`: how many key-side head parts (largest |total| first) to split by source position.
    """
    half = getattr(adapter, "dtype", torch.float32) in (torch.float16, torch.bfloat16)
    token = _tolerance.set(HALF_PRECISION_TOLERANCE if half else RECONSTRUCTION_TOLERANCE)
    try:
        return _attribution(adapter, input_ids, layer, head, query, key, interventions, expand)
    finally:
        _tolerance.reset(token)


def _attribution(adapter: Any, input_ids: torch.Tensor, layer: int, head: int, query: int, key: int,
                 interventions: tuple[Intervention, ...], expand: int) -> QKAttribution:
    model, info = adapter.model, adapter.info
    anatomies = check_pre_norm(model, adapter.layer_of)
    blocks = layer_blocks(model, adapter.layer_of)
    refuse_residual_patches(interventions, layer, {query, key})
    n_heads, head_dim = info.heads, info.head_dim
    n_kv = info.kv_heads or n_heads
    outer = head_ops_current()
    recording = dataclasses.replace(outer, record={}, values={}) if outer is not None else HeadRun(record={}, values={})
    inputs = {"input_ids": input_ids, "attention_mask": torch.ones_like(input_ids), "logits_to_keep": 1}
    with _capture(anatomies, blocks, layer) as captured, head_run(recording):
        _, scope = adapter._forward(inputs, interventions, record_scores=True)
    n_tokens = input_ids.shape[1]
    record = scope.records[layer]
    native_beta = float(record.native_beta)
    plan = plan_layer(interventions, layer, n_heads, n_tokens, native_beta)
    beta = float(plan.beta[head])
    q_hat = scope.queries_keys[layer][0][0, head, query].double().cpu()  # (d,) the run's q̂_i
    k_hat = scope.queries_keys[layer][1][0, head, key].double().cpu()  # (d,) its k̂_j (K/V group of this head)

    out_weights_of = [out_weights(anatomies[l].out_proj, n_heads, head_dim) for l in range(layer)]
    weights = qkv_weights(anatomies[layer].attention, n_heads, n_kv, head_dim)
    group = head // (n_heads // n_kv)  # the K/V head this query head reads
    attention_module = anatomies[layer].attention
    sides = {}
    chains = {}
    sandwiches = {}
    for side, position, which, kv_head, items, actual in (
        ("query", query, "q", head, plan.query_perturbations, q_hat),
        ("key", key, "k", group, plan.key_perturbations, k_hat),
    ):
        names, parts, bias, sandwich = residual_parts(captured, anatomies, recording.record, out_weights_of, layer,
                                                      position, n_heads)
        sandwiches[side] = sandwich
        weight, proj_bias = weights[which]
        columns = slice(kv_head * head_dim, (kv_head + 1) * head_dim)
        alpha, noise = _perturbations(items, layer, head, n_heads, position, head_dim)
        projection = _Projection(anatomies[layer].input_norm, weight[:, columns],
                                 None if proj_bias is None else proj_bias[columns],
                                 getattr(attention_module, f"{which}_norm", None))
        sides[side], chains[side] = _side(names, parts, bias, projection, captured.get("rope"), position, alpha, noise)
        _check_close(sides[side].vectors.sum(dim=0), actual, f"the {side} of layer {layer} head {head} at {position}")
        if getattr(adapter, "dtype", torch.float32) in (torch.float16, torch.bfloat16):
            # the run rounded every intermediate to half precision and the parts did not: what that rounding moved
            # is a part of its own, so the matrix still adds up to the run's score
            rounding = actual - sides[side].vectors.sum(dim=0)
            sides[side] = Side(sides[side].names + ["rounding"], torch.cat([sides[side].vectors, rounding[None]]))

    matrix = beta * sides["query"].vectors @ sides["key"].vectors.T  # (Cq, Ck)
    score = beta * float(q_hat @ k_hat)
    probs = scope.attention[layer][0, head, query, key]
    result = QKAttribution(score=score, beta=beta, attention=float(probs), query_parts=sides["query"].names,
                           key_parts=sides["key"].names, matrix=matrix, softcap=record.extras.softcap)
    if expand > 0:
        query_total = beta * sides["query"].vectors.sum(dim=0)  # (d,)
        result.expanded = _expand(result, query_total, chains["key"], sandwiches["key"], recording, scope,
                                  out_weights_of, key, expand)
    return result


def head_ops_current() -> HeadRun | None:
    """The head run the caller set (patch sources), if any: the attribution's recording run keeps its sources."""
    from models.head_ops import _current
    return _current.get()


def _expand(result: QKAttribution, query_total: torch.Tensor, chain: KeyChain, sandwich: dict, recording: HeadRun,
            scope: Any, out_weights_of: list[tuple], key: int, count: int) -> list[dict[str, Any]]:
    """The `count` key-side head parts with the largest |total|, each split by source position m:
    z_j = Σ_m P[j, m] v_m, so its term of the score is Σ_m β q_i · chain(P[j, m] v_m W_O^h). Each entry's sources sum
    to that part's column total. A head whose output an intervention replaced (patch, mean ablation) is not P V:
    its entry says so instead."""
    totals = result.matrix.sum(dim=0)
    heads = [b for b, name in enumerate(result.key_parts) if ".H" in name]
    heads.sort(key=lambda b: -abs(float(totals[b])))
    out = []
    for b in heads[:count]:
        name = result.key_parts[b]
        source_layer, source_head = (int(s[1:]) for s in name.split("."))
        probs = scope.attention[source_layer][0, source_head, key].double().cpu()  # (T,) P[j, :]
        values = recording.values[source_layer][0, source_head].double().cpu()  # (T, d_v)
        z = recording.record[source_layer][0, source_head, key].double().cpu()  # (d_v,)
        entry: dict[str, Any] = {"key_part": name, "total": float(totals[b])}
        rebuilt = probs @ values
        if float((rebuilt - z).norm()) > _tolerance.get() * max(float(z.norm()), 1e-12):
            entry["sources"] = []
            entry["note"] = "an intervention replaced this head's output (not P·V): it has no split by source"
            out.append(entry)
            continue
        terms = (probs[:, None] * values) @ out_weights_of[source_layer][0][source_head]  # (T, D)
        norm = sandwich.get(source_layer)
        if norm is not None:
            terms = norm.apply(terms)
        contributions = chain.push(terms) @ query_total  # (T,)
        order = torch.argsort(contributions.abs(), descending=True).tolist()
        entry["sources"] = [{"position": m, "value": float(contributions[m]), "attention": float(probs[m])}
                            for m in order if float(probs[m]) > 0]
        out.append(entry)
    return out
