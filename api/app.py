"""`create_app(settings)`: the trajectory API as a FastAPI app on its own SQLite store."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from fastapi import FastAPI

from api.error_handlers import install_error_handlers
from api.middleware import ApiKeyMiddleware, BodyLimitMiddleware
from api.models import Hello
from api.routers import data, env, trainer
from api.settings import ApiSettings
from api.store import TrajectoryStore

HELLO = "onecopy trajectory API"


def create_app(settings: ApiSettings | None = None) -> FastAPI:
    """Open (or create) the store at `settings.db_path` and build the app around it.

    The store is closed when the app shuts down (use TestClient as a context manager).
    """
    settings = settings or ApiSettings()
    store = TrajectoryStore(settings.db_path)

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        yield
        store.close()

    app = FastAPI(title=HELLO, lifespan=lifespan)
    app.state.settings = settings
    app.state.store = store
    install_error_handlers(app)
    app.add_middleware(BodyLimitMiddleware, max_body_bytes=settings.max_body_bytes)
    if settings.api_key is not None:
        app.add_middleware(ApiKeyMiddleware, api_key=settings.api_key)

    @app.get("/", response_model=Hello, tags=["meta"])
    def hello() -> Hello:
        """Liveness check; the only route open without the API key."""
        return Hello(message=HELLO)

    app.include_router(trainer.router)
    app.include_router(env.router)
    app.include_router(data.router)
    return app
