"""The inputs a command names on its command line (the target and drafter sources, prompt files, data paths),
checked in main() before the command imports or loads anything: a missing drafter fails in a fraction of a second
with one line naming --draft, not after the target has loaded. Found by the dest of each argument, so every command
that registers one of these arguments is checked, whatever it calls the flag."""

from __future__ import annotations

import argparse
import os
from pathlib import Path

from blockspec.cli.flags import model_source
from blockspec.errors import BlockspecError
from blockspec.loading.source import check_source

# arguments that name a model source (target or drafter): checked as resolve_source will read them
MODEL_SOURCES = frozenset({"model_pos", "model", "target", "draft_model"})
# arguments that name local paths -> what each path must be. draft-data reads its --prompts before it loads, under
# their own message; train-draft checks its --prompts and --init itself, after the flag combinations they are part of;
# export-draft's --out must be a file whose folder exists
PATHS = {"prompts_file": "file", "eval_prompts": "file", "data": "dir", "out_file": "new file"}


def check_path(value: str, name: str, kind: str) -> None:
    """`value` (of the argument `name`) is an existing file ("file"), directory ("dir") or either ("path"), or a file
    that can be written: not a directory, in a folder that exists ("new file")."""
    p = Path(value).expanduser()
    if kind == "new file":
        if p.is_dir():
            raise BlockspecError(f"{name} {value}: is a directory; give the file to write")
        if not p.parent.is_dir():
            raise BlockspecError(f"{name} {value}: the folder {p.parent} does not exist")
        return
    if not p.exists():
        what = {"file": "file", "dir": "directory", "path": "file or directory"}[kind]
        raise BlockspecError(f"{name} {value}: no such {what}")
    if kind == "file" and not p.is_file():
        raise BlockspecError(f"{name} {value}: not a file")
    if kind == "dir" and not p.is_dir():
        raise BlockspecError(f"{name} {value}: not a directory")


def check_inputs(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Check every model source and path argument `parser` registered and `args` gives; raises BlockspecError
    naming the argument (its first flag, or the metavar of a positional such as MODEL). Not in a rank of a torchrun
    launch: one rank leaving before the rendezvous would leave its peers waiting; the commands there check their
    inputs on every rank and leave together (train/launch.py)."""
    if any(k in os.environ for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK")):
        return
    if hasattr(args, "model_pos"):  # MODEL and a different --model: the first thing wrong, whether either exists
        model_source(args)
    for action in parser._actions:  # argparse has no public list of a parser's arguments
        value = getattr(args, action.dest, None)
        if value is None:
            continue
        name = action.option_strings[0] if action.option_strings else str(action.metavar or action.dest)
        if action.dest in MODEL_SOURCES:
            check_source(value, name)
        elif action.dest in PATHS:
            for v in value if isinstance(value, list) else [value]:
                check_path(v, name, PATHS[action.dest])
