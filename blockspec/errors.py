"""User-facing errors: the CLI prints their message (no traceback) and exits with status 2."""


class BlockspecError(Exception):
    """Bad input from the user (a file, a field, a value); the message says which and why."""


class ModelLoadError(BlockspecError):
    """A model source could not be resolved or its config/weights are unusable."""


class ConfigError(BlockspecError):
    """A configuration field has an invalid value."""
