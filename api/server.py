"""Run the trajectory API (flags come from `ApiSettings`; `--help` lists them).

    run-api --port 8000 --db-path runs/api.db
    ONECOPY_API_KEY=secret python -m api.server --port 8000 --db-path runs/api.db
    curl -s localhost:8000/status

Restarting on the same --db-path resumes with the queue, registrations and step as they were.
"""

from __future__ import annotations

import logging

import uvicorn

from api.app import create_app
from api.settings import ApiSettings
from environments.config_flags import parse_config

logger = logging.getLogger("onecopy.api.server")


def main(argv: list[str] | None = None) -> None:
    # Flags not given take ApiSettings' defaults; api_key's reads $ONECOPY_API_KEY only here, never for --help.
    settings = parse_config(ApiSettings, argv, description="onecopy trajectory API", prog="run-api")
    logging.basicConfig(level=settings.log_level,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    app = create_app(settings)
    logger.info("[API] listening on http://%s:%d db=%s auth=%s", settings.host, settings.port,
                settings.db_path, "on" if settings.api_key else "off")
    uvicorn.run(app, host=settings.host, port=settings.port,
                log_level=settings.log_level.lower(), access_log=False)


if __name__ == "__main__":
    main()
