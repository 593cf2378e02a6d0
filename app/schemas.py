"""Request and response schemas of the API (docs/api.md): the interventions every family takes (checked against a
model by app/interventions.py), the attention requests and responses, generate, patching, lens and faithfulness."""
from __future__ import annotations

from typing import Annotated, Any, Literal, Union

from pydantic import BaseModel, ConfigDict, Field

from models.interventions import Intervention
from models.ops import OPS
from models.ops import base as ops_base
from models.luong import MAX_SOURCE as LUONG_MAX_SOURCE

NonNegInt = Annotated[int, Field(ge=0)]
# Each index is checked against the model and the input (app/attention.py), whose sizes the settings bound: no length
# cap here (4,096 was below a GPU's max_tokens_gpu). Settings are the only source of limits; schemas carry types.
IndexList = list[NonNegInt]


class _Strict(BaseModel):
    # Python's JSON parser accepts NaN/Infinity: refuse them here so they end in a 422. strict: no coercion
    # ("heads": [true] is not head 1, "samples": "2" is not 2, "seed": false is not 0): a wrong type is a 422.
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False, strict=True)


# The request items of the interventions are the ops' (models/ops/, one file each): the union below is built from
# the registry, in its order, discriminated by `op`.
AttentionKind = ops_base.AttentionKind
InterventionIn = Annotated[Union[tuple(op.schema for op in OPS.values())], Field(discriminator="op")]
Interventions = Annotated[list[InterventionIn], Field(description="applied in order; at most the server's "
                                                                 "max_interventions (default 64)")]


def to_engine(item: InterventionIn) -> Intervention:
    data = item.model_dump(exclude={"kind"})  # the kind is resolved into layers by the seq2seq adapter
    for name in ("layers", "heads", "tokens"):
        if data.get(name) is not None:
            data[name] = tuple(data[name])
    return Intervention(**data)


class AttentionRequestBase(_Strict):
    layers: IndexList | None = Field(None, description="which layers to return (null = all)")
    heads: IndexList | None = Field(None, description="which heads to return (null = all)")
    include_scores: bool = False
    interventions: Interventions = Field(default_factory=list)
    compare: bool = False
    include_base: bool = Field(
        False, description="with compare: also return the same slices of P without interventions as `base_attention` "
        "(for P̂ − P maps without a second request)"
    )
    samples: int = Field(1, ge=1, description="runs with the noise of the perturbations re-seeded, effects as mean ± std; "
                         "at most the server's max_samples (default 16)")
    thumbnail_size: int | None = Field(
        None, ge=2, description="also return every layer × head pooled to at most n × n (for a model view); n at most the "
        "server's max_thumbnail_size (default 64)"
    )
    encoding: Literal["json", "f16", "f32"] = Field(
        "json", description="'f16' / 'f32': attention/scores as base64 little-endian float16 / float32 "
        "(shape in `shape`); 'f32' is exact"
    )


# value-weighted maps (Kobayashi et al. 2020), offered wherever P is: text, images, encoder–decoders, speech
Weighting = Literal["attention", "value_norm"]
WEIGHTING_DESCRIPTION = ("'value_norm': maps of ‖P[i,j]·v_j W_O^h‖ normalised per row instead of P (Kobayashi et al. "
                         "2020: what each key's value adds to the head's output)")


class TextAttentionRequest(AttentionRequestBase):
    model: str = "minilm"
    text: str = Field(min_length=1, description="the sentence; for encoder–decoders the source (at most max_text_chars)")
    text_pair: str | None = Field(None, description="encoders only: a second sentence")
    position: NonNegInt | None = Field(
        None, description="decoder LMs: the query position whose next-token distribution is shown (null = the last)"
    )
    chat: bool = Field(False, description="decoder LMs with a chat template: wrap `text` as a user turn")
    weighting: Weighting = Field(
        "attention", description=WEIGHTING_DESCRIPTION + "; encoders, decoder LMs and encoder–decoders (every kind: "
        "the cross maps weighted by the source tokens' values)"
    )
    target: str | None = Field(
        None,
        description="encoder–decoders: the target text (null = the model's greedy output without interventions)",
    )


class GenerateAttention(_Strict):
    """Which attention rows each step of a continuation carries (see /guide#s9): the row of the query that produced
    the step's token, for each of these layers and heads."""

    layers: IndexList | None = Field(None, description="layers (null = all)")
    heads: IndexList | None = Field(None, description="query heads (null = all)")
    top_k: int | None = Field(None, description="null: whole rows; k ≥ 1: each row as its k largest probabilities "
                              "(`indices`, `values`) and the row's log-sum-exp `lse`")
    encoding: Literal["json", "f16", "f32"] = Field(
        "json", description="whole rows as JSON numbers, or base64 float16/float32 {dtype, shape, data}")


class GenerateRequest(_Strict):
    """Greedy continuations with and without the interventions (see /guide#s9)."""

    model: str = "smollm2-135m"
    text: str = Field(min_length=1)
    chat: bool = False
    max_new_tokens: int = Field(16, ge=1, description="1 … the server's max_new_tokens (default 64)")
    interventions: Interventions = Field(default_factory=list)
    attention: GenerateAttention | None = Field(
        None, description="per-step attention rows (null: none); each step event then carries `attention` and "
        "`base_attention`")


class PatchingPair(_Strict):
    """One (clean, corrupted) pair of a set; answer/wrong default to the request's."""

    clean: str = Field(min_length=1)
    corrupt: str = Field(min_length=1, description="same token count as clean")
    answer: str | None = Field(None, min_length=1, max_length=200)
    wrong: str | None = Field(None, min_length=1, max_length=200)


class PatchingFiller(_Strict):
    """The values of a template's {slots} in the clean and the corrupted prompt (and this pair's answers)."""

    clean: dict[str, str]
    corrupt: dict[str, str]
    answer: str | None = Field(None, min_length=1, max_length=200)
    wrong: str | None = Field(None, min_length=1, max_length=200)


class PatchingTemplate(_Strict):
    """Pairs made from one prompt with {slots}: "The capital of {country} is" and one filler per pair."""

    text: str = Field(min_length=1)
    fillers: list[PatchingFiller] = Field(min_length=1)


class PatchingRequest(_Strict):
    """Patching between a clean and a corrupted prompt of the same token count, or over a set of such pairs
    (`pairs` or `template`; see /guide#s12-1)."""

    model: str = "smollm2-135m"
    clean: str | None = Field(None, min_length=1, description="the clean prompt (a single pair)")
    corrupt: str | None = Field(None, min_length=1, description="the corrupted prompt (same token count)")
    answer: str | None = Field(None, min_length=1, max_length=200,
                               description="the clean run's answer: exactly one token, e.g. ' Paris' (a set: every "
                               "pair's unless the pair gives its own)")
    wrong: str | None = Field(None, min_length=1, max_length=200,
                              description="the corrupted run's answer: one token, e.g. ' Rome'")
    pairs: list[PatchingPair] | None = Field(None, min_length=1, description="a set of pairs: each head's mean "
                                             "effect over them, its spread, and AtP/AtP* beside it (scan heads)")
    template: PatchingTemplate | None = Field(None, description="a set made from a template with fillers")
    top_k: int = Field(10, ge=1, description="a set: the top-k overlap of the estimates with the exact scan")
    scan: Literal["heads", "residual"] = "heads"
    method: Literal["exact", "attribution"] = Field(
        "exact", description="'exact': one patched run per cell (batched); 'attribution': the gradient estimate "
        "(heads only). An exact head scan also returns the attribution estimate and their rank correlation"
    )
    interventions: Interventions = Field(default_factory=list)


class CircuitPair(_Strict):
    """One prompt pair of a circuit: clean and corrupt of the same token count, answer and wrong one token each."""

    clean: str = Field(min_length=1, description="at most max_text_chars characters")
    corrupt: str = Field(min_length=1, description="same token count as clean; at most max_text_chars characters")
    answer: str = Field(min_length=1, max_length=200, description="one token, e.g. ' Mary'")
    wrong: str = Field(min_length=1, max_length=200, description="one token, e.g. ' John'")


class CircuitTask(_Strict):
    """A built-in task, its pairs generated with a seed (docs/science.md "Circuits through attention")."""

    name: Literal["ioi", "greater_than", "induction", "capital"]
    n: int = Field(8, ge=1, le=32, description="pairs to generate")
    seed: int = Field(0, ge=0, le=2**31 - 1)


EdgeName = Annotated[str, Field(min_length=8, max_length=40, pattern=r"^(input|a\d{1,4}\.h\d{1,4}|m\d{1,4})->"
                                r"(logits|a\d{1,4}\.h\d{1,4}|m\d{1,4})(<[qkv]>)?$")]
Fraction = Annotated[float, Field(ge=0.0, le=1.0)]


class CircuitRequest(_Strict):
    """An edge graph of heads and MLPs scored over prompt pairs (see /guide and docs/api.md "Circuits")."""

    model: str = "smollm2-135m"
    pairs: list[CircuitPair] | None = Field(None, min_length=1, max_length=32)
    task: CircuitTask | None = None
    method: Literal["eap", "eap_ig", "exact"] = "eap"
    ig_steps: int = Field(5, ge=1, le=16, description="eap_ig: points on the path from corrupt to clean")
    edges: list[EdgeName] | None = Field(None, min_length=1, max_length=200,
                                         description="exact: the edges to score (null: the top `n_exact` by EAP)")
    n_exact: int = Field(50, ge=1, le=200, description="exact without `edges`: how many top EAP edges to score")
    budgets: list[Fraction] | None = Field(None, min_length=1, max_length=16,
                                           description="fractions of all edges for the faithfulness curve")
    budget: Fraction = Field(0.05, description="the circuit whose edges are marked in_graph")
    top: int | None = Field(2000, ge=1, le=200_000, description="edges listed, by |score| (null: every edge)")
    interventions: Interventions = Field(default_factory=list, description="none yet: must be empty")


class CircuitEdgeRequest(_Strict):
    """Why one edge matters, on one pair: its exact score, the attention change and QK share, or what it writes."""

    model: str = "smollm2-135m"
    pair: CircuitPair
    edge: EdgeName
    query: NonNegInt | None = Field(None, description="the query row (null = the last token)")


class LensRequest(_Strict):
    """The logit lens (see /guide#s12-3)."""

    model: str = "smollm2-135m"
    text: str = Field(min_length=1)
    top: int = Field(5, ge=1, le=20, description="tokens per cell")
    interventions: Interventions = Field(default_factory=list)
    compare: bool = Field(False, description="also the lens without the interventions, as `top_before`")


class FaithfulnessRequest(_Strict):
    """Which attribution of a query row is faithful: mask each method's top-k keys in every layer (see /guide#s12-5)."""

    model: str = "smollm2-135m"
    text: str = Field(min_length=1)
    position: NonNegInt | None = Field(None, description="the query row (null = the last token)")
    k: Annotated[list[Annotated[int, Field(ge=1, le=512)]], Field(min_length=1, max_length=8)] = Field(
        default_factory=lambda: [1, 2, 4, 8])
    methods: Annotated[list[Literal["attention", "value_norm", "rollout", "grad_attention"]], Field(min_length=1, max_length=4)] = Field(
        default_factory=lambda: ["attention", "value_norm", "rollout", "grad_attention"])
    answer: str | None = Field(None, max_length=200, description="decoder LMs: the token whose probability drop is "
                               "reported (one token; null = the top prediction)")
    layer: NonNegInt | None = Field(None, description="attention and value_norm: rank by this layer's heads' mean "
                                    "(null = the mean over every layer)")
    head: NonNegInt | None = Field(None, description="with layer: rank by this head alone")


class ModelInfoOut(BaseModel):
    model_config = ConfigDict(extra="allow")
    id: str
    kind: str
    layers: int
    heads: int
    head_dim: int
    native_beta: float
    output: str
    source: str


class ModelNotReadyOut(BaseModel):
    id: str
    kind: str
    description: str = ""
    state: Literal["preparing", "failed"] = Field(
        description="preparing: its weights are being prepared now (requests get 503 with Retry-After); failed: its "
                    "preparation failed (see `error` and the log)")
    log: str | None = Field(None, description="the preparation's log, under the server's weights folder")
    retry_after_s: int | None = None
    error: str | None = None


class ModelsOut(BaseModel):
    models: list[ModelInfoOut]
    not_ready: list[ModelNotReadyOut] = Field(
        default_factory=list, description="models this server will have once their preparation ends (`make run` "
        "serves while the default models it does not load at start are prepared), or whose preparation failed")


class Effect(BaseModel):
    model_config = ConfigDict(extra="allow")
    attention_tv: list[list[float]]
    hidden_cosine: list[float]
    output: dict[str, Any] = Field(
        description=(
            "model-specific: similarity models → embedding_cosine (+ similarity_before/after with text_pair); "
            "mlm → top-k predictions at each [MASK] before/after and their KL; embedding backbones → cls_cosine; "
            "classifiers → predictions before/after and kl"
        )
    )


class AttentionResponse(BaseModel):
    model_config = ConfigDict(extra="allow")
    model: str
    tokens: list[str]
    truncated: bool
    input_tokens: int | None = Field(None, description="only when truncated: the input's token count before it was cut "
                                     "(the text's own, or with a second sentence that is encoded with it)")
    layers: list[int]
    heads: list[int]
    attention: Any = Field(description="[L][H][T][T] probabilities after interventions (or base64 f16)")
    scores: Any = None
    base_attention: Any = Field(None, description="with compare and include_base: the same slices of P without interventions")
    base_run_id: str | None = Field(None, description="inputs over full_map_tokens with compare: the kept run without "
                                    "the interventions (its windows; P̂ − P by POST /api/runs/{run_id}/window `minus`)")
    base_overview: Any = Field(None, description="inputs over full_map_tokens with compare (text and images, weighting "
                               "attention): that run's overview maps on the same blocks as `overview.maps`, (l, h, B, B); "
                               "overview.maps − base_overview is the overview of P̂ − P")
    effect: Effect | None = None
    warnings: list[str]


# ---- OpenAPI request examples --------------------------------------------------------------------------
# Swagger's "Try it out" sends the example it shows; one built from the types alone (position: 0 for every
# text model) is refused by most models. These are explicit, one per kind of model where the bodies differ,
# and name models this server has (app.main inserts them into /openapi.json; tests/api/test_openapi_examples.py
# sends each one). models: {"encoder" | "causal_lm" | "seq2seq" | "vision" | "image:<model>": id}, the first
# model of each family on this server; image: ids of the page's example photos, by the model each suits.
def circuit_examples(lm: str) -> dict[str, dict[str, dict]]:
    """POST /api/text/circuit and /circuit/edge on a decoder LM: the README's capital pair (short work)."""
    pair = {"clean": "The capital of France is", "corrupt": "The capital of Italy is", "answer": " Paris",
            "wrong": " Rome"}
    return {
        "/api/text/circuit": {"capital": {
            "summary": f"{lm}: the edges that carry France → Paris (EAP), the circuit at 5 % and its faithfulness",
            "value": {"model": lm, "task": {"name": "capital", "n": 1, "seed": 0}, "method": "eap",
                      "budgets": [0, 0.05, 1], "budget": 0.05, "top": 20}}},
        "/api/text/circuit/edge": {"logits_edge": {
            "summary": f"{lm}: one edge's exact score on the capital pair", "value": {
                "model": lm, "pair": pair, "edge": "m0->logits", "query": None}}},
    }


def lm_analysis_examples(lm: str) -> dict[str, dict[str, dict]]:
    """The decoder-LM analysis POSTs (patching, lens, faithfulness, head kinds, why a head attends) on the
    README's capital prompt."""
    examples: dict[str, dict[str, dict]] = {}
    prompt = "The capital of France is"
    examples["/api/text/patching"] = {"attribution": {
        "summary": f"{lm}: which heads carry France → Paris (the gradient estimate, one pass)", "value": {
            "model": lm, "clean": prompt, "corrupt": "The capital of Italy is", "answer": " Paris", "wrong": " Rome",
            "scan": "heads", "method": "attribution"}}}
    examples["/api/text/lens"] = {"lens": {"summary": f"{lm}: the logit lens of every layer and position",
                                           "value": {"model": lm, "text": prompt, "top": 5}}}
    examples["/api/text/faithfulness"] = {"faithfulness": {
        "summary": f"{lm}: mask each method's top 1 and 2 keys of the last row", "value": {
            "model": lm, "text": prompt, "position": None, "k": [1, 2], "methods": ["attention", "value_norm"]}}}
    # on the prompt (one short run); "text": null takes the built-in probes (two runs, seconds on a CPU)
    examples["/api/text/head_scores"] = {"text": {"summary": f"{lm}: each head's kind scores on a prompt",
                                                  "value": {"model": lm, "text": prompt}}}
    examples["/api/text/qk_attribution"] = {"why": {
        "summary": f"{lm}: why layer 4, head 0 attends from ' is' to ' capital' (the score split over parts)",
        "value": {"model": lm, "text": prompt, "layer": 4, "head": 0, "query": 4, "key": 1, "expand": 3}}}
    return examples


def scale_examples(enc: str | None, lm: str | None) -> dict[str, dict[str, dict]]:
    """POST /api/text/score_stats (an encoder's or a decoder's head) and /permutation_check (encoders only)."""
    examples: dict[str, dict[str, dict]] = {}
    if enc or lm:
        model = enc or lm
        examples["/api/text/score_stats"] = {"head": {
            "summary": f"{model}: layer 2, head 1's raw q·k, its Gaussian theory and the entropy with and without 1/√d",
            "value": {"model": model, "text": "The cat sat on the mat because it was tired.", "layer": 2, "head": 1}}}
    if enc:
        examples["/api/text/permutation_check"] = {"shuffle": {
            "summary": f"{enc}: with positions off a permuted sentence gives the permuted map",
            "value": {"model": enc, "text": "The cat sat on the mat because it was tired.", "seed": 3}}}
    return examples


def request_examples(models: dict[str, str], image_samples: dict[str, str],
                     audio_sample: str | None = None) -> dict[str, dict[str, dict]]:
    """{path: {name: {"summary", "value"}}} for every POST operation with a JSON body. audio_sample: the id of the
    bundled speech clip where this server has it. The runs' paths take a run_id from an attention response."""
    enc, lm, s2s = models.get("encoder"), models.get("causal_lm"), models.get("seq2seq")
    text: dict[str, dict] = {}
    if enc:
        text["encoder"] = {"summary": f"encoder ({enc}): mask key 3 of one head, with the effects", "value": {
            "model": enc, "text": "The animal didn't cross the street because it was too tired.",
            "text_pair": "The dog was exhausted, so it stayed on the sidewalk.", "layers": [0], "heads": [0],
            "interventions": [{"op": "mask_keys", "tokens": [3], "layers": [0], "heads": [0]}], "compare": True}}
    if lm:
        text["language_model"] = {"summary": f"decoder LM ({lm}): β/100 on layers 10–12, next token before and after", "value": {
            "model": lm, "text": "The capital of France is", "position": None, "chat": False, "layers": [5], "heads": [0],
            "interventions": [{"op": "temperature", "beta": 0.00125, "layers": [10, 11, 12]}], "compare": True}}
    if s2s:
        text["encoder_decoder"] = {"summary": f"encoder–decoder ({s2s}): cross-attention flattened, its own target", "value": {
            "model": s2s, "text": "The cat sat on the mat.", "target": None, "layers": [0], "heads": [0],
            "interventions": [{"op": "temperature", "beta": 0.01, "kind": "cross"}], "compare": True}}
    examples: dict[str, dict[str, dict]] = {"/api/text/attention": text}
    if lm:
        examples["/api/text/generate"] = {"language_model": {
            "summary": f"{lm}: 8 tokens with and without layer 0 ablated", "value": {
                "model": lm, "text": "The capital of France is", "chat": False, "max_new_tokens": 8,
                "interventions": [{"op": "ablate_heads", "layers": [0]}]}},
            "attention_rows": {"summary": f"{lm}: 8 tokens, each with the top 5 keys of layer 3's heads 0 and 1", "value": {
                "model": lm, "text": "The capital of France is", "max_new_tokens": 8,
                "interventions": [{"op": "mask_keys", "tokens": [1]}],
                "attention": {"layers": [3], "heads": [0, 1], "top_k": 5}}}}
    images = {
        model: {"summary": f"{model}: the page's example photo, mask patch token 5", "value": {
            "model": model, "image_id": image_id, "layers": [0], "heads": [0], "queries": [0],
            "interventions": [{"op": "mask_keys", "tokens": [5]}], "compare": True}}
        for model, image_id in image_samples.items()
    }
    if images:
        examples["/api/image/attention"] = images
        # the page's export: the shown layer (a whole dinov2-small is over the response cap), no query rows
        examples["/api/image/export.html"] = {
            f"{model}_standalone": {"summary": f"{model}: layer 0 of the example photo as one HTML file that opens offline",
                                    "value": {"model": model, "image_id": image_id, "layers": [0]}}
            for model, image_id in image_samples.items()}
    if lm:
        examples.update(lm_analysis_examples(lm))
    if enc or lm:
        examples["/api/text/export.html"] = {"standalone": {
            "summary": f"{enc or lm}: every layer and head as one HTML file that opens offline", "value": {
                "model": enc or lm, "text": "The cat sat on the mat."}}}
    if lm or enc:
        examples["/api/text/tokenize"] = {"answer": {
            "summary": f"{lm or enc}: the token an answer box will use (with its leading space)",
            "value": {"model": lm or enc, "text": " Paris"}}}
    examples["/api/runs/{run_id}/window"] = {"window": {
        "summary": "an 8 × 8 window of layer 0, head 0 (run_id from an attention response)",
        "value": {"layer": 0, "head": 0, "rows": [0, 8], "cols": [0, 8]}}}
    examples["/api/runs/{run_id}/row"] = {"row": {
        "summary": "query row 4 of layer 0's heads, and their mass on keys 0–3",
        "value": {"row": 4, "layers": [0], "span": [0, 4]}}}
    speech = models.get("speech")
    if speech and audio_sample:
        clip = {"model": speech, "audio_id": audio_sample, "layers": [0], "heads": [0], "kinds": ["cross"]}
        examples["/api/audio/attention"] = {"sample": {
            "summary": f"{speech}: cross-attention of the bundled clip, decoder layer 0, head 0", "value": clip}}
        examples["/api/audio/export.html"] = {"sample": {
            "summary": f"{speech}: the bundled clip's decoder self-attention as one HTML file that opens offline",
            "value": {"model": speech, "audio_id": audio_sample, "layers": [0]}}}
        examples["/api/audio/transcribe"] = {"sample": {"summary": f"{speech}: the bundled clip's transcript",
                                                        "value": {"model": speech, "audio_id": audio_sample}}}
    examples["/api/gaussian/attention"] = {"head": {"summary": "layer 0, head 0 of the trained run, query (7, 7)",
                                                    "value": {"layer": 0, "head": 0, "query": [7, 7], "alpha": None}}}
    examples["/api/gaussian/conv-equivalence"] = {"conv3x3": {
        "summary": "a 3×3 convolution as 9 Gaussian heads at α = 100", "value": {
            "kernel_size": 3, "dilation": 1, "padding": "zeros", "alpha": 100.0, "image_size": 16,
            "channels_in": 3, "channels_out": 4, "seed": 0}}}
    if lm:
        examples.update(circuit_examples(lm))
    examples.update(scale_examples(enc, lm))
    return examples


class LuongPerturb(_Strict):
    """Gaussian noise on the Luong encoder's source states h̄_s (see /guide#s16)."""

    sigma: float = Field(ge=0, le=100, description="σ of the noise added to h̄_s, 0 ≤ σ ≤ 100")
    seed: int = Field(0, ge=0, le=2**31 - 1, description="the noise's seed")
    positions: list[Annotated[int, Field(ge=0, lt=LUONG_MAX_SOURCE)]] | None = Field(
        None, max_length=LUONG_MAX_SOURCE, description="source positions whose states get noise (null = all)")


class LuongAttentionRequest(_Strict):
    """One input through a Luong-attention model (its score function) and the tiny Transformer beside it (see
    /guide#s16)."""

    score: Literal["dot", "general", "concat", "location"] = "dot"
    text: str = Field("the 3rd of March 2021", min_length=1,
                      description=f"a date in words or digits, 1-{LUONG_MAX_SOURCE} characters of the model's vocabulary")
    beta: float = Field(1.0, ge=0, le=100, description="the alignment scores × β before the softmax (1 = the model)")
    mask: list[Annotated[int, Field(ge=0, lt=LUONG_MAX_SOURCE)]] = Field(
        default_factory=list, max_length=LUONG_MAX_SOURCE, description="source positions the alignment may not attend (score −∞)")
    perturb: LuongPerturb | None = None
