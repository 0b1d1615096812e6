"""The platform plan: what runs a target (and its drafter) on this machine, and why, decided in this one module.

The device, the load flags and the speculative config select among variants that used to be chosen in about nine
places: the target's linears (the native q4 stack, native q4 / q8 linears, torch's int4 / int8 kernels, oneDNN-packed,
batch-invariant, plain), the target attention (attention/backends.backend_name), the drafter's (native Q8, bf16 or
own-dtype oneDNN-packed, plain) and the CPU's drafting defaults (full-block drafting, a bf16 drafter). `plan()`
decides what it can before any weight is read and refuses what cannot run (one line naming the flag);
`PlatformPlan.at_load(model)` decides what needs the built target (the native stack runs dense family layers only),
`drafter_variant` what needs the built drafter, and `with_drafter` records it. Loading (prepare_target, load_draft),
LLM, the CLI and the demo read the one record; loading/platform_report.py words it (the commands' stderr line,
`generate --explain`)."""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
from torch import nn

from blockspec.attention.backends import backend_name
from blockspec.config import SpeculativeConfig
from blockspec.errors import BlockspecError, ConfigError
from blockspec.layers import cpu_packed, cpu_quant, kernels
from blockspec.loading.capabilities import graph_refusal
from blockspec.loading.load_config import LoadConfig
from blockspec.loading.source import resolve_source
from blockspec.models.config import parse_dtype
from blockspec.native import lib

# the target's linears
NATIVE_STACK = "native q4 stack"  # every layer in one native call per forward (loading/native_stack.py)
NATIVE_Q4 = "native q4 linears"  # each linear on the native Q4 x Q8 kernel, the layers in torch
TORCH_INT4 = "torch int4"  # aten._weight_int4pack_mm_for_cpu, where the native kernels do not build
NATIVE_Q8 = "native q8 linears"
TORCH_INT8 = "torch int8"
PACKED = "oneDNN packed"
INVARIANT = "batch-invariant"
PLAIN = "plain"
# the drafter's
DRAFT_NATIVE = "native Q8"  # native/draft.c (loading/native_stack.NativeDraft), under a target on the native stack
DRAFT_BF16 = "bf16 packed"
DRAFT_PACKED = "packed"  # oneDNN-packed in the target's dtype, beside a packed target
DRAFT_PLAIN = "plain"
DRAFT_NGRAM = "n-gram lookup"
DRAFT_MODEL = "draft model"
NO_DRAFTER = "none"
# the native kernels' instruction set path (lib.best_path(): 3 AMX, 2 VNNI, 1 AVX2, 0 scalar; the same bits on each)
ISA = {3: "AMX", 2: "AVX512-VNNI", 1: "AVX2", 0: "scalar"}
NOT_BUILT, NOT_USED = "not built", "not used"
DFLASH_ARCHITECTURES = frozenset({"DFlashDraftModel", "DFlash2DraftModel"})  # loading/draft_loader.py's


@dataclass(frozen=True)
class PlatformPlan:
    """What runs, decided once. Defaults: a plain target on the CPU with no drafter (a model built in memory)."""

    device: str = "cpu"  # where the models run: cpu | cuda | cuda:N
    dtype: str = "float32"  # the target's
    target: str = PLAIN  # its linears: NATIVE_STACK, NATIVE_Q4, TORCH_INT4, NATIVE_Q8, TORCH_INT8, PACKED, ...
    cpu_quant: str = "off"  # q4 | q8 | off (never auto: resolved here)
    cpu_packed: bool = False  # the linears no quantized kernel takes are oneDNN-packed
    batch_invariant: bool = False
    attention: str = "torch"  # the target attention: torch | triton | rowwise | invariant (backends.backend_name)
    method: str | None = None  # dflash | ngram | draft-model; None: no speculation
    drafter: str = NO_DRAFTER  # DRAFT_NATIVE, DRAFT_BF16, DRAFT_PACKED, DRAFT_PLAIN, DRAFT_NGRAM, DRAFT_MODEL
    full_block_drafting: bool = False
    cpu_bf16_draft: bool = False
    native: str = NOT_USED  # the native kernels' ISA path, NOT_BUILT, or NOT_USED (nothing asked for them)
    tensor_parallel_size: int = 1
    cuda_graphs: bool = True  # whether the decode step may be captured (False: eager, graph_refusal says why)
    reasons: tuple[str, ...] = ()  # why each fallback or default happened, in the order decided
    # the speculative config with the drafting options the user left unset filled for this platform (None: none)
    speculative: SpeculativeConfig | None = None

    @property
    def row_invariant(self) -> bool:
        """Whether the attention must compute each decode / verify row as a one-row step would: the quantized
        kernels round activations to bf16, which turns CPU SDPA's ulp-level row differences into flipped tokens."""
        return self.cpu_quant != "off"

    def at_load(self, model: nn.Module) -> PlatformPlan:
        """This plan completed for the built, quantized target: whether the native stack runs it, and why not."""
        if self.target != NATIVE_Q4:
            return self
        from blockspec.loading.native_stack import target_fallback

        why = target_fallback(model)
        if why is None:
            return replace(self, target=NATIVE_STACK)
        return self._because(f"q4 requested: native stack not used: {why}; its linears run on the native kernel")

    def with_graphs(self, model: nn.Module) -> PlatformPlan:
        """This plan with the decode step eager on CUDA where the prepared target cannot be captured in a CUDA graph
        (graph_refusal): the engine runs it eagerly (same results, slower) rather than failing inside the capture."""
        why = graph_refusal(model) if self.device.startswith("cuda") else None
        if why is None:
            return self
        return replace(self, cuda_graphs=False)._because(f"CUDA graphs off: {why}")

    def with_drafter(self, method: str | None, drafter: str, full_block_drafting: bool = False,
                     cpu_bf16_draft: bool = False, reasons: tuple[str, ...] = ()) -> PlatformPlan:
        """This (target) plan with the drafter that loaded beside it."""
        return replace(self, method=method, drafter=drafter, full_block_drafting=full_block_drafting,
                       cpu_bf16_draft=cpu_bf16_draft, reasons=self.reasons + tuple(reasons))

    def with_proposer(self, draft: object) -> PlatformPlan:
        """This (target) plan with the proposer that loaded beside it: None, a LoadedDraft or any Proposer (read by
        its attributes: speculative/ sits above loading/). A DFlash drafter says what runs it (LoadedDraft.variant,
        platform.drafter_variant); other methods are named by the proposer."""
        if draft is None:
            return self.with_drafter(None, NO_DRAFTER)
        loaded = getattr(draft, "draft", draft)  # DFlashProposer.draft: its LoadedDraft
        variant = getattr(loaded, "variant", None)
        if variant is not None:
            return self.with_drafter("dflash", variant, loaded.spec.full_block_drafting, variant == DRAFT_BF16,
                                     loaded.reasons)
        name = getattr(draft, "name", type(draft).__name__)
        named = {"ngram": DRAFT_NGRAM, "draft-model": DRAFT_MODEL + (" (oneDNN packed)" if self.cpu_packed else "")}
        return self.with_drafter(name, named.get(name, name))

    def _because(self, reason: str) -> PlatformPlan:
        return replace(self, reasons=self.reasons + (reason,))


def resolve_device(device: str | None) -> torch.device:
    if device is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        dev = torch.device(device)
    except RuntimeError:
        raise BlockspecError(f"unknown device {device!r}; expected 'cpu' or 'cuda' (optionally 'cuda:N')") from None
    if dev.type not in ("cpu", "cuda"):
        raise BlockspecError(f"unsupported device {device!r}; expected 'cpu' or 'cuda'")
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise BlockspecError(f"device {device!r} requested but CUDA is not available on this machine")
    return dev


def resolve_dtype(dtype: str | None, device: torch.device) -> torch.dtype:
    if dtype is None:
        # fp32 on CPU: exact and fast enough for small models; bf16 on GPU.
        return torch.float32 if device.type == "cpu" else torch.bfloat16
    return parse_dtype(dtype)


def native_status() -> tuple[str, str | None]:
    """(the ISA path blockspec's native kernels run here, or NOT_BUILT; why they are not built, else None). Builds
    them on first use (a few seconds, then cached: native/build.py)."""
    if lib.library() is None:
        return NOT_BUILT, f"native kernels not built: {lib.unavailable_reason()}"
    return ISA.get(lib.best_path(), "scalar"), None


def cpu_model() -> str:
    """The CPU's model name (/proc/cpuinfo), "cpu" where it is not readable: what a cost table holds for."""
    try:
        with open("/proc/cpuinfo") as f:
            return next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), "cpu")
    except OSError:
        return "cpu"


def plan(load: LoadConfig, speculative: SpeculativeConfig | dict | None = None, *, tensor_parallel_size: int = 1,
         attention_backend: str = "auto") -> PlatformPlan:
    """What runs `load` (and `speculative`) on this machine, as far as it is known before any weight is read;
    raises, naming the flag, for what cannot run here. The device is load.device's (None: cuda when available)."""
    if isinstance(speculative, dict):
        speculative = SpeculativeConfig(**speculative)
    if load.cpu_quant is None:  # left unset and not decided by the model (loading/quant_default.py): as loaded
        load = replace(load, cpu_quant="off")
    if tensor_parallel_size > 1:
        _refuse_sharding(load, speculative)
    device = resolve_device(load.device)
    dtype = resolve_dtype(load.dtype, device)
    mode = cpu_quant.resolve(load.cpu_quant, device)  # an unknown mode is refused first
    native, native_why = native_status() if device.type == "cpu" and load.cpu_quant != "off" else (NOT_USED, None)
    _check(load, mode, device, dtype)
    reasons = []
    if load.cpu_quant == "auto":
        reasons.append(f"cpu_quant auto: {mode}" + (" (the fastest kernel this CPU runs)" if mode != "off" else
                                                    " (no vectorized quantized kernel for this device)"))
    if native_why is not None:
        reasons.append(native_why + (f": {mode} runs on torch's kernel" if mode != "off" else ""))
    target = _target(mode, load, native != NOT_BUILT and native != NOT_USED)
    attention = backend_name(attention_backend, device, load.batch_invariant, mode != "off")
    out = PlatformPlan(str(device), str(dtype).removeprefix("torch."), target, mode, load.cpu_packed,
                       load.batch_invariant, attention, native=native, tensor_parallel_size=tensor_parallel_size,
                       reasons=tuple(reasons))
    return _drafting(out, speculative, load, device) if speculative is not None else out


def _target(mode: str, load: LoadConfig, native: bool) -> str:
    if mode == "q4":
        return NATIVE_Q4 if native else TORCH_INT4  # the stack is decided at load (PlatformPlan.at_load)
    if mode == "q8":
        return NATIVE_Q8 if native else TORCH_INT8
    return PACKED if load.cpu_packed else INVARIANT if load.batch_invariant else PLAIN


def _drafting(p: PlatformPlan, spec: SpeculativeConfig, load: LoadConfig, device: torch.device) -> PlatformPlan:
    """The drafting defaults: on the CPU a DFlash drafter's speed options the user left unset take the demo's
    measured settings (docs/performance.md): full-block drafting (with the K the calibration picks, below
    block_size - 1, the drafts of the block shape the drafter was trained on are accepted more often, and 16 draft
    rows cost little next to verifying), the draft vocabulary the drafter names for the CPU (cpu_draft_vocab) and,
    where the CPU has bf16 units, the drafter in bf16 (a cheaper draft pass; the target still verifies in its own
    dtype, so outputs do not change). Other devices and methods keep the config's own."""
    method = draft_method(spec)
    changes: dict[str, object] = {}
    if device.type == "cpu" and method == "dflash":
        if spec.full_block_drafting is None:
            changes["full_block_drafting"] = True
        vocab = cpu_draft_vocab(spec)
        if vocab is not None:
            changes["draft_vocab_size"] = vocab
        if (spec.cpu_bf16_draft is None and p.tensor_parallel_size == 1 and load.dtype in (None, "float32")
                and cpu_packed.bf16_supported(device)):
            changes["cpu_bf16_draft"] = True
    filled = replace(spec, **changes)
    words = {"full_block_drafting": "full-block drafting: the CPU default for a DFlash drafter (full_block_drafting "
                                    "unset)",
             "cpu_bf16_draft": "drafter in bf16: the default on a CPU with bf16 units (cpu_bf16_draft unset)",
             "draft_vocab_size": f"argmax drafts over ids < {changes.get('draft_vocab_size')}: the drafter's own "
                                 f"{CPU_DRAFT_VOCAB_KEY} for the CPU (draft_vocab_size unset)"}
    reasons = [words[name] for name in changes]
    p = replace(p, speculative=filled, reasons=p.reasons + tuple(reasons))
    if method != "dflash":
        return p.with_proposer(_Named(method))
    bf16 = bool(filled.cpu_bf16_draft)
    # expected until load_draft decides (drafter_variant): the native drafter goes with the native stack
    expected = (DRAFT_NATIVE if p.target == NATIVE_Q4 else DRAFT_BF16 if bf16 else DRAFT_PACKED if p.cpu_packed
                else DRAFT_PLAIN)
    return p.with_drafter(method, expected, bool(filled.full_block_drafting), bf16)


@dataclass(frozen=True)
class _Named:
    """A proposer not loaded yet, by its method's name (PlatformPlan.with_proposer reads the name)."""

    name: str


# A drafter's config.json may name the draft vocabulary it drafts over on the CPU (ids below it): its head pass is the
# spec step's largest weight read after the target's, and a vocabulary whose ids are ordered by frequency (SmolLM2's
# BPE: ids < 24,576 are 98.6 % of the demo's output tokens) loses almost no accepted draft to a cut. Lossless either
# way: the target verifies, only drafts of rarer ids are never made. The bundled drafter names one.
CPU_DRAFT_VOCAB_KEY = "cpu_draft_vocab_size"


def cpu_draft_vocab(spec: SpeculativeConfig) -> int | None:
    """The drafter's own CPU draft vocabulary where the user left draft_vocab_size unset and drafts by argmax."""
    if spec.draft_vocab_size is not None or spec.probabilistic_drafting or spec.draft_model is None:
        return None
    value = resolve_source(spec.draft_model).config.get(CPU_DRAFT_VOCAB_KEY)
    return int(value) if isinstance(value, int) and value > 0 else None


def draft_method(spec: SpeculativeConfig) -> str:
    """The method asked for, or the one the draft checkpoint implies: a DFlash drafter or a plain causal LM (as
    speculative/registry.method_of decides it)."""
    if spec.method is not None:
        return spec.method
    archs = resolve_source(spec.draft_model).config.get("architectures") or []
    return "dflash" if DFLASH_ARCHITECTURES & set(archs) else "draft-model"


def drafter_variant(target: PlatformPlan, cpu_bf16_draft: bool, native_why: str | None) -> tuple[str, tuple[str, ...]]:
    """The DFlash drafter's variant beside a loaded target (load_draft): the native drafter where it runs this drafter
    under this target (native_why None: loading/native_stack.draft_fallback), else packed in bf16
    (cpu_bf16_draft), packed in the target's dtype beside a packed target, or plain; and why the native drafter was
    not used beside a target on the native stack."""
    if native_why is None:
        return DRAFT_NATIVE, ()
    why = (f"drafter: native Q8 not used: {native_why}",) if target.target == NATIVE_STACK else ()
    if cpu_bf16_draft:
        return DRAFT_BF16, why
    return (DRAFT_PACKED if target.cpu_packed else DRAFT_PLAIN), why


def check_cpu_bf16_draft(device: torch.device) -> str | None:
    """Why a bf16 drafter (cpu_bf16_draft=True) cannot run beside a target on `device`, else None."""
    if device.type != "cpu":
        return f"cpu_bf16_draft=True needs the target on the CPU, but it is on {device}"
    if not cpu_packed.bf16_supported(device):
        return ("cpu_bf16_draft=True needs a CPU with oneDNN bf16 kernels (AVX512-BF16 or AMX); this one has none: "
                "leave cpu_bf16_draft off")
    return None


def _check(load: LoadConfig, mode: str, device: torch.device, dtype: torch.dtype) -> None:
    """Refuse what this platform cannot run, before any weight is read (cpu_quant resolved already)."""
    if load.cpu_packed:
        if not cpu_packed.fp32_supported(device):
            where = (f"the model is on {device}" if device.type != "cpu"
                     else "this torch build cannot pack linears for oneDNN (mkldnn)")
            raise BlockspecError(f"cpu_packed=True (--cpu-packed) needs a CPU with oneDNN, but {where}")
        bf16_ok = dtype == torch.bfloat16 and cpu_packed.bf16_supported(device)
        if dtype != torch.float32 and not bf16_ok:
            raise BlockspecError(f"cpu_packed=True (--cpu-packed) packs fp32 weights (bf16 on CPUs with bf16 "
                                 f"kernels), not {dtype}")
    if mode != "off" and not cpu_quant.supported(mode, device):
        where = (f"the model is on {device}" if device.type != "cpu"
                 else "this CPU or torch build has no vectorized kernel for it")
        raise BlockspecError(f"cpu_quant={mode!r} (--cpu-quant) runs torch's CPU quantized matmuls, but {where}; "
                             f"use --cpu-quant auto or off")
    if load.batch_invariant:
        if load.cpu_packed or mode != "off":
            flag = "cpu_packed=True (--cpu-packed)" if load.cpu_packed else f"cpu_quant={mode!r} (--cpu-quant)"
            raise BlockspecError(f"batch_invariant=True (--batch-invariant) and {flag} exclude each other")
        if not kernels.fused_device(device):
            raise BlockspecError(f"batch_invariant=True (--batch-invariant) runs Triton kernels and needs a CUDA "
                                 f"device, got {device.type!r} (fp32 on CPU is the exactness reference instead)")


def _refuse_sharding(load: LoadConfig, spec: SpeculativeConfig | None) -> None:
    """Tensor parallelism shards nn.Linear weights: the platform variants that replace them cannot be sharded."""
    if load.cpu_packed:
        raise ConfigError("cpu_packed=True is not supported with tensor_parallel_size > 1 (packed linears cannot be "
                          "sharded)")
    if load.cpu_quant != "off":
        raise ConfigError(f"cpu_quant={load.cpu_quant!r} is not supported with tensor_parallel_size > 1 (quantized "
                          f"linears cannot be sharded)", field="cpu_quant")
    if load.batch_invariant:
        raise ConfigError("batch_invariant=True is not supported with tensor_parallel_size > 1 (the sharded linears "
                          "and all-reduces are not batch-invariant)")
    if spec is not None and draft_method(spec) != "dflash":
        raise ConfigError(f"speculative method {draft_method(spec)!r} is not supported with tensor_parallel_size > 1 "
                          f"(only 'dflash' drafters are sharded)", field="method")
    if spec is not None and spec.cpu_bf16_draft:
        raise ConfigError("cpu_bf16_draft=True is not supported with tensor_parallel_size > 1 (the packed bf16 "
                          "drafter cannot be sharded)")
