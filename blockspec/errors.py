"""User-facing errors: the CLI prints their message (no traceback) and exits with status 2."""

from __future__ import annotations


class BlockspecError(Exception):
    """Bad input from the user (a file, a field, a value); the message says which and why."""


class ModelLoadError(BlockspecError):
    """A model source could not be resolved or its config/weights are unusable."""


class ConfigError(BlockspecError):
    """A configuration field has an invalid value. `field` names it (e.g. "top_p") where one field is to blame, so
    callers such as the server can point at it without reading the message."""

    def __init__(self, message: str, field: str | None = None) -> None:
        super().__init__(message)
        self.field = field
