"""LoadConfig: how a target is loaded (where it runs, in which dtype, the platform variant of its linears). Its
fields carry their flag help, as SpeculativeConfig's and EngineConfig's do, so the commands draw --device, --dtype,
--cpu-packed, --cpu-quant and --batch-invariant from them (cli/flags.py). No torch here: `--help` builds these
flags without importing it."""

from __future__ import annotations

from dataclasses import dataclass, field

DTYPES = ("float32", "bfloat16", "float16")
CPU_QUANT_MODES = ("auto", "q8", "q4", "off")


@dataclass(frozen=True)
class LoadConfig:
    """How load_model builds a target. One record, handed whole by the commands, the LLM facade, the tensor-parallel
    ranks and the draft-model load (speculative/registry.py), so that a new load option is added here and not at
    every call on the way. What it means on this machine (the variant that runs, and why) is the platform plan's
    (loading/platform.py)."""

    # None: cuda when available, else cpu
    device: str | None = field(default=None, metadata={"help": "cpu | cuda (default: cuda when available)"})
    # None: float32 on CPU, bfloat16 on GPU (platform.resolve_dtype)
    dtype: str | None = field(default=None, metadata={
        "choices": list(DTYPES), "help": "float32 | bfloat16 | float16 (default: float32 on CPU, bfloat16 on GPU)"})
    # CPU: every linear packed once for oneDNN in its own dtype (the drafter follows)
    cpu_packed: bool = field(default=False, metadata={
        "help": "CPU: pack the target's (and the drafter's) linears once for oneDNN, in their own dtype (plain and "
                "verify steps read the weights faster; a verify step of K + 1 rows costs about a 1-row one)"})
    # auto | q8 | q4 | off: CPU linears on packed int8 / int4 weights; auto resolved by the platform plan. None: auto
    # for a quantized GGUF target on the CPU, else off (loading/quant_default.py; the platform plan reads None as
    # off). Checked at load (one line naming the flag), not by argparse choices (a usage block)
    cpu_quant: str | None = field(default=None, metadata={
        "metavar": "|".join(CPU_QUANT_MODES),
        "help": "CPU: the target's linears on packed int8 (q8) / int4 (q4) weights, computed in the kernel, with "
                "int8 / bf16 activations into them; auto: the fastest this CPU runs; off: the weights as loaded "
                "(dequantized to --dtype). Default: auto for a quantized GGUF target on the CPU, else off. Outputs "
                "are the quantized model's (docs/performance.md)"})
    # GPU: GEMMs and attention computed per row independently of the batch
    batch_invariant: bool = field(default=False, metadata={
        "help": "GPU: the target's GEMMs and attention computed the same way whatever the batch, so greedy "
                "speculative output equals plain decoding token for token in bf16 too (slower GEMMs)"})
    # False: no tokenizer read (drafters, token-id-only tests and benchmarks); no flag: the command decides
    with_tokenizer: bool = True
