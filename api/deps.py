"""FastAPI dependencies: the store and settings that `create_app` put on `app.state`."""

from __future__ import annotations

from typing import Annotated

from fastapi import Depends, Request

from api.settings import ApiSettings
from api.store import TrajectoryStore


def get_store(request: Request) -> TrajectoryStore:
    return request.app.state.store


def get_settings(request: Request) -> ApiSettings:
    return request.app.state.settings


StoreDep = Annotated[TrajectoryStore, Depends(get_store)]
SettingsDep = Annotated[ApiSettings, Depends(get_settings)]
