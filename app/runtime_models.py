"""The runtime's models (app/runtime.py Runtime is made of this and app/runtime_runs.py): the registry's specs,
each model loaded once on first use (its weights booked in the memory budget first), refused loads remembered,
models being prepared answered 503, models described from their files before a load, and the load-time parity kept
for the listing."""
from __future__ import annotations

import dataclasses
import json
import logging
import threading
import time
from pathlib import Path

import torch

from app.context import request_deadline
from app.memory import MemoryBudget, process_rss
from app.settings import Settings
from models import preparing
from models.adapters.base import AttentionAdapter
from models.hooks import UnsupportedAttention
from models.registry import ModelSpec

log = logging.getLogger("attnlab")
PARITY_DIR = ".measured"  # under the weights folder: each model's last load-time parity (ModelCatalog._keep_parity)


class UnknownModel(KeyError):
    pass


class ModelPreparing(UnknownModel):
    """A model whose weights a preparation is making now (models/preparing.py, `make run`): 503 with Retry-After
    (app/deps.py), not the 422 of a model this server does not have."""

    def __init__(self, message: str, retry_after: int):
        super().__init__(message)
        self.retry_after = retry_after


def gpu_total_bytes(settings: Settings) -> int | None:
    """The GPU's memory when the settings run on one (None on a CPU)."""
    on_gpu = settings.device == "cuda" or (settings.device == "auto" and torch.cuda.is_available())
    return torch.cuda.get_device_properties(0).total_memory if on_gpu and torch.cuda.is_available() else None


def host_weight_bytes(adapter: AttentionAdapter) -> int:
    """Bytes of a loaded model's parameters and buffers in host memory (tied tensors once; 0 on a GPU)."""
    model = getattr(adapter, "model", None)
    if model is None or adapter.device.type != "cpu":
        return 0
    tensors = {t.data_ptr(): t.numel() * t.element_size() for t in (*model.parameters(), *model.buffers())}
    return sum(tensors.values())


def configure_atlas(adapter: AttentionAdapter, settings: Settings) -> None:
    """Long inputs (docs/science.md §10): the adapter's threshold and block settings from the settings."""
    adapter.full_map_tokens = settings.full_map_tokens_image if adapter.info.kind == "image" else settings.full_map_tokens
    block_rows = settings.atlas_block_rows or (1024 if adapter.device.type == "cuda" else 128)
    adapter.atlas_config = dataclasses.replace(
        adapter.atlas_config, block_rows=block_rows, overview_blocks=settings.overview_blocks,
    )


class ModelCatalog:
    """The models part of Runtime: what a request may name, and the loaded adapters. Runtime.__init__ sets the state
    below (`memory`: the budget a first-use model's weights are booked in)."""

    settings: Settings
    specs: dict[str, ModelSpec]
    memory: MemoryBudget
    unavailable: dict[str, str]  # model id → why it could not load
    _adapters: dict[str, AttentionAdapter]
    _described: dict[str, dict]  # model id → its ModelInfo read from its files (not loaded yet)
    _load_lock: threading.Lock

    def adapter(self, model_id: str, kind: str | None = None) -> AttentionAdapter:
        spec = self.specs.get(model_id)
        if spec is None or (kind is not None and spec.kind != kind):
            names = self.available_ids(kind)
            raise UnknownModel(f"unknown {kind or ''} model {model_id!r}; available: {names}".replace("  ", " "))
        adapter = self._adapters.get(model_id)
        if adapter is None:
            self._refuse_unprepared(model_id)
            waited_from = time.monotonic()
            try:
                return self._load(model_id, spec)
            finally:
                # a first use's load (gemma3-270m: its weights and two probes, over a minute on a busy machine) is the
                # server's one-time cost: it does not count against the request's time limit
                deadline = request_deadline.get()
                if deadline is not None:
                    request_deadline.set(deadline + time.monotonic() - waited_from)
        return adapter

    def preparation(self, model_id: str) -> dict | None:
        """Its preparation's state while a model's weights are not in place (models/preparing.py): "preparing" (or
        queued for it) or "failed", with the reason and the log; None when it is prepared or none is recorded."""
        spec = self.specs.get(model_id)
        if spec is None or model_id in self._adapters or spec.prepared is None or spec.prepared():
            return None
        return preparing.read(self.settings.weights_dir, model_id)

    def _refuse_unprepared(self, model_id: str) -> None:
        """ModelPreparing while a model is being prepared, UnknownModel when its preparation failed (not remembered
        in `unavailable`: the model is served once its weights are in place, without a restart)."""
        state = self.preparation(model_id)
        if state is None:
            return
        log_name = self.preparation_log(state)
        if state["state"] == "preparing":
            raise ModelPreparing(f"model {model_id!r} is being prepared on this server (`attnlab prepare`, started "
                                 f"{time.time() - state['since']:.0f} s ago; log: {log_name}); try again in a moment",
                                 preparing.RETRY_AFTER_S)
        raise UnknownModel(f"model {model_id!r} is unavailable: its preparation failed ({state.get('error')}); "
                           f"log: {log_name}")

    def preparation_log(self, state: dict) -> str | None:
        """A preparation's log by its absolute path on the server (weights/.preparing/<id>.log resolved): a path relative
        to the weights folder's bare name (`w2/.preparing/…`) left the reader to guess the folder it starts from."""
        log_path = state.get("log")
        if not log_path:
            return None
        return str((Path(self.settings.weights_dir) / preparing.STATE_DIR / Path(log_path).name).resolve())

    def not_ready(self, kind: str | None = None) -> list[dict]:
        """The models of `kind` being prepared, or whose preparation failed (GET /api/models `not_ready`, the pages'
        model menus): id, kind, description, state, log, and retry_after_s or error."""
        entries = []
        for model_id, spec in self.specs.items():
            state = self.preparation(model_id) if kind is None or spec.kind == kind else None
            if state is None:
                continue
            entry = {"id": model_id, "kind": spec.kind, "description": spec.description, "state": state["state"],
                     "log": self.preparation_log(state)}
            if state["state"] == "preparing":
                entry["retry_after_s"] = preparing.RETRY_AFTER_S
            else:
                entry["error"] = state.get("error")
            entries.append(entry)
        return entries

    def _unprepared(self, spec: ModelSpec) -> bool:
        """Its weights are not in place (yet): a refusal for that is not remembered, the model may be prepared later."""
        return spec.prepared is not None and not spec.prepared()

    def available_ids(self, kind: str | None = None) -> list[str]:
        """The models of `kind` a request may name here (for the 422 on an unknown one): loaded, or described from
        their prepared files, or not refused so far; never one whose weights are not prepared (qwen2.5-0.5b before
        `make qwen2.5-0.5b`), which GET /api/models leaves out too. Nothing is loaded to answer."""
        names = []
        for model_id, spec in self.specs.items():
            if (kind is not None and spec.kind != kind) or model_id in self.unavailable:
                continue
            if model_id not in self._adapters and spec.prepared is not None and not spec.prepared():
                continue
            if model_id not in self._adapters and spec.describe is not None:
                try:
                    self.describe(model_id, load=False)
                except UnknownModel:  # not prepared here (now in `unavailable`)
                    continue
            names.append(model_id)
        return sorted(names)

    def _load(self, model_id: str, spec: ModelSpec) -> AttentionAdapter:
        """Load a model once (under the load lock); refused loads are remembered in `unavailable`."""
        with self._load_lock:
            adapter = self._adapters.get(model_id)
            if adapter is None:
                if model_id in self.unavailable:  # refused once: say why again, without retrying the load
                    raise UnknownModel(f"model {model_id!r} is unavailable: {self.unavailable[model_id]}")
                first_use = model_id not in self.settings.default_models  # memory_reserved_bytes: the defaults
                booked = spec.weight_files() if first_use and spec.weight_files and self._on_host() else 0
                if booked:  # room before it loads: kept runs leave RAM, or the load waits (503)
                    # its weights and, while it loads, the probe's outputs (about as much again: gemma3-270m's
                    # logits over the long probe input, ours and eager's, 1.0 GiB beside 1.0 GiB of weights)
                    self.memory.reserve_model(model_id, 2 * booked, request_deadline.get())
                rss_before = process_rss()
                try:
                    adapter = spec.load(self.settings.device, self.settings.dtype)
                except BaseException as exc:
                    if booked:
                        self.memory.unreserve_model(model_id)
                    if not isinstance(exc, (ImportError, OSError, ValueError, UnsupportedAttention)):
                        raise
                    if not self._unprepared(spec):
                        self.unavailable[model_id] = str(exc)
                    raise UnknownModel(f"model {model_id!r} is unavailable: {exc}") from exc
                configure_atlas(adapter, self.settings)
                if first_use:  # its weights, or what the load left resident if more (gemma3-270m: its 262k-token
                    # tokenizer too, 1.4 GiB for 1.0 GiB of weights), never more than was booked for the load
                    grown = min(max(0, process_rss() - rss_before), 2 * booked) if booked else 0
                    self.memory.add_model(model_id, max(host_weight_bytes(adapter), grown))
                self._adapters[model_id] = adapter
                self._keep_parity(adapter)
        return adapter

    def _on_host(self) -> bool:
        """Whether loaded weights live in host memory (the budget's concern): not when a GPU takes them."""
        return gpu_total_bytes(self.settings) is None

    def describe(self, model_id: str, load: bool = True) -> dict | None:
        """The ModelInfo dict of a model without loading it when its spec can read its facts from its files (a
        prepared decoder LM: no parity until it is loaded), else that of the loaded model (loaded here, once; with
        `load` False, None instead). UnknownModel when it is not prepared here or was refused."""
        adapter = self._adapters.get(model_id)
        if adapter is not None:
            return adapter.info.to_dict()
        spec = self.specs.get(model_id)
        if spec is not None:
            # Weights not in place: being prepared (ModelPreparing), or not prepared here. Such a refusal is not
            # remembered in `unavailable` (the model is served once prepared), so it is decided here on every call.
            self._refuse_unprepared(model_id)
            if self._unprepared(spec):
                raise UnknownModel(f"model {model_id!r} is not prepared on this server")
        if spec is not None and spec.describe is not None and model_id not in self.unavailable:
            described = self._described.get(model_id)
            if described is None:
                try:
                    info = spec.describe(self.settings.dtype)
                except (OSError, ValueError) as exc:  # not prepared (the load would say the same)
                    if not self._unprepared(spec):
                        self.unavailable[model_id] = str(exc)
                    raise UnknownModel(f"model {model_id!r} is unavailable: {exc}") from exc
                except Exception:  # noqa: BLE001 - files of a shape the description does not know: the load decides
                    log.exception("describing %s from its files failed; it is loaded to be listed", model_id)
                    info = None
                if info is not None:
                    described = self._described[model_id] = info.to_dict()
            if described is not None:
                return self._with_last_parity(model_id, described)
        return self.adapter(model_id).info.to_dict() if load else None

    # ---- the load-time parity, kept for the listing before a load --------------------------------------------------
    def _parity_file(self, model_id: str) -> Path:
        return Path(self.settings.weights_dir) / PARITY_DIR / f"{model_id}.json"

    def _keep_parity(self, adapter: AttentionAdapter) -> None:
        """The load-time probe's parity, kept in the weights folder (.measured/<id>.json) so that GET /api/models
        states it beside the model before its next load (Whisper, a decoder LM: described from their files)."""
        parity = adapter.info.parity
        if not isinstance(parity, (int, float)):
            return
        path = self._parity_file(adapter.info.id)
        try:
            path.parent.mkdir(exist_ok=True)
            path.write_text(json.dumps({"parity": parity, "dtype": self.settings.dtype, "source": adapter.info.source,
                                        "files": self._files_of(adapter.info.id), "measured_at": time.time()}))
        except OSError as exc:  # a read-only weights folder: the listing says nothing until a load, as before
            log.warning("could not keep %s's parity in %s: %s", adapter.info.id, path, exc)

    def _files_of(self, model_id: str) -> str | None:
        """An operator's local model folder as it is now (its resolved path and time of change), None for the others:
        two folders of one name (tests' tiny models in numbered temporary folders) never share a parity."""
        settings = self.settings
        configured = {**settings.extra_text_models, **settings.extra_image_models, **settings.extra_models}.get(model_id)
        folder = Path(configured).expanduser() if configured else None
        if folder is None or not folder.exists():
            return None
        folder = folder.resolve()
        return f"{folder}@{folder.stat().st_mtime_ns}"

    def _with_last_parity(self, model_id: str, described: dict) -> dict:
        """A model described from its files: with the parity its last load measured (same files, this dtype), if any."""
        if described.get("parity") is not None:
            return described
        try:
            kept = json.loads(self._parity_file(model_id).read_text())
        except (OSError, ValueError):
            return described
        # the same files at the same dtype: another model under this id (a test's tiny model) has its own figure
        same = (kept.get("dtype") == self.settings.dtype and kept.get("source") == described.get("source")
                and kept.get("files") == self._files_of(model_id))
        if not same or not isinstance(kept.get("parity"), (int, float)):
            return described
        return {**described, "parity": kept["parity"]}

    def loaded_adapters(self) -> list[AttentionAdapter]:
        return list(self._adapters.values())
