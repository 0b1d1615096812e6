"""The flag groups the commands share, each flag declared once: the model source, where it runs (--device, --dtype),
the target's speed options, and the sampling, speculative and engine groups, drawn from the fields of LoadConfig,
SamplingParams, SpeculativeConfig and EngineConfig (config_flags.py). Each group has one function from the parsed
flags back to what it configures (sampling_params, load_config, speculative_config, engine_config), and build_llm
puts them together."""

from __future__ import annotations

import argparse
from dataclasses import fields
from typing import TYPE_CHECKING, Any, Iterable

from blockspec.cli.config_flags import add_config_flags, flag_fields, flag_name, flags_given, name_the_flag
from blockspec.config import AUTO, OFF, EngineConfig, SpeculativeConfig
from blockspec.errors import BlockspecError, ConfigError
from blockspec.loading.load_config import LoadConfig  # no torch: the load flags are drawn from its fields
from blockspec.sampling import SamplingParams  # no torch: it imports torch where it samples

if TYPE_CHECKING:
    from blockspec.llm import LLM
    from blockspec.loading.platform import PlatformPlan


def add_model_arg(p: argparse.ArgumentParser, flag: str = "--model", positional: bool = False) -> None:
    """The target: --model (--target for the commands that build or train a drafter for it); `positional`: it may
    also be the first argument (serve, chat)."""
    if positional:
        p.add_argument("model_pos", nargs="?", default=None, metavar="MODEL", help=f"same as {flag}")
    p.add_argument(flag, default=None,
                   help="HF directory, .gguf file or hub id of the target (default: bundled SmolLM2-135M-Instruct)")


def model_source(args: argparse.Namespace) -> str | None:
    """--model, or the positional MODEL of the commands that take one; both, and different, is an error."""
    pos = getattr(args, "model_pos", None)
    if pos is not None and args.model is not None and pos != args.model:
        raise BlockspecError(f"two models given: {pos!r} and --model {args.model!r}; pass one")
    return args.model if args.model is not None else pos


def add_device_args(p: argparse.ArgumentParser, device: str | None = None, dtype: bool = True,
                    dtype_help: str | None = None) -> None:
    """--device (default `device`, else cuda when available) and, unless `dtype` is False, --dtype: LoadConfig's
    fields (loading/load_config.py), worded for the command."""
    add_config_flags(p, LoadConfig, ["device", "dtype"] if dtype else ["device"],
                     device={"default": device, "help": f"cpu | cuda (default: {device or 'cuda when available'})"},
                     **({"dtype": {"help": dtype_help}} if dtype_help else {}))


def add_max_tokens(p: argparse.ArgumentParser, default: int, help: str | None = None) -> None:
    p.add_argument("--max-tokens", type=int, default=default, help=help)


def add_sampling_args(p: argparse.ArgumentParser, filters: bool = True, seed: int | None = None,
                      seed_help: str | None = None) -> None:
    """The flags of the SamplingParams fields that declare one (blockspec/sampling.py): --temperature, --seed (default
    `seed`) and, unless `filters` is False, the filters of the distribution (--top-k, --top-p, --min-p)."""
    add_config_flags(p, SamplingParams, None if filters else ["temperature", "seed"],
                     seed={"default": seed, **({"help": seed_help} if seed_help else {})})


def sampling_params(args: argparse.Namespace, max_tokens: int | None = None) -> SamplingParams:
    """The SamplingParams of the sampling flags the command registered and --max-tokens (or `max_tokens`); a bad
    value raises one line that names its flag."""
    given = {f.name: getattr(args, f.name) for f in flag_fields(SamplingParams) if hasattr(args, f.name)}
    try:
        return SamplingParams(**given, max_tokens=args.max_tokens if max_tokens is None else max_tokens)
    except ConfigError as e:
        raise name_the_flag(e, SamplingParams) from None


def add_speed_args(p: argparse.ArgumentParser, cpu_packed: bool = True, cpu_quant: bool = True) -> None:
    """The target's speed options, LoadConfig's fields: --cpu-packed (unless `cpu_packed` is False), --batch-invariant
    (outputs unchanged) and --cpu-quant (unless `cpu_quant` is False; the quantized model's outputs). The
    drafter's (--cpu-bf16-draft, --draft-vocab-size) are speculative flags."""
    if cpu_packed:
        add_config_flags(p, LoadConfig, ["cpu_packed"])
    if cpu_quant:
        add_cpu_quant_arg(p)
    add_config_flags(p, LoadConfig, ["batch_invariant"])


def add_cpu_quant_arg(p: argparse.ArgumentParser, default: str | None = None) -> None:
    """--cpu-quant auto|q8|q4|off (default `default`; None: LoadConfig's, decided by the model), checked at load
    (one line naming the flag), not by argparse choices (a usage block)."""
    if default is None:
        add_config_flags(p, LoadConfig, ["cpu_quant"])
        return
    help_text = next(f.metadata["help"] for f in flag_fields(LoadConfig) if f.name == "cpu_quant")
    add_config_flags(p, LoadConfig, ["cpu_quant"], cpu_quant={
        "default": default, "help": help_text.split(" Default: ")[0] + f" (default: {default})"})


def load_config(args: argparse.Namespace, **overrides: Any) -> LoadConfig:
    """The LoadConfig of --device, --dtype and the target's speed flags (add_device_args, add_speed_args), as far as
    the command registered them (the rest keep LoadConfig's defaults); overrides: the fields a command decides
    itself (a rank's device, whether the prompts need a tokenizer)."""
    given = {f.name: getattr(args, f.name) for f in fields(LoadConfig) if hasattr(args, f.name)}
    return LoadConfig(**{**given, **overrides})


def add_speculative_args(p: argparse.ArgumentParser, names: Iterable[str] | None = None, skip: Iterable[str] = (),
                         **overrides: dict[str, Any]) -> None:
    """The SpeculativeConfig flags (--draft, --num-draft-tokens, ...): every one, or `names`, less `skip`."""
    add_config_flags(p, SpeculativeConfig, names, skip, **overrides)


def speculative_config(args: argparse.Namespace, draft: str | None = None,
                       report_flags: Iterable[str] = ()) -> SpeculativeConfig | None:
    """The SpeculativeConfig of the drafter (--draft, else `draft`) or of --speculative-method ngram (no drafter),
    and of the speculative flags the command registered. None without either, where any speculative flag given, or
    any of `report_flags` (flags that report on drafting, such as --trace), is an error that names it. The drafting
    options left unset stay None: the platform plan fills them for the device (loading/platform.py), in LLM and
    load_models as in the commands."""
    given = flags_given(args, SpeculativeConfig)
    source = given.pop("draft_model", draft)
    if "ngram_max" in given and given.get("method") != "ngram":
        raise ConfigError("--ngram-max needs --speculative-method ngram", field="ngram_max")
    if source is not None or given.get("method") == "ngram":
        try:
            return SpeculativeConfig(draft_model=source, **given)
        except ConfigError as e:
            raise name_the_flag(e, SpeculativeConfig) from None
    names = [flag_name(f) for f in flag_fields(SpeculativeConfig) if f.name in given]
    names += ["--" + r.replace("_", "-") for r in report_flags if getattr(args, r)]
    if names:
        listed = names[0] if len(names) == 1 else ", ".join(names[:-1]) + " and " + names[-1]
        raise BlockspecError(f"{listed} need{'s' if len(names) == 1 else ''} --draft")
    return None


def add_engine_args(p: argparse.ArgumentParser, names: Iterable[str] | None = None, skip: Iterable[str] = (),
                    **overrides: dict[str, Any]) -> None:
    """The EngineConfig flags (--max-num-seqs, --kv-block-size, ...): every one, or `names`, less `skip`."""
    add_config_flags(p, EngineConfig, names, skip, **overrides)


def add_max_batch_size(p: argparse.ArgumentParser, default: int | None, help: str) -> None:
    """EngineConfig.max_num_seqs as --max-batch-size, the name the offline commands give it."""
    add_engine_args(p, ["max_num_seqs"], max_num_seqs={"flag": "--max-batch-size", "default": default, "help": help})


def engine_config(args: argparse.Namespace) -> dict[str, Any]:
    """The EngineConfig fields the engine flags set, as keyword arguments (LLM, LLM.from_loaded, EngineConfig); the
    fields not set keep EngineConfig's defaults."""
    given = flags_given(args, EngineConfig)
    if "draft_len_schedule" in given:
        given["draft_len_schedule"] = parse_schedule(given["draft_len_schedule"])
    return given


def parse_schedule(text: str) -> dict[int, int] | str | None:
    """"1:15,16:7" -> {1: 15, 16: 7}; "auto" (measured on this machine) and "off" (K throughout, even where the
    drafter carries a table for this device) as they are. The values are checked by EngineConfig."""
    if text.strip() in (AUTO, OFF):
        return text.strip()
    try:
        return {int(b): int(k) for b, k in (item.split(":") for item in text.split(",") if item.strip())}
    except ValueError:
        raise BlockspecError(f"--draft-len-schedule {text!r}: expected auto, off or batch:K pairs separated by "
                             f"commas, e.g. 1:15,16:7,64:3") from None


# Default of --dist-timeout: how long set-up under torchrun waits for every rank to arrive. A flag default, kept here
# rather than in train/launch.py so that `--help` does not import torch.distributed to print it.
DIST_TIMEOUT_S = 300.0


def add_dist_timeout_arg(p: argparse._ActionsContainer, help: str) -> None:
    """--dist-timeout SECONDS (draft-data, train-draft under torchrun); `help` says what waits, the default is
    appended."""
    p.add_argument("--dist-timeout", type=float, default=DIST_TIMEOUT_S, metavar="SECONDS",
                   help=f"{help} (default {DIST_TIMEOUT_S:g})")


def add_llm_args(p: argparse.ArgumentParser) -> None:
    """The model (also as the first argument), drafter and engine flags of serve and chat: what build_llm reads."""
    add_model_arg(p, positional=True)
    add_speculative_args(p)
    add_speed_args(p)
    add_device_args(p)
    add_engine_args(p, skip=["tensor_parallel_size"])  # the server runs on one device


def build_llm(args: argparse.Namespace) -> LLM:
    """The LLM (target, optional drafter, engine) the flags describe; raises BlockspecError for bad flags. The
    command reports it (report_llm) once its own checks of it passed: a refusal stays one line."""
    from blockspec.llm import LLM

    return LLM(model_source(args), load=load_config(args), speculative=speculative_config(args),
               engine=EngineConfig(**engine_config(args)))


def report_plan(plan: PlatformPlan) -> None:
    """One stderr line: what runs the target and its drafter on this machine (loading/platform_report.summary)."""
    import sys

    from blockspec.loading.platform_report import summary

    print(summary(plan), file=sys.stderr)


def report_llm(llm: LLM) -> None:
    """The platform plan's line and the draft length schedule's, on stderr: what every command that runs an LLM says
    once it is built."""
    report_plan(llm.plan)
    report_schedule(llm)


def report_schedule(llm: LLM) -> None:
    """One stderr line: the draft length per batch size the engine runs with, and where it came from."""
    import sys

    if llm.calibration is not None:
        print(llm.calibration.describe(), file=sys.stderr)
    elif llm.engine.proposer is not None:
        schedule = llm.engine.config.draft_len_schedule
        given = ", ".join(f"{b}:{k}" for b, k in sorted(schedule.items())) if schedule else None
        print(f"draft length schedule (batch:K) {given or f'K = {llm.engine.K} throughout'}", file=sys.stderr)
