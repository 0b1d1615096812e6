"""The optional extras a command needs (pyproject.toml [project.optional-dependencies]), checked before it runs: a
missing one ends in one line that names the pip command, not in a traceback, and not after a long evaluation."""

from __future__ import annotations

import importlib

from blockspec.errors import BlockspecError

# extra -> the modules of its packages (each package's import name is its name; tests/test_cli_flags.py holds this
# table to pyproject.toml)
EXTRAS: dict[str, tuple[str, ...]] = {"serve": ("fastapi", "uvicorn", "pydantic", "prometheus_client"),
                                      "eval": ("matplotlib",)}


def require_extra(command: str, extra: str) -> None:
    missing = []
    for module in EXTRAS[extra]:
        try:
            importlib.import_module(module)
        except ModuleNotFoundError as e:  # the package, or one it needs: reinstalling the extra brings both
            missing.append(e.name or module)
    if missing:
        raise BlockspecError(f"`blockspec {command}` needs the '{extra}' extra ({', '.join(missing)} not installed): "
                             f"pip install 'blockspec[{extra}]'")
