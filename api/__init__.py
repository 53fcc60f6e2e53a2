"""The trajectory API: environments post scored groups, the trainer pulls exact-size batches.

    run-api --port 8000 --db-path runs/api.db          # or: python -m api.server ...
    curl -s localhost:8000/status

Wire-compatible with Atropos's API (same paths and JSON fields); state lives in SQLite so a
restart on the same --db-path resumes where the last process stopped. See `api.app.create_app`.
"""
