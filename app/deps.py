"""Shared objects for routes, through FastAPI dependencies."""
from __future__ import annotations

from typing import Annotated

from fastapi import Depends, Request

from app.imagestore import UploadStore, get_image_store
from app.runtime import Runtime
from app.settings import Settings


# async: FastAPI would run a plain `def` dependency in a worker thread, a thread hop per request for a lookup.
async def get_runtime(request: Request) -> Runtime:
    return request.app.state.runtime


async def get_app_settings(request: Request) -> Settings:
    return request.app.state.runtime.settings


RuntimeDep = Annotated[Runtime, Depends(get_runtime)]
SettingsDep = Annotated[Settings, Depends(get_app_settings)]
ImageStoreDep = Annotated[UploadStore, Depends(get_image_store)]  # uploads: memory or Redis (app/imagestore.py)
