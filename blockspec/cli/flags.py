"""The flag groups the commands share, each flag declared once: the model source, where it runs (--device, --dtype),
the target's speed options, and the sampling, speculative and engine groups, drawn from the fields of SamplingParams,
SpeculativeConfig and EngineConfig (config_flags.py). Each group has one function from the parsed flags back to what
it configures (sampling_params, load_config, speculative_config, engine_config), and build_llm puts them
together."""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING, Any, Iterable

from blockspec.cli.config_flags import add_config_flags, flag_fields, flag_name, flags_given, name_the_flag
from blockspec.config import AUTO, OFF, EngineConfig, SpeculativeConfig
from blockspec.errors import BlockspecError, ConfigError
from blockspec.sampling import SamplingParams  # no torch: it imports torch where it samples

if TYPE_CHECKING:
    from blockspec.llm import LLM
    from blockspec.loading.loader import LoadConfig


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
    """--device (default `device`, else cuda when available) and, unless `dtype` is False, --dtype."""
    p.add_argument("--device", default=device, help=f"cpu | cuda (default: {device or 'cuda when available'})")
    if dtype:
        p.add_argument("--dtype", default=None, choices=["float32", "bfloat16", "float16"], help=dtype_help)


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
    """The target's speed options: --cpu-packed (unless `cpu_packed` is False), --batch-invariant (outputs
    unchanged) and --cpu-quant (unless `cpu_quant` is False; the quantized model's outputs). The
    drafter's (--cpu-bf16-draft, --draft-vocab-size) are speculative flags."""
    if cpu_packed:
        p.add_argument("--cpu-packed", action="store_true",
                       help="CPU: pack the target's (and the drafter's) linears once for oneDNN, in their own dtype "
                            "(plain and verify steps read the weights faster; a verify step of K + 1 rows costs about "
                            "a 1-row one)")
    if cpu_quant:
        add_cpu_quant_arg(p)
    p.add_argument("--batch-invariant", action="store_true",
                   help="GPU: the target's GEMMs and attention computed the same way whatever the batch, so greedy "
                        "speculative output equals plain decoding token for token in bf16 too (slower GEMMs)")


def add_cpu_quant_arg(p: argparse.ArgumentParser, default: str = "off") -> None:
    """--cpu-quant auto|q8|q4|off, checked at load (one line naming the flag), not by argparse choices (a usage
    block)."""
    p.add_argument("--cpu-quant", default=default, metavar="auto|q8|q4|off",
                   help=f"CPU: the target's linears on packed int8 (q8) / int4 (q4) weights, dequantized inside the "
                        f"kernel, with bf16 activations into them; auto: the fastest this CPU runs; off: as loaded "
                        f"(default: {default}). Outputs are the quantized model's (docs/perf.md)")


def load_config(args: argparse.Namespace, **overrides: Any) -> LoadConfig:
    """The LoadConfig of --device, --dtype and the target's speed flags (add_device_args, add_speed_args), as far as
    the command registered them (the rest keep LoadConfig's defaults); overrides: the fields a command decides
    itself (a rank's device, whether the prompts need a tokenizer)."""
    from dataclasses import fields

    from blockspec.loading.loader import LoadConfig  # torch: imported when a command runs, not for --help

    given = {f.name: getattr(args, f.name) for f in fields(LoadConfig) if hasattr(args, f.name)}
    return LoadConfig(**{**given, **overrides})


def add_speculative_args(p: argparse.ArgumentParser, names: Iterable[str] | None = None, skip: Iterable[str] = (),
                         **overrides: dict[str, Any]) -> None:
    """The SpeculativeConfig flags (--draft, --num-draft-tokens, ...): every one, or `names`, less `skip`."""
    add_config_flags(p, SpeculativeConfig, names, skip, **overrides)


def speculative_config(args: argparse.Namespace, draft: str | None = None, report_flags: Iterable[str] = (),
                       device_defaults: bool = False) -> SpeculativeConfig | None:
    """The SpeculativeConfig of the drafter (--draft, else `draft`) or of --speculative-method ngram (no drafter),
    and of the speculative flags the command registered. None without either, where any speculative flag given, or
    any of `report_flags` (flags that report on drafting, such as --trace), is an error that names it.
    device_defaults: the commands that serve one user or many (generate, chat, serve, bench) fill the drafter's speed
    options left unset for the device (cpu_draft_defaults)."""
    given = flags_given(args, SpeculativeConfig)
    source = given.pop("draft_model", draft)
    if "ngram_max" in given and given.get("method") != "ngram":
        raise ConfigError("--ngram-max needs --speculative-method ngram", field="ngram_max")
    if source is not None or given.get("method") == "ngram":
        try:
            spec = SpeculativeConfig(draft_model=source, **given)
        except ConfigError as e:
            raise name_the_flag(e, SpeculativeConfig) from None
        return cpu_draft_defaults(spec, args) if device_defaults else spec
    names = [flag_name(f) for f in flag_fields(SpeculativeConfig) if f.name in given]
    names += ["--" + r.replace("_", "-") for r in report_flags if getattr(args, r)]
    if names:
        listed = names[0] if len(names) == 1 else ", ".join(names[:-1]) + " and " + names[-1]
        raise BlockspecError(f"{listed} need{'s' if len(names) == 1 else ''} --draft")
    return None


def cpu_draft_defaults(spec: SpeculativeConfig, args: argparse.Namespace) -> SpeculativeConfig:
    """On the CPU, a DFlash drafter's speed options the user left unset take the demo's measured settings
    (docs/perf.md): full-block drafting (with the K the calibration picks, below block_size - 1, the drafts of the
    block shape the drafter was trained on are accepted more often, and 16 draft rows cost little next to verifying)
    and, where the CPU has bf16 units, the drafter in bf16 (a cheaper draft pass; the target still verifies in its
    own dtype, so outputs do not change). Other devices and methods keep the config's own defaults."""
    from dataclasses import replace

    from blockspec.layers import cpu_packed
    from blockspec.loading.loader import resolve_device
    from blockspec.speculative.registry import method_of

    device = resolve_device(args.device)
    if device.type != "cpu" or spec.method in ("ngram", "draft-model") or method_of(spec) != "dflash":
        return spec
    changes: dict[str, bool] = {}
    if spec.full_block_drafting is None:
        changes["full_block_drafting"] = True
    if (spec.cpu_bf16_draft is None and getattr(args, "tensor_parallel_size", 1) == 1
            and getattr(args, "dtype", None) in (None, "float32") and cpu_packed.bf16_supported(device)):
        changes["cpu_bf16_draft"] = True
    return replace(spec, **changes)


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
    """The LLM (target, optional drafter, engine) the flags describe; raises BlockspecError for bad flags. With a
    drafter, the draft length schedule it runs with is reported on stderr (measured on this machine unless given)."""
    from blockspec.llm import LLM

    llm = LLM(model_source(args), speculative_config(args, device_defaults=True), device=args.device,
              dtype=args.dtype, cpu_packed=args.cpu_packed, batch_invariant=args.batch_invariant,
              cpu_quant=args.cpu_quant, **engine_config(args))
    report_schedule(llm)
    return llm


def report_schedule(llm: LLM) -> None:
    """One stderr line: the draft length per batch size the engine runs with, and where it came from."""
    import sys

    if llm.calibration is not None:
        print(llm.calibration.describe(), file=sys.stderr)
    elif llm.engine.proposer is not None:
        schedule = llm.engine.config.draft_len_schedule
        given = ", ".join(f"{b}:{k}" for b, k in sorted(schedule.items())) if schedule else None
        print(f"draft length schedule (batch:K) {given or f'K = {llm.engine.K} throughout'}", file=sys.stderr)
