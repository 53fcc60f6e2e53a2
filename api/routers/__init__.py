"""Routes grouped by caller: `trainer`, `env` (environment registration), `data` (scored groups)."""
