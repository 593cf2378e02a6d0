"""Shared objects for routes, through FastAPI dependencies."""
from __future__ import annotations

from typing import Annotated

from fastapi import Depends, Request

from app.audiostore import AudioStore, get_audio_store
from app.errors import field_error
from app.imagestore import UploadStore, get_image_store
from app.errors import Overloaded
from app.runtime import ModelPreparing, Runtime, UnknownModel
from app.settings import Settings
from models.adapters.base import AttentionAdapter


# async: FastAPI would run a plain `def` dependency in a worker thread, a thread hop per request for a lookup.
async def get_runtime(request: Request) -> Runtime:
    return request.app.state.runtime


async def get_app_settings(request: Request) -> Settings:
    return request.app.state.runtime.settings


RuntimeDep = Annotated[Runtime, Depends(get_runtime)]
SettingsDep = Annotated[Settings, Depends(get_app_settings)]
ImageStoreDep = Annotated[UploadStore, Depends(get_image_store)]  # uploads: memory or Redis (app/imagestore.py)
AudioStoreDep = Annotated[AudioStore, Depends(get_audio_store)]  # speech uploads (app/audiostore.py)


def adapter_for(runtime: Runtime, model: str, kind: str | None = None, loc: tuple = ("model",)) -> AttentionAdapter:
    """The adapter of `model` (of `kind`: text, image, audio, when given), loaded on first use; a 422 naming `loc`
    when this server has no such model of that kind or refused to load it (the message lists what it has); a 503 with
    Retry-After while its weights are being prepared (`make run` serves meanwhile: app/preparation.py)."""
    try:
        return runtime.adapter(model, kind=kind)
    except ModelPreparing as exc:
        raise Overloaded(str(exc.args[0]), exc.retry_after) from None
    except UnknownModel as exc:
        raise field_error(loc, str(exc.args[0])) from None
