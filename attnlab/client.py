"""`attnlab.Lab`: a Python client over the lab's HTTP API (docs/api.md), for notebooks and scripts.

Standard library and numpy only (tqdm for progress bars and xarray for DataArrays are used when installed). Every
call is one or a few HTTP requests; the numbers are the server's, decoded into numpy, never recomputed here.

- Errors: a 4xx/5xx answer raises `LabError` with the server's `detail` and status.
- Long work (attention, patching, lens, faithfulness, speech attention) is sent as a job (`Accept:
  text/event-stream`, docs/api.md "Jobs"): its accepted event carries the ETA, progress events move a tqdm bar, the
  done event is the usual JSON. A KeyboardInterrupt cancels the job on the server (it stops at its next layer or step);
  leaving the stream otherwise (an exception, breaking out of `generate`) closes the connection, and the server stops
  the job after job_reattach_grace_s. A stream cut without an answer re-attaches to the job by its last event id.
- A fleet (docs/deploy.md "Fleet"): every request carries this Lab's own `X-Attnlab-Client` id, so its work lands on
  one replica. A job whose stream is cut re-attaches first (its owner forwards); one that cannot (its replica died),
  or refused for a moment (502/503/504, a replica shutting down), is sent again, up to `retries` times: the result
  then comes from another replica.
"""
from __future__ import annotations

import atexit
import http.client
import importlib.util
import json
import math
import mimetypes
import os
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.parse
import urllib.request
import uuid
from pathlib import Path
from typing import Any, Iterator, Sequence

from attnlab.errors import LabError
from attnlab.interventions import Intervention, to_items
from attnlab.results import (BINARY_MEDIA_TYPE, AttentionResult, AudioAttentionResult, Clip, Continuation,
                             FaithfulnessResult, LensResult, PatchingResult, Picture, Window, decode, read_binary)

DEFAULT_URL = "http://127.0.0.1:8000"
STREAM = {"Accept": "text/event-stream"}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _progress_bar(what: str):
    """A tqdm bar when tqdm is installed (tqdm.auto: the notebook's widget in Jupyter), shown only for work that
    lasts over a second; None otherwise."""
    try:
        from tqdm.auto import tqdm
    except ImportError:
        return None
    try:
        return tqdm(total=None, desc=what, unit="layer", delay=1.0, leave=False)
    except ImportError:  # tqdm.notebook in a kernel without ipywidgets: the text bar
        from tqdm.std import tqdm as text_tqdm

        return text_tqdm(total=None, desc=what, unit="layer", delay=1.0, leave=False)


class Lab:
    """A lab server at `url` (default: $ATTNLAB_URL, else http://127.0.0.1:8000), or one of its own: `Lab.start()`.

    `timeout`: seconds a plain request or a stream may stay silent. `progress`: show tqdm bars for jobs.
    """

    def __init__(self, url: str | None = None, *, timeout: float = 900.0, progress: bool = True, retries: int = 3):
        self.url = (url or os.environ.get("ATTNLAB_URL") or DEFAULT_URL).rstrip("/")
        self.timeout = timeout
        self.progress = progress
        self.retries = retries  # a job sent again after its stream was cut or a replica refused it for a moment
        self.client_id = uuid.uuid4().hex  # X-Attnlab-Client: this Lab's work lands together on a fleet
        self._process: subprocess.Popen | None = None
        self._log = None

    # ---- a server of its own -------------------------------------------------------------------------------------

    @classmethod
    def start(cls, *, port: int | None = None, host: str = "127.0.0.1", settings: dict[str, Any] | None = None,
              args: Sequence[str] = (), log: str | Path | None = None, ready_timeout: float = 300.0,
              **kwargs: Any) -> "Lab":
        """Start `attnlab serve` on a free port (or `port`) in a subprocess and wait until it is ready.

        settings: server settings (docs/configuration.md) passed as ATTNLAB_<NAME> environment variables, lists and
        dicts as JSON, e.g. {"default_models": ["smollm2-135m"]}. args: more `attnlab serve` options. log: a file for
        the server's output (default: discarded). The server stops at `lab.close()`, at the end of a `with` block,
        or when this interpreter exits."""
        # the server runs in its own process: looked for here, never imported (a Lab needs none of its code)
        if importlib.util.find_spec("app") is None or importlib.util.find_spec("uvicorn") is None:
            raise RuntimeError("Lab.start needs the attnlab server installed here (pip install attnlab with "
                               "requirements.txt); or connect to a running one with Lab(url)")
        port = port or _free_port()
        env = {**os.environ, "HF_HUB_OFFLINE": "1"}
        for name, value in (settings or {}).items():
            env[f"ATTNLAB_{name.upper()}"] = value if isinstance(value, str) else json.dumps(value)
        lab = cls(f"http://{host}:{port}", **kwargs)
        lab._log = open(log, "w") if log else None  # noqa: SIM115 - closed with the server
        output = lab._log or subprocess.DEVNULL
        lab._process = subprocess.Popen([sys.executable, "-m", "app.cli", "serve", "--host", host, "--port",
                                         str(port), *args], env=env, stdout=output, stderr=subprocess.STDOUT)
        atexit.register(lab.close)
        try:
            lab.wait_ready(ready_timeout)
        except BaseException:
            lab.close()
            raise
        return lab

    def wait_ready(self, timeout: float = 300.0) -> dict:
        """Wait until GET /api/ready answers 200 (the default models are loaded); returns its answer."""
        deadline = time.monotonic() + timeout
        while True:
            if self._process is not None and self._process.poll() is not None:
                raise RuntimeError(f"the lab server exited with status {self._process.returncode} before it was "
                                   "ready" + (f"; see {self._log.name}" if self._log else ""))
            try:
                return self._json("GET", "/api/ready", timeout=5)
            except (LabError, OSError):
                if time.monotonic() > deadline:
                    raise TimeoutError(f"{self.url} was not ready within {timeout:g} s") from None
                time.sleep(0.3)

    def close(self) -> None:
        """Stop the server this Lab started (nothing for a Lab(url))."""
        process, self._process = self._process, None
        if process is not None and process.poll() is None:
            process.terminate()
            try:
                process.wait(timeout=20)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
        if self._log is not None:
            self._log.close()
            self._log = None

    def __enter__(self) -> "Lab":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def __repr__(self) -> str:
        own = ", its own server" if self._process is not None else ""
        return f"Lab({self.url!r}{own})"

    # ---- HTTP ------------------------------------------------------------------------------------------------------

    def _open(self, method: str, path: str, body: Any = None, *, headers: dict | None = None,
              data: bytes | None = None, timeout: float | None = None):
        if body is not None:
            data = json.dumps(body, allow_nan=False).encode()
            headers = {"Content-Type": "application/json", **(headers or {})}
        headers = {"X-Attnlab-Client": self.client_id, **(headers or {})}
        call = urllib.request.Request(self.url + path, data=data, method=method, headers=headers)
        try:
            return urllib.request.urlopen(call, timeout=timeout or self.timeout)
        except urllib.error.HTTPError as exc:
            raise _lab_error(exc, path) from None
        except urllib.error.URLError as exc:
            raise _cut(f"cannot reach {self.url}: {exc.reason}", path) from None

    def _json(self, method: str, path: str, body: Any = None, **kwargs: Any) -> Any:
        with self._open(method, path, body, **kwargs) as answer:
            return json.loads(answer.read())

    def _binary(self, path: str, body: dict) -> dict:
        """A POST answered in the binary form (`Accept: application/octet-stream`), read into one buffer and viewed
        as numpy arrays (attnlab.results.read_binary); sent again after a passing refusal, as a job is."""
        for attempt in range(self.retries + 1):
            try:
                with self._open("POST", path, body, headers={"Accept": BINARY_MEDIA_TYPE}) as answer:
                    if answer.headers.get_content_type() != BINARY_MEDIA_TYPE:
                        return json.loads(answer.read())
                    return read_binary(_read_all(answer, path))
            except LabError as exc:
                if attempt == self.retries or not _passing(exc):
                    raise
                time.sleep(min(5.0, exc.retry_after or 0.5))
        raise AssertionError("unreachable: the last attempt returns or raises")

    def _events(self, path: str, body: dict | None, seen: dict | None = None, *, method: str = "POST",
                headers: dict | None = None) -> Iterator[dict]:
        """The server-sent events of a request (a POST sent as a job, or GET of a job's events), each as {"event":
        name or None, **data}; `seen["id"]` follows the last event id (`<job_id>:<n>`, for re-attaching). The
        connection is closed when the iteration ends, whichever way."""
        answer = self._open(method, path, body, headers={**STREAM, **(headers or {})})
        return self._read_events(answer, path, seen if seen is not None else {})

    def _read_events(self, answer, path: str, seen: dict) -> Iterator[dict]:
        try:
            name, data, event_id = None, [], None
            for raw in _lines(answer, path):
                line = raw.decode("utf-8").rstrip("\r\n")
                if line.startswith("event:"):
                    name = line[6:].strip()
                elif line.startswith("id:"):
                    event_id = line[3:].strip()
                elif line.startswith("data:"):
                    data.append(line[5:].lstrip())
                elif not line and data:
                    event = json.loads("\n".join(data))
                    if event_id:
                        seen["id"] = event_id
                    yield {"event": name, **event} if name else event
                    name, data, event_id = None, [], None
        finally:
            answer.close()  # the server sees the stream end (a job runs on for job_reattach_grace_s, see _job)

    def _job(self, path: str, body: dict, what: str | None = None) -> dict:
        """Run a POST as a job (docs/api.md "Jobs") and return its done event's JSON, showing progress with its ETA.
        A stream cut without an answer re-attaches to the job (GET /api/jobs/{job_id}/events with the last event's
        id): the work in progress goes on. Only when that fails (the job or its replica is gone), or on a passing
        refusal (_passing), is the job sent again. Re-attaches and sends together are at most `retries` after the
        first stream: one call opens at most retries + 1 streams. A KeyboardInterrupt cancels the job on the server
        (DELETE /api/jobs/{job_id})."""
        bar = _progress_bar(what or path) if self.progress else None
        seen: dict = {}
        events: Any = None
        try:
            for attempt in range(self.retries + 1):
                try:
                    if events is None:  # the job sent (again): a new job, its own event ids
                        seen.clear()
                        events = self._events(path, body, seen)
                    return self._job_answer(events, path, bar)
                except LabError as exc:
                    if events is not None:
                        events.close()
                    events = None
                    if attempt == self.retries:
                        raise
                    if getattr(exc, "cut", False) and "id" in seen:  # its job may live on: re-attach first
                        events = self._reattach(seen, path)
                        if events is not None:
                            continue
                    if not _passing(exc):
                        raise
                    time.sleep(min(5.0, exc.retry_after or 0.5))
            raise AssertionError("unreachable: the last attempt returns or raises")
        except KeyboardInterrupt:
            self._cancel_job(seen)
            raise
        finally:
            if events is not None:
                events.close()
            if bar is not None:
                bar.close()

    def _job_answer(self, events: Iterator[dict], path: str, bar: Any) -> dict:
        for event in events:
            if event.get("accepted"):
                if bar is not None:
                    bar.set_postfix_str(f"ETA {event.get('eta_s', 0):.1f} s, "
                                        f"{event.get('queue_position', 0)} ahead", refresh=False)
            elif "progress" in event:
                if bar is not None:
                    bar.total = event.get("total")
                    bar.update(event["progress"] - bar.n)  # update, not refresh: the bar waits out its delay
            elif event.get("done"):
                event.pop("done")
                return event
            elif "error" in event:
                error = LabError(event.get("status"), event["error"], path, event.get("retry_after"))
                error.gone = event.get("cancelled") is True  # no stream listened in time: sent again (_passing)
                raise error
        raise _cut("the stream ended without an answer", path)

    def _reattach(self, seen: dict, path: str) -> Iterator[dict] | None:
        """The rest of a job's events after the last one seen (errors name the job's `path`), or None (the job is
        then sent again) when the job cannot be re-attached: unknown, expired, its replica gone (404), or no answer."""
        job_id = seen["id"].rpartition(":")[0]
        try:
            answer = self._open("GET", f"/api/jobs/{job_id}/events", headers={**STREAM, "Last-Event-ID": seen["id"]})
        except LabError:
            return None
        return self._read_events(answer, path, seen)

    def _cancel_job(self, seen: dict) -> None:
        """Best effort: the job stops at once instead of after job_reattach_grace_s."""
        if "id" in seen:
            try:
                self._json("DELETE", f"/api/jobs/{seen['id'].rpartition(':')[0]}", timeout=5)
            except (LabError, OSError):
                pass

    # ---- service -------------------------------------------------------------------------------------------------

    def health(self) -> dict:
        return self._json("GET", "/api/health")

    def ready(self) -> dict:
        return self._json("GET", "/api/ready")

    def models(self, kind: str | None = None) -> list[dict]:
        """GET /api/models: every model a request may name (ModelInfo dicts), of one kind if given."""
        query = f"?kind={urllib.parse.quote(kind)}" if kind else ""
        return self._json("GET", f"/api/models{query}")["models"]

    def jobs(self) -> dict:
        """GET /api/jobs: the jobs running and waiting, and the memory held."""
        return self._json("GET", "/api/jobs")

    # ---- text ----------------------------------------------------------------------------------------------------

    def attention(self, text: str, model: str | None = None, *, layers: Sequence[int] | None = None,
                  heads: Sequence[int] | None = None, interventions: Sequence[Intervention | dict] = (),
                  compare: bool = False, include_scores: bool = False, include_base: bool = False,
                  **fields: Any) -> AttentionResult:
        """POST /api/text/attention. Any other request field (encoding, "f32" unless given; text_pair, position, chat,
        samples, weighting, thumbnail_size, target, …) goes through `fields`. Returns an AttentionResult
        (`.attention` in numpy). `binary=True`: one plain request answered in the binary form (the maps' float32 bytes
        as they are, read without parsing or copying: docs/api.md "The binary form"), rather than a job with its
        progress bar; None (the default): binary when every layer and head's map is asked without `compare`, the
        case where the maps are most of the work."""
        fields.setdefault("encoding", "f32")  # exact and compact numpy arrays
        binary = fields.pop("binary", None)
        body = _body(model=model, text=text, layers=layers, heads=heads, interventions=to_items(interventions),
                     compare=compare, include_scores=include_scores, include_base=include_base, **fields)
        if binary is None:
            binary = layers is None and heads is None and not compare and fields["encoding"] != "json"
        if binary:
            return AttentionResult(self._binary("/api/text/attention", body), body, self)
        return AttentionResult(self._job("/api/text/attention", body, "attention"), body, self)

    def show(self, text: str, model: str | None = None, *, layer: int | None = None, head: int | None = None,
             **fields: Any):
        """The notebook widget (attnlab.widget) of `lab.attention(text, model, **fields)`, opening on `layer`,
        `head` (model numbering) when given."""
        options = {name: value for name, value in (("layer", layer), ("head", head)) if value is not None}
        return self.attention(text, model, **fields).show(**options)

    def window(self, run_id: str, layer: int, head: int, rows: Sequence[int] | None = None,
               cols: Sequence[int] | None = None, **fields: Any) -> Window:
        """POST /api/runs/{run_id}/window: the exact P of one head over rows × cols (half-open ranges) of a kept run.
        `fields`: kind, beta, include_scores, weighting, minus. Answered in the binary form (the numbers' float32
        bytes, viewed without a copy: docs/api.md "The binary form")."""
        body = _body(layer=layer, head=head, rows=list(rows), cols=list(cols), encoding="f32", **fields)
        return Window(self._binary(f"/api/runs/{run_id}/window", body), body, self)

    def row(self, run_id: str, row: int, *, layers: Sequence[int] | None = None, heads: Sequence[int] | None = None,
            **fields: Any) -> dict:
        """POST /api/runs/{run_id}/row: one query row over every key for layers × heads (numpy `attention`
        (layers, heads, T_k), read from the binary form), and `span_mass` with `span`."""
        body = _body(row=row, layers=layers, heads=heads, encoding="f32", **fields)
        answer = self._binary(f"/api/runs/{run_id}/row", body)
        for key in ("attention", "span_mass"):
            answer[key] = decode(answer.get(key))
        return answer

    def tokenize(self, text: str, model: str | None = None) -> dict:
        """POST /api/text/tokenize: how the model's tokenizer splits a short text (tokens and ids)."""
        return self._json("POST", "/api/text/tokenize", _body(model=model, text=text))

    def generate(self, text: str, model: str | None = None, *, max_new_tokens: int = 16,
                 interventions: Sequence[Intervention | dict] = (), chat: bool = False,
                 attention: dict | None = None) -> Continuation:
        """POST /api/text/generate: iterate the continuation, one dict per step (the intervened token and the base
        token side by side); afterwards `.text` and `.base_text`. Breaking out of the loop stops it on the server.
        `attention={"layers": […]|None, "heads": […]|None, "top_k": None|k}`: each step also carries `attention` and
        `base_attention`, numpy (layers, heads, P + step) rows (with top_k, [l][h] dicts of numpy `indices`, `values`
        and the row's `lse`); afterwards `.run_id`/`.base_run_id` name the kept runs and `.window()` reads them."""
        if attention is not None and attention.get("top_k") is None:
            attention = {"encoding": "f32", **attention}  # whole rows as exact float32, without parsing text
        body = _body(model=model, text=text, max_new_tokens=max_new_tokens, interventions=to_items(interventions),
                     chat=chat, attention=attention)
        return Continuation(self, body)

    def patching(self, clean: str | None = None, corrupt: str | None = None, answer: str | None = None,
                 wrong: str | None = None, model: str | None = None, *, scan: str = "heads", method: str = "exact",
                 interventions: Sequence[Intervention | dict] = (), **fields: Any) -> PatchingResult:
        """POST /api/text/patching: each head's (or layer × position's) share of the logit difference restored by
        patching it from the clean run. A set of pairs: `pairs=[{clean, corrupt, answer, wrong}, …]` or `template=`."""
        body = _body(model=model, clean=clean, corrupt=corrupt, answer=answer, wrong=wrong, scan=scan, method=method,
                     interventions=to_items(interventions), **fields)
        return PatchingResult(self._job("/api/text/patching", body, "patching"), body, self)

    def lens(self, text: str, model: str | None = None, *, top: int = 5,
             interventions: Sequence[Intervention | dict] = (), compare: bool = False) -> LensResult:
        """POST /api/text/lens: the logit lens, the top tokens of the residual stream after each layer."""
        body = _body(model=model, text=text, top=top, interventions=to_items(interventions), compare=compare)
        return LensResult(self._job("/api/text/lens", body, "lens"), body, self)

    def faithfulness(self, text: str, model: str | None = None, **fields: Any) -> FaithfulnessResult:
        """POST /api/text/faithfulness: how much masking each method's top-k keys of a query row changes the output.
        `fields`: position, k, methods, answer, layer, head."""
        body = _body(model=model, text=text, **fields)
        return FaithfulnessResult(self._job("/api/text/faithfulness", body, "faithfulness"), body, self)

    def score_stats(self, text: str, layer: int, head: int, model: str | None = None, *, bins: int | None = None) -> dict:
        """POST /api/text/score_stats: one head's raw scores q·k over the pairs its mask allows (histogram, mean,
        variance), the Gaussian theory fitted with the head's own q and k, the rows' entropy at scale 1, 1/√d and the
        model's β₀, and the attention's parameter and map counts. Encoders and decoder LMs."""
        body = _body(model=model, text=text, layer=layer, head=head, bins=bins)
        return self._job("/api/text/score_stats", body, "score statistics")

    def permutation_check(self, text: str, model: str | None = None, *, seed: int | None = None) -> dict:
        """POST /api/text/permutation_check: max |P(πx) − Π P(x) Πᵀ| over every layer and head of an encoder, with
        positions off (float rounding) and on (not equal): attention without positions is permutation-equivariant."""
        return self._job("/api/text/permutation_check", _body(model=model, text=text, seed=seed), "permutation check")

    def circuit(self, pairs: Sequence[dict] | None = None, task: dict | str | None = None, model: str | None = None, *,
                method: str = "eap", **fields: Any):
        """POST /api/text/circuit: an edge graph of heads (q, k, v apart) and MLPs scored over prompt pairs
        (`pairs=[{clean, corrupt, answer, wrong}, …]`, or `task="ioi"` / `{"name", "n", "seed"}`), by "eap", "eap_ig"
        or "exact". `fields`: ig_steps, edges, n_exact, budgets, budget, top. Returns a CircuitResult (`.edges`,
        `.circuit(budget)`, `.faithfulness`, `.edge(name)`, `.to_json(path)`)."""
        from attnlab.circuits import CircuitResult
        if isinstance(task, str):
            task = {"name": task}
        body = _body(model=model, pairs=list(pairs) if pairs is not None else None, task=task, method=method, **fields)
        if "top" in fields and fields["top"] is None:
            body["top"] = None  # every edge (None is otherwise left out, and the server lists its default top)
        return CircuitResult(self._job("/api/text/circuit", body, "circuit"), body, self)

    # ---- speech --------------------------------------------------------------------------------------------------

    def audio(self, source: str | Path | bytes, model: str | None = None) -> Clip:
        """Upload a clip (a path or the file's bytes) with POST /api/audio; returns a Clip with `.attention(…)` and
        `.transcribe()`. `model` is the speech model its calls use (None: the server's default)."""
        return Clip(self._upload("/api/audio", source, "clip"), self, model)

    def _upload(self, path: str, source: str | Path | bytes, default_name: str) -> dict:
        """POST a file as the multipart field `file` (what the upload routes take); returns the JSON answer."""
        if isinstance(source, (bytes, bytearray)):
            content, name = bytes(source), default_name
        else:
            file = Path(source)
            content, name = file.read_bytes(), file.name
        boundary = uuid.uuid4().hex
        kind = mimetypes.guess_type(name)[0] or "application/octet-stream"
        quoted = name.replace('"', "_").replace("\r", "_").replace("\n", "_")
        data = (f"--{boundary}\r\nContent-Disposition: form-data; name=\"file\"; filename=\"{quoted}\"\r\n"
                f"Content-Type: {kind}\r\n\r\n").encode() + content + f"\r\n--{boundary}--\r\n".encode()
        with self._open("POST", path, data=data,
                        headers={"Content-Type": f"multipart/form-data; boundary={boundary}"}) as answer:
            return json.loads(answer.read())

    # ---- images --------------------------------------------------------------------------------------------------

    def image(self, source: str | Path | bytes, model: str | None = None) -> Picture:
        """Upload an image (a path or the file's bytes: PNG, JPEG or WebP) with POST /api/images; returns a Picture
        with `.attention(…)`. `model` is the image model its calls use (None: the server's default)."""
        return Picture(self._upload("/api/images", source, "image"), self, model)

    def image_attention(self, image_id: str, model: str | None = None, *, layers: Sequence[int] | None = None,
                        heads: Sequence[int] | None = None, queries: Sequence[int] | None = None,
                        interventions: Sequence[Intervention | dict] = (), compare: bool = False,
                        encoding: str = "f32", **fields: Any) -> AttentionResult:
        """POST /api/image/attention on an uploaded image: `.attention` (layers, heads, T, T), or with `queries`
        those rows (layers, heads, q, T); `tokens` are the labels ("CLS", "p(3,7)"), `response["grid"]` the patches.
        `fields`: image_size, include_scores, weighting, thumbnail_size, …; answered in the binary form (the maps'
        float32 bytes as they are) unless `encoding="json"`."""
        body = _body(model=model, image_id=image_id, layers=layers, heads=heads, queries=queries,
                     interventions=to_items(interventions), compare=compare, encoding=encoding, **fields)
        if encoding == "json":
            return AttentionResult(self._json("POST", "/api/image/attention", body), body, self)
        return AttentionResult(self._binary("/api/image/attention", body), body, self)

    def audio_attention(self, audio_id: str, model: str | None = None, *, layers: Sequence[int] | None = None,
                        heads: Sequence[int] | None = None, interventions: Sequence[Intervention | dict] = (),
                        compare: bool = False, encoding: str = "f32", **fields: Any) -> AudioAttentionResult:
        """POST /api/audio/attention on an uploaded clip (see Clip.attention)."""
        body = _body(model=model, audio_id=audio_id, layers=layers, heads=heads,
                     interventions=to_items(interventions), compare=compare, encoding=encoding, **fields)
        return AudioAttentionResult(self._job("/api/audio/attention", body, "speech attention"), body, self)

    def transcribe(self, audio_id: str, model: str | None = None, *,
                   interventions: Sequence[Intervention | dict] = (), **fields: Any) -> dict:
        """POST /api/audio/transcribe: the greedy transcript (with the interventions active) as
        {"text", "tokens": [{"token", "prob", "text"}, …]}."""
        body = _body(model=model, audio_id=audio_id, interventions=to_items(interventions), **fields)
        tokens, seen = [], {}
        events = self._events("/api/audio/transcribe", body, seen)
        done = False
        try:
            for event in events:  # a job's events (docs/api.md "Jobs"): accepted, a token event per token, done
                if "error" in event:
                    raise LabError(event.get("status"), event["error"], "/api/audio/transcribe",
                                   event.get("retry_after"))
                if event.get("done"):
                    done = True
                    return {"text": event.get("text"), "tokens": tokens}
                if "token" in event:
                    tokens.append(event)
        finally:  # leaving early stops the decoding on the server
            events.close()
            if not done:
                self._cancel_job(seen)
        raise LabError(None, "the transcript stream ended without its done event", "/api/audio/transcribe")


def _body(**fields: Any) -> dict:
    """A request body without the fields left at None (the server's defaults then apply)."""
    body = {}
    for name, value in fields.items():
        if value is None:
            continue
        if name in ("layers", "heads", "encoder_layers", "queries", "rows", "cols", "span"):  # tuples, ranges, numpy ints
            value = [int(v) for v in value]
        if isinstance(value, float) and not math.isfinite(value):
            raise ValueError(f"{name}: {value} is not a finite number")
        body[name] = value
    return body


def _lines(answer, path: str) -> Iterator[bytes]:
    """The response's lines; a connection cut mid-stream (the replica died) is a LabError with no status."""
    try:
        yield from answer
    except (OSError, http.client.HTTPException) as exc:
        raise _cut(f"the stream was cut: {exc!r}", path) from None


def _cut(detail: str, path: str) -> LabError:
    """A LabError for no answer at all: the server was not reached, or its stream ended without a last event."""
    error = LabError(None, detail, path)
    error.cut = True
    return error


def _read_all(answer, path: str) -> bytearray:
    """A response's whole body into one writable buffer (the arrays viewing it are then writable, and not copied)."""
    size = answer.headers.get("Content-Length")
    if size is None:
        return bytearray(answer.read())
    buffer = bytearray(int(size))
    view, done = memoryview(buffer), 0
    while done < len(buffer):
        try:
            got = answer.readinto(view[done:])
        except (OSError, http.client.HTTPException):
            got = 0
        if not got:
            raise _cut(f"the answer ended after {done:,} of its {len(buffer):,} bytes", path)
        done += got
    return buffer


def _passing(exc: LabError) -> bool:
    """A failure that sending the job again may get past: no answer (a connection refused or cut, a stream that
    ended without one), a proxy's or a stopping replica's refusal (502/503/504), an error event with retry_after, a
    job cancelled because no stream listened within job_reattach_grace_s (re-attached too late)."""
    if getattr(exc, "cut", False) or getattr(exc, "gone", False):
        return True
    return exc.status in (502, 503, 504) or (exc.retry_after is not None and "shutting down" in str(exc.detail))


def _lab_error(exc: urllib.error.HTTPError, path: str) -> LabError:
    raw = exc.read()
    try:
        detail = json.loads(raw).get("detail", raw.decode("utf-8", "replace"))
    except (ValueError, AttributeError):
        detail = raw.decode("utf-8", "replace") or exc.reason
    retry = exc.headers.get("Retry-After") if exc.headers else None
    return LabError(exc.code, detail, path, float(retry) if retry and retry.replace(".", "", 1).isdigit() else None)
