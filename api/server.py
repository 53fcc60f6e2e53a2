"""Run the trajectory API (flags come from `ApiSettings`; `--help` lists them).

    run-api --port 8000 --db-path runs/api.db
    ONECOPY_API_KEY=secret python -m api.server --port 8000 --db-path runs/api.db
    curl -s localhost:8000/status

Restarting on the same --db-path resumes with the queue, registrations and step as they were.
"""

from __future__ import annotations

import argparse
import logging
from dataclasses import MISSING, fields
from typing import get_type_hints

import uvicorn

from api.app import create_app
from api.settings import ApiSettings

logger = logging.getLogger("onecopy.api.server")


def build_parser() -> argparse.ArgumentParser:
    """One flag per ApiSettings field; unset flags fall back to the dataclass defaults."""
    parser = argparse.ArgumentParser(prog="run-api", description="onecopy trajectory API")
    hints = get_type_hints(ApiSettings)
    for spec in fields(ApiSettings):
        help_text = spec.metadata["help"]
        if spec.default is not MISSING:
            help_text += f" (default: {spec.default})"
        parser.add_argument(
            "--" + spec.name.replace("_", "-"),
            dest=spec.name,
            type=int if hints[spec.name] is int else str,
            default=None,
            help=help_text,
        )
    return parser


def parse_settings(argv: list[str] | None = None) -> ApiSettings:
    parser = build_parser()
    given = {name: value for name, value in vars(parser.parse_args(argv)).items() if value is not None}
    try:
        return ApiSettings(**given)
    except ValueError as error:
        parser.error(str(error))
        raise


def main(argv: list[str] | None = None) -> None:
    settings = parse_settings(argv)
    logging.basicConfig(level=settings.log_level,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    app = create_app(settings)
    logger.info("[API] listening on http://%s:%d db=%s auth=%s", settings.host, settings.port,
                settings.db_path, "on" if settings.api_key else "off")
    uvicorn.run(app, host=settings.host, port=settings.port,
                log_level=settings.log_level.lower(), access_log=False)


if __name__ == "__main__":
    main()
