"""`blockspec` command line: the commands, each in its own module of this package, which defines `add_args(parser)`
and `run(args) -> int`. Only the module of the command invoked is imported (so `blockspec --help` stays fast and one
command's heavy dependencies never slow down or break another), and a command module imports nothing heavy (torch,
transformers, the engine) until run(), so `blockspec CMD --help`, a bad flag and a bad input answer in well under a
second. A bad flag prints that command's usage; the inputs (model, drafter, prompt files) are checked before run();
user errors print one line and exit 2."""

from __future__ import annotations

import argparse
import importlib
import sys
from typing import NamedTuple

from blockspec.errors import BlockspecError


class Command(NamedTuple):
    help: str
    module: str  # in blockspec.cli
    extra: str | None = None  # the optional extra it needs (cli/extras.py)


COMMANDS: dict[str, Command] = {
    "generate": Command("generate text from a prompt", "generate"),
    "demo": Command("run the bundled model on a few prompts (offline, CPU)", "demo"),
    "bench": Command("offline throughput: speculative vs plain, alternating warmed runs", "bench"),
    "init-draft": Command("write a randomly initialized DFlash drafter for a target", "init_draft"),
    "export-draft": Command("write a DFlash drafter as a llama.cpp GGUF (llama-server --spec-type draft-dflash)",
                            "export_draft"),
    "serve": Command("OpenAI-compatible HTTP server", "serve", extra="serve"),
    "chat": Command("interactive chat in the terminal, streamed", "chat"),
    "draft-data": Command("build drafter training data: prompts -> target-regenerated token shards", "data"),
    "eval-draft": Command("a drafter's acceptance and speedup on an evaluation set (+ PNG)", "evaluate", extra="eval"),
    "train-draft": Command("train a DFlash drafter for a target (DFlash loss, frozen target taps)", "train"),
}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = argparse.ArgumentParser(prog="blockspec", description="DFlash speculative decoding inference engine")
    sub = parser.add_subparsers(dest="command", required=True)
    chosen = next((a for a in argv if not a.startswith("-")), None)
    module, command_parser = None, parser
    for name, command in COMMANDS.items():
        p = sub.add_parser(name, help=command.help)
        if name == chosen:
            module = importlib.import_module(f"blockspec.cli.{command.module}")
            module.add_args(p)
            command_parser = p
    # A command's parser hands the arguments it does not know up to this one, whose parse_args would report them
    # under the top-level usage; the command's own usage is the one that helps.
    args, unknown = parser.parse_known_args(argv)
    if unknown:
        command_parser.error(f"unrecognized arguments: {' '.join(unknown)}")
    try:
        from blockspec.cli.inputs import check_inputs

        check_inputs(command_parser, args)  # before the command imports or loads anything
        extra = COMMANDS[args.command].extra
        if extra is not None:
            from blockspec.cli.extras import require_extra

            require_extra(args.command, extra)
        return module.run(args)
    except BlockspecError as e:
        print(f"blockspec: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
