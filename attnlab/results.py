"""What the client's calls return: the server's JSON (`.response`), the request that made it (`.request`) and the
client (`.lab`), with the maps decoded into numpy. Nothing here recomputes a number the server gave.

The widget (attnlab/widget.py) and the standalone export (attnlab/export.py) take a result through `.response`,
`.request` and `.lab`.
"""
from __future__ import annotations

import base64
import json
from typing import Any, Iterator, Sequence

import numpy as np

from attnlab._types import LabLike
from attnlab.errors import LabError
from attnlab.interventions import PatchHeads, PatchResidual

_DTYPES = {"float32": "<f4", "float16": "<f2", "uint8": "u1"}


def decode(field: Any) -> Any:
    """A map as the server sent it → numpy: nested lists (null → nan) or the base64 form {"dtype", "shape",
    "data"} of `encoding: "f32"/"f16"` (float16 widened to float32). A dict of maps (per kind: encoder, decoder,
    cross) is decoded map by map; None stays None."""
    if field is None:
        return None
    if isinstance(field, np.ndarray):  # from the binary body (read_binary)
        return field
    if isinstance(field, dict):
        if "data" in field and field.get("dtype") in _DTYPES:
            array = np.frombuffer(base64.b64decode(field["data"]), dtype=_DTYPES[field["dtype"]])
            array = array.reshape(field["shape"])
            return array.astype(np.float32) if field["dtype"] == "float16" else array.copy()
        return {key: decode(value) for key, value in field.items()}
    if isinstance(field, list):
        return np.array(field, dtype=np.float64 if _has_none(field) else None)
    return field


BINARY_MEDIA_TYPE = "application/octet-stream"


def read_binary(body: bytes | bytearray | memoryview) -> dict:
    """The server's binary body (a request sent with `Accept: application/octet-stream`, docs/api.md "The binary
    form") → its answer as a dict, each f16/f32 field a numpy array viewing the body's bytes (float32: no copy;
    writable when `body` is a bytearray; float16 widened to float32)."""
    view = memoryview(body)
    (n,) = np.frombuffer(view[:4], dtype="<u4")
    header = json.loads(bytes(view[4:4 + int(n)]))
    start = 4 + int(n)

    def arrays(field: Any) -> Any:
        if isinstance(field, dict):
            if "offset" in field and "nbytes" in field and field.get("dtype") in _DTYPES:
                dtype = np.dtype(_DTYPES[field["dtype"]])
                array = np.frombuffer(view, dtype=dtype, count=int(field["nbytes"]) // dtype.itemsize,
                                      offset=start + int(field["offset"])).reshape(field["shape"])
                return array.astype(np.float32) if field["dtype"] == "float16" else array
            return {key: arrays(value) for key, value in field.items()}
        if isinstance(field, list) and field and isinstance(field[0], (dict, list)):
            return [arrays(item) for item in field]
        return field

    return arrays(header)


def _has_none(values: list) -> bool:
    stack = [values]
    while stack:
        for item in stack.pop():
            if item is None:
                return True
            if isinstance(item, list):
                stack.append(item)
    return False


def _xarray():
    try:
        import xarray
    except ImportError as exc:
        raise ImportError("to_xarray needs xarray: pip install xarray") from exc
    return xarray


class Result:
    """The server's answer (`.response`, a dict as it came), the request body (`.request`) and the client (`.lab`).
    `result["field"]` reads the response."""

    def __init__(self, response: dict, request: dict | None, lab: "LabLike | None"):
        self.response, self.request, self.lab = response, request, lab

    def __getitem__(self, key: str) -> Any:
        return self.response[key]

    def keys(self):
        return self.response.keys()

    @property
    def warnings(self) -> list[str]:
        return list(self.response.get("warnings") or [])

    def __repr__(self) -> str:
        return f"<{type(self).__name__}: {', '.join(sorted(self.response))}>"


class AttentionResult(Result):
    """POST /api/text/attention's answer.

    `.attention`: P after the interventions, numpy (layers, heads, T, T) for the returned slices (`.layers`,
    `.heads` name them); for inputs over the server's full_map_tokens the pooled overview (layers, heads, B, B)
    instead (`.overview` has its block edges; exact windows come from `.window`). Encoder–decoders: a dict by kind.
    """

    @property
    def tokens(self) -> list[str]:
        return self.response["tokens"]

    @property
    def model(self) -> str | None:
        return self.response.get("model") or (self.request or {}).get("model")

    @property
    def run_id(self) -> str | None:
        return self.response.get("run_id")

    @property
    def base_run_id(self) -> str | None:
        return self.response.get("base_run_id")

    @property
    def layers(self) -> list[int]:
        return self.response.get("layers") or []

    @property
    def heads(self) -> list[int]:
        return self.response.get("heads") or []

    @property
    def is_long(self) -> bool:
        """The input was over full_map_tokens: `.attention` is the overview, windows give exact P."""
        return self.response.get("attention") is None and self.response.get("overview") is not None

    @property
    def attention(self) -> Any:
        if self.is_long:
            overview = self.overview
            return overview["maps"] if "maps" in overview else {kind: part["maps"] for kind, part in overview.items()}
        return self._decoded("attention")

    @property
    def overview(self) -> dict | None:
        """Long inputs: {"edges": row block boundaries, "col_edges", "maps": numpy (layers, heads, B, B)}."""
        overview = self.response.get("overview")
        if overview is None:
            return None
        if "maps" in overview:
            return {**overview, "maps": decode(overview["maps"])}
        return {kind: {**part, "maps": decode(part["maps"])} for kind, part in overview.items()}  # per kind

    @property
    def scores(self) -> Any:
        return self._decoded("scores")

    @property
    def base_attention(self) -> Any:
        return self._decoded("base_attention")

    @property
    def entropy(self) -> Any:
        return decode(self.response.get("entropy"))

    @property
    def mean_distance(self) -> Any:
        return decode(self.response.get("mean_distance"))

    @property
    def received(self) -> Any:
        return decode(self.response.get("received"))

    @property
    def effect(self) -> dict | None:
        """With compare: attention_tv (numpy (L, H), None for long inputs), hidden_cosine and the model's output
        effect (as the server gave it)."""
        effect = self.response.get("effect")
        if effect is None:
            return None
        decoded = dict(effect)
        for key in ("attention_tv", "hidden_cosine"):
            if key in decoded:
                decoded[key] = decode(decoded[key])
        return decoded

    @property
    def output(self) -> Any:
        return self.response.get("output")

    def _decoded(self, key: str) -> Any:
        cache = self.__dict__.setdefault("_cache", {})
        if key not in cache:
            cache[key] = decode(self.response.get(key))
        return cache[key]

    def _query_count(self, kind: str | None) -> int:
        if kind is None:
            return len(self.tokens)
        source = self.response.get("source_tokens") or self.tokens
        target = self.response.get("target_tokens") or self.tokens
        return len(source if kind == "encoder" else target)

    def _key_count(self, kind: str | None) -> int:
        if kind in ("encoder", "cross"):
            return len(self.response.get("source_tokens") or self.tokens)
        return self._query_count(kind)

    def window(self, layer: int, head: int, rows: Sequence[int] | None = None, cols: Sequence[int] | None = None,
               **fields: Any) -> "Window":
        """The exact P of `layer`, `head` (model indices) over rows × cols (half-open; None = all), from the run the
        server kept (POST /api/runs/{run_id}/window). `fields`: kind, beta (view-mode β, re-normalised without
        re-running), include_scores, weighting, minus (another run's id: P̂ − P)."""
        if not self.run_id:
            raise ValueError("this response has no run_id: the server kept no run for it")
        kind = fields.get("kind")
        rows = rows if rows is not None else (0, self._query_count(kind))
        cols = cols if cols is not None else (0, self._key_count(kind))
        return self.lab.window(self.run_id, layer, head, rows, cols, **fields)

    def row(self, row: int, **fields: Any) -> dict:
        """One query row over every key for layers × heads of the kept run (POST /api/runs/{run_id}/row)."""
        return self.lab.row(self.run_id, row, **fields)

    def to_xarray(self, kind: str | None = None):
        """P as an xarray DataArray with dims (layer, head, query, key), coordinates the model's layer and head
        indices and the token positions (with each token's text as `query_token`/`key_token`). Long inputs: the
        overview, dims (layer, head, query_block, key_block), coordinates the blocks' first positions."""
        xr = _xarray()
        if self.is_long:
            overview = self.overview if kind is None else self.overview[kind]
            edges, col_edges = overview["edges"], overview.get("col_edges") or overview["edges"]
            return xr.DataArray(overview["maps"], dims=("layer", "head", "query_block", "key_block"),
                                coords={"layer": self.layers or list(range(overview["maps"].shape[0])),
                                        "head": self.heads or list(range(overview["maps"].shape[1])),
                                        "query_block": list(edges[:-1]), "key_block": list(col_edges[:-1])},
                                name="attention_overview", attrs={"model": self.model, "run_id": self.run_id})
        attention = self.attention if kind is None else self.attention[kind]
        if isinstance(attention, dict):
            raise ValueError(f"this response holds attention by kind {sorted(attention)}: pass kind=")
        queries, keys = attention.shape[-2], attention.shape[-1]
        q_tokens = self.tokens[:queries] if kind is None else (
            (self.response.get("source_tokens") if kind == "encoder" else self.response.get("target_tokens"))
            or self.tokens)[:queries]
        k_tokens = self.tokens[:keys] if kind is None else (
            (self.response.get("target_tokens") if kind == "decoder" else self.response.get("source_tokens"))
            or self.tokens)[:keys]
        return xr.DataArray(attention, dims=("layer", "head", "query", "key"),
                            coords={"layer": self.layers, "head": self.heads, "query": np.arange(queries),
                                    "key": np.arange(keys), "query_token": ("query", list(q_tokens)),
                                    "key_token": ("key", list(k_tokens))},
                            name="attention", attrs={"model": self.model, "run_id": self.run_id})

    def show(self, **options: Any):
        """The lab's own views in the notebook (attnlab.widget)."""
        try:
            from attnlab import widget
        except ImportError as exc:
            raise NotImplementedError("the notebook widget (attnlab/widget.py) is not installed in this "
                                      "version of attnlab") from exc
        return widget.show(self, **options)

    def to_html(self, path: str, **options: Any):
        """One self-contained HTML file of this result that opens offline (attnlab.export); returns its path."""
        try:
            from attnlab import export
        except ImportError as exc:
            raise NotImplementedError("the standalone export (attnlab/export.py) is not installed in this "
                                      "version of attnlab") from exc
        return export.to_html(self, path, **options)

    def __repr__(self) -> str:
        attention = self.attention
        shape = ("overview " if self.is_long else "") + (
            ", ".join(f"{k} {'×'.join(map(str, np.shape(v)))}" for k, v in attention.items())
            if isinstance(attention, dict) else "×".join(map(str, np.shape(attention))))
        return (f"<AttentionResult {self.model}: {len(self.tokens)} tokens, attention {shape}, "
                f"run_id={self.run_id}>")


class Window(Result):
    """One head's exact window of a kept run: `.attention` numpy (rows, cols), `.row_entropy` (entropy of each row
    over all its keys), `.scores` when asked; `.rows`, `.cols` the half-open ranges."""

    @property
    def attention(self) -> np.ndarray:
        return decode(self.response["attention"])

    @property
    def scores(self) -> np.ndarray | None:
        return decode(self.response.get("scores"))

    @property
    def row_entropy(self) -> np.ndarray:
        return decode(self.response.get("row_entropy"))

    @property
    def rows(self) -> tuple[int, int]:
        return tuple(self.response["rows"])

    @property
    def cols(self) -> tuple[int, int]:
        return tuple(self.response["cols"])

    def to_xarray(self):
        xr = _xarray()
        (r0, r1), (c0, c1) = self.rows, self.cols
        return xr.DataArray(self.attention, dims=("query", "key"),
                            coords={"query": np.arange(r0, r1), "key": np.arange(c0, c1)}, name="attention",
                            attrs={"layer": self.response["layer"], "head": self.response["head"]})

    def __repr__(self) -> str:
        return (f"<Window layer {self.response['layer']} head {self.response['head']} rows {self.rows} "
                f"cols {self.cols}>")


class Continuation:
    """POST /api/text/generate as it streams: iterate for one dict per step ({"step", "token", "id", "prob",
    "ended", "base_token", …}); `.text`, `.base_text` and `.steps` once it has run (`.run()` runs it to the end).
    Leaving the loop early closes the stream, and the server stops after the step in progress."""

    def __init__(self, lab: "LabLike", request: dict):
        self.lab, self.request = lab, request
        self.steps: list[dict] = []
        self.response: dict | None = None

    def __iter__(self) -> Iterator[dict]:
        if self.response is not None:  # already run: its steps again
            yield from self.steps
            return

        seen: dict = {}  # the last event's id: a loop left early cancels the job by it
        events = self.lab._events("/api/text/generate", self.request, seen)
        try:
            for event in events:
                if event.get("accepted") or "progress" in event:
                    continue
                if event.get("done"):
                    self.response = event
                    return
                if "error" in event:
                    raise LabError(event.get("status"), event["error"], "/api/text/generate",
                                   event.get("retry_after"))
                for key in ("attention", "base_attention"):
                    if event.get(key) is not None:
                        event[key] = _step_rows(event[key])
                self.steps.append(event)
                yield event
        finally:  # a loop left early (break, an exception) cancels the job: the server stops generating
            events.close()
            if self.response is None:
                self.lab._cancel_job(seen)

    @property
    def run_id(self) -> str | None:
        """The kept run of the prompt + the intervened continuation (once it has run)."""
        return (self.response or {}).get("run_id")

    @property
    def base_run_id(self) -> str | None:
        """The kept run of the prompt + the continuation without interventions."""
        return (self.response or {}).get("base_run_id")

    def _tokens(self, base: bool) -> int:
        key = "base_id" if base else "id"
        return int((self.response or {}).get("prompt_tokens", 0)) + sum(s.get(key) is not None for s in self.steps)

    def window(self, layer: int, head: int, rows: Sequence[int] | None = None, cols: Sequence[int] | None = None,
               base: bool = False, **fields: Any) -> "Window":
        """The exact P of `layer`, `head` over rows × cols (None = all) of the kept run (generated positions
        included): the intervened side's, or with `base=True` the plain one's. `fields` as AttentionResult.window."""
        run_id = self.base_run_id if base else self.run_id
        if not run_id:
            raise ValueError("the continuation has not run to its end: no run is kept yet (iterate it or .run())")
        n = self._tokens(base)
        return self.lab.window(run_id, layer, head, rows if rows is not None else (0, n),
                               cols if cols is not None else (0, n), **fields)

    def run(self) -> "Continuation":
        for _ in self:
            pass
        return self

    @property
    def text(self) -> str | None:
        return (self.response or {}).get("text")

    @property
    def base_text(self) -> str | None:
        return (self.response or {}).get("base_text")

    def __repr__(self) -> str:
        state = f"{self.text!r} (base {self.base_text!r})" if self.response else f"{len(self.steps)} steps so far"
        return f"<Continuation {state}>"


def _step_rows(field: Any) -> Any:
    """A step's attention rows → numpy: (layers, heads, keys), or with top_k [l][h] {"indices", "values", "lse"}."""
    if isinstance(field, list) and field and isinstance(field[0], list) and field[0] and isinstance(field[0][0], dict):
        return [[{"indices": np.asarray(row["indices"], dtype=np.int64),
                  "values": np.asarray(row["values"], dtype=np.float32), "lse": float(row["lse"])} for row in layer]
                for layer in field]
    return decode(field)


class PatchingResult(Result):
    """POST /api/text/patching's answer: `.effect` numpy (layers, heads) (or (layers, positions) for a residual
    scan; nan where the server gave null), `.attribution`, `.clean_run_id` and `.patch(...)` to use it."""

    @property
    def effect(self) -> Any:
        return decode(self.response.get("effect"))

    @property
    def attribution(self) -> Any:
        return decode(self.response.get("attribution"))

    @property
    def clean_run_id(self) -> str | None:
        return self.response.get("clean_run_id")

    def top(self, k: int = 5) -> list[tuple[int, int, float]]:
        """The k (layer, head-or-position, effect) of largest |effect|."""
        effect = np.nan_to_num(np.asarray(self.effect, dtype=np.float64), nan=0.0)
        order = np.argsort(-np.abs(effect), axis=None)[:k]
        return [(int(i), int(j), float(effect[i, j])) for i, j in zip(*np.unravel_index(order, effect.shape))]

    def patch(self, layers: Sequence[int] | None = None, heads: Sequence[int] | None = None,
              tokens: Sequence[int] | None = None):
        """An intervention that patches from this clean run: PatchHeads (heads scan) or PatchResidual (residual)."""
        if self.response.get("scan") == "residual":
            return PatchResidual(source=self.clean_run_id, layers=layers, tokens=tokens)
        return PatchHeads(source=self.clean_run_id, layers=layers, heads=heads)


class LensResult(Result):
    """POST /api/text/lens's answer: `.top` [L][T][k] of {"token", "id", "prob"}; `.top_tokens` and `.top_probs`
    numpy (layers, positions) of each cell's first token."""

    @property
    def tokens(self) -> list[str]:
        return self.response["tokens"]

    @property
    def top(self) -> list:
        return self.response["top"]

    @property
    def top_tokens(self) -> np.ndarray:
        return np.array([[cell[0]["token"] for cell in layer] for layer in self.top], dtype=object)

    @property
    def top_probs(self) -> np.ndarray:
        return np.array([[cell[0]["prob"] for cell in layer] for layer in self.top], dtype=np.float64)


class FaithfulnessResult(Result):
    """POST /api/text/faithfulness's answer: `.methods` {name: {"keys", "scores", "kl", "p_drop"}} as given."""

    @property
    def methods(self) -> dict:
        return self.response["methods"]


class AudioAttentionResult(AttentionResult):
    """POST /api/audio/attention's answer: `.attention` a dict by kind (`cross` (l, h, N, 1500), `decoder`
    (l, h, N, N), `encoder` the pooled overview), `.transcript`, `.words`, `.alignment`; `.window(layer, head, rows,
    cols, kind=…)` reads the kept run (every kind, the encoder's 1,500 × 1,500 included)."""

    @property
    def is_long(self) -> bool:
        return False

    @property
    def attention(self) -> dict:
        attention = dict(self.response.get("attention") or {})
        out = {}
        for kind, value in attention.items():
            if isinstance(value, dict) and "overview" in value:
                out[kind] = {**value, "overview": decode(value["overview"])}
            else:
                out[kind] = decode(value)
        return out

    @property
    def transcript(self) -> str | None:
        return self.response.get("transcript")

    @property
    def words(self) -> list[dict]:
        return self.response.get("words") or []

    def _query_count(self, kind: str | None) -> int:
        return self.response.get("positions", 1500) if kind == "encoder" else len(self.tokens)

    def _key_count(self, kind: str | None) -> int:
        return self.response.get("positions", 1500) if kind in ("encoder", "cross") else len(self.tokens)

    def window(self, layer: int, head: int, rows: Sequence[int] | None = None, cols: Sequence[int] | None = None,
               kind: str = "cross", **fields: Any) -> Window:
        return super().window(layer, head, rows, cols, kind=kind, **fields)

    def __repr__(self) -> str:
        return f"<AudioAttentionResult {self.model}: {self.transcript!r}, run_id={self.run_id}>"


class Clip(Result):
    """An uploaded clip (POST /api/audio's answer: audio_id, duration_s, …): `.attention(…)` and `.transcribe()`."""

    def __init__(self, response: dict, lab: "LabLike", model: str | None = None):
        super().__init__(response, None, lab)
        self.model = model

    @property
    def audio_id(self) -> str:
        return self.response["audio_id"]

    @property
    def duration_s(self) -> float:
        return self.response["duration_s"]

    def attention(self, **fields: Any) -> AudioAttentionResult:
        """POST /api/audio/attention on this clip; fields as Lab.audio_attention (layers, heads, kinds,
        interventions, compare, target, task, language, weighting, …)."""
        fields.setdefault("model", self.model)
        return self.lab.audio_attention(self.audio_id, **fields)

    def transcribe(self, **fields: Any) -> dict:
        """The greedy transcript ({"text", "tokens"}), with `interventions` active if given."""
        fields.setdefault("model", self.model)
        return self.lab.transcribe(self.audio_id, **fields)

    def __repr__(self) -> str:
        return f"<Clip {self.audio_id}: {self.duration_s:.2f} s>"


class Picture(Result):
    """An uploaded image (POST /api/images's answer: image_id, width, height, …): `.attention(…)`, `.view()`."""

    def __init__(self, response: dict, lab: "LabLike", model: str | None = None):
        super().__init__(response, None, lab)
        self.model = model

    @property
    def image_id(self) -> str:
        return self.response["image_id"]

    def attention(self, **fields: Any) -> AttentionResult:
        """POST /api/image/attention on this image; fields as Lab.image_attention (layers, heads, queries,
        interventions, compare, image_size, …)."""
        fields.setdefault("model", self.model)
        return self.lab.image_attention(self.image_id, **fields)

    def view(self, size: int = 448) -> bytes:
        """The square the models see (centre crop of the shorter side), as PNG bytes."""
        with self.lab._open("GET", f"/api/images/{self.image_id}/view?size={int(size)}") as answer:
            return answer.read()

    def __repr__(self) -> str:
        return f"<Picture {self.image_id}: {self.response.get('width')}×{self.response.get('height')}>"
