"""The configs the CLI builds its flags from (without importing torch): SpeculativeConfig (DFlash, n-gram lookup, a
classic draft model), the fields users of other engines know, validated when built, and EngineConfig. A field that
one method alone reads says so (metadata "methods"); the method resolves it against its checkpoint and the target on
its own side (DFlash: loading/dflash_options.py)."""

from __future__ import annotations

from dataclasses import dataclass, field, fields

from blockspec.errors import ConfigError

METHODS = ("dflash", "ngram", "draft-model")
# How a refusal names the methods a field is for (field metadata "methods"): "method 'ngram'" unless listed here
METHOD_READERS = {"dflash": "DFlash drafters"}
DEFAULT_NGRAM_MAX = 3
DEFAULT_NGRAM_DRAFT_TOKENS = 5  # K without a drafter's block size to derive it from
AUTO = "auto"  # EngineConfig.draft_len_schedule: measured on this machine (engine/calibrate.py)
OFF = "off"  # EngineConfig.draft_len_schedule: K throughout, even where the drafter carries a table


def default_draft_len_schedule(num_draft_tokens: int | None) -> str:
    """The schedule a command (or LLM) runs when none is given: an explicit K means K throughout (OFF), as in vLLM
    and SGLang; without one, AUTO (calibrated here, re-picked from the live acceptance)."""
    return OFF if num_draft_tokens is not None else AUTO
STEP_PATHS = ("auto", "varlen")  # EngineConfig.step_path


def _readers(methods: tuple[str, ...]) -> str:
    return " and ".join(METHOD_READERS.get(m, f"method {m!r}") for m in methods)


@dataclass
class SpeculativeConfig:
    # metadata "methods": the only methods that read the field; set (not None / False) with another method, it is an
    # error that names it. The root config knows which fields are whose, not what a method makes of them.
    draft_model: str | None = field(default=None, metadata={
        "flag": "--draft", "help": "draft checkpoint (directory or hub id): a DFlash drafter, or with "
                                   "--speculative-method draft-model a small causal LM with the target's tokenizer"})
    # None: "dflash" when draft_model is a DFlash checkpoint, "draft-model" when it is a plain causal LM
    method: str | None = field(default=None, metadata={
        "flag": "--speculative-method", "choices": list(METHODS),
        "help": "dflash (block-diffusion drafter), ngram (prompt lookup, no --draft) or draft-model (a classic "
                "autoregressive draft model); default: from the --draft checkpoint"})
    ngram_max: int | None = field(default=None, metadata={
        "methods": ("ngram",), "metavar": "N",
        "help": f"ngram: match the last n <= N tokens (default {DEFAULT_NGRAM_MAX})"})
    num_draft_tokens: int | None = field(default=None, metadata={
        "help": "K drafts per block, K throughout unless --draft-len-schedule is given too (then the most it may "
                "choose); default: block_size - 1 as that most, the draft length picked as generation goes "
                "(--draft-len-schedule auto)"})
    # None -> the draft's dflash_config, then its top level (loading/dflash_options.py)
    mask_token_id: int | None = field(default=None, metadata={"methods": ("dflash",)})
    target_layer_ids: list[int] | None = field(default=None, metadata={"methods": ("dflash",)})
    probabilistic_drafting: bool = field(default=False, metadata={
        "methods": ("dflash",),
        "help": "sample drafts from the draft distribution and use p/q rejection (default: argmax drafts)"})
    # draft every block with the drafter's trained block size and verify the first K drafts: with K + 1 below the
    # block size, the drafts of the block shape it was trained on (better accepted), at block_size draft rows per step.
    # None (unset): the platform plan decides (loading/platform.py: on for a DFlash drafter on the CPU, in LLM and the
    # commands alike); off where a drafter is loaded directly (load_draft)
    full_block_drafting: bool | None = field(default=None, metadata={
        "methods": ("dflash",),
        "help": "draft with the drafter's trained block size and verify the first K drafts (pays when K + 1 is below "
                "the block size and drafting is cheap next to verifying; default: on for the CPU)"})
    # CPU only: run the drafter, and its pass over the target's lm_head, in bf16 on weights packed once for oneDNN
    # (blockspec/layers/cpu_packed.py). The target still verifies every draft in its own dtype: outputs are those of
    # plain decoding; only the drafts (acceptance) may differ. None (unset): the platform plan turns it on where the
    # CPU has bf16 units (loading/platform.py). Under a target on the native q4 stack the native drafter
    # (native/draft.c through loading/native_stack.py) runs instead.
    cpu_bf16_draft: bool | None = field(default=None, metadata={
        "methods": ("dflash",),
        "help": "CPU: run the drafter in bf16 on weights packed once for oneDNN (needs AVX512-BF16 or AMX); the "
                "target still verifies every draft in its own dtype, so outputs do not change (default: on where "
                "the CPU has them; a q4 target on the native kernels drafts on them instead, in Q8_0)"})
    # argmax drafts over token ids < N only (a smaller draft head: BPE ids are roughly frequency-ordered, so the
    # first ids cover most output tokens). Lossless: the target still verifies; drafts of ids >= N are never made.
    # None: the whole vocabulary. Argmax drafting only.
    draft_vocab_size: int | None = field(default=None, metadata={
        "methods": ("dflash",), "metavar": "N",
        "help": "argmax drafts over token ids < N only (a smaller draft head; outputs do not change)"})

    def __post_init__(self) -> None:
        if self.method is not None and self.method not in METHODS:
            raise ConfigError(f"speculative method={self.method!r} is not supported (supported: "
                              f"{', '.join(METHODS)})", field="method")
        if self.method == "ngram":
            if self.draft_model:
                raise ConfigError(f"draft_model={self.draft_model!r} does not go with method='ngram' (prompt lookup "
                                  f"has no draft model): drop it, or pick method 'dflash' or 'draft-model'",
                                  field="draft_model")
        elif not self.draft_model:
            raise ConfigError(f"speculative draft_model is required for method {self.method or 'dflash'!r} (a DFlash "
                              f"draft checkpoint, or a causal LM for 'draft-model'; 'ngram' needs none)",
                              field="draft_model")
        if self.ngram_max is not None:
            if self.method != "ngram":
                raise ConfigError(f"ngram_max={self.ngram_max!r} applies to method 'ngram' only", field="ngram_max")
            if isinstance(self.ngram_max, bool) or not isinstance(self.ngram_max, int) or self.ngram_max < 1:
                raise ConfigError(f"ngram_max={self.ngram_max!r} must be an integer >= 1", field="ngram_max")
        if self.method is not None:  # None: the checkpoint names the method (speculative/registry.method_of)
            for f in fields(self):
                value, methods = getattr(self, f.name), f.metadata.get("methods")
                if methods and self.method not in methods and value not in (None, False):
                    raise ConfigError(f"{f.name}={value!r} applies to {_readers(methods)} only, not to method "
                                      f"{self.method!r}", field=f.name)
        k = self.num_draft_tokens
        if k is not None and (isinstance(k, bool) or not isinstance(k, int) or k < 1):
            raise ConfigError(f"num_draft_tokens={k!r} must be an integer >= 1", field="num_draft_tokens")
        if self.target_layer_ids is not None and (
            not self.target_layer_ids or any(not isinstance(i, int) or i < 0 for i in self.target_layer_ids)
        ):
            raise ConfigError(f"target_layer_ids={self.target_layer_ids!r} must be a non-empty list of layer ids >= 0")
        if self.draft_vocab_size is not None:
            n = self.draft_vocab_size
            if isinstance(n, bool) or not isinstance(n, int) or n < 1:
                raise ConfigError(f"draft_vocab_size={n!r} must be an integer >= 1 (or None: the whole vocabulary)")
            if self.probabilistic_drafting:
                # sampled drafts come from the draft distribution over the whole vocabulary (compute_logits); the
                # smaller head only serves argmax drafts
                raise ConfigError(f"draft_vocab_size={n} works with argmax drafting only, not with "
                                  f"probabilistic_drafting")


@dataclass
class EngineConfig:
    # generate and bench call it --max-batch-size
    max_num_seqs: int = field(default=32, metadata={"help": "most requests running at once"})
    max_num_batched_tokens: int = field(default=1024, metadata={
        "help": "rows per target forward: prefill chunk tokens + verify rows"})
    # target and draft context share pages. Flag --kv-block-size: a "KV block" as in vLLM's paged attention and our
    # own --num-kv-blocks, and not the DFlash drafter's block (--draft-block-size); --block-size until the next release
    block_size: int = field(default=16, metadata={"flag": "--kv-block-size", "deprecated": ("--block-size",),
                                                  "help": "tokens per KV cache block (a page of the KV pool)"})
    # None: enough for max_num_seqs full-length requests, capped by kv_cache_tokens
    num_kv_blocks: int | None = field(default=None, metadata={
        "help": "KV pool size in blocks (default: from --kv-cache-tokens)"})
    # capped by max_num_seqs x max_model_len
    kv_cache_tokens: int = field(default=16384, metadata={
        "help": "KV pool size in tokens when --num-kv-blocks is not given"})
    max_model_len: int | None = field(default=None, metadata={
        "help": "context length (default: the model's max_position_embeddings)"})
    enable_prefix_caching: bool = field(default=True, metadata={"flag": "--no-prefix-caching",
                                                                "help": "disable the prefix cache"})
    # Offline throughput: while requests are decoding, admit waiting ones only when this many (or all that wait) fit.
    # A step that prefills runs the varlen path, not the decode step's CUDA graph, so admitting one request per step
    # as others finish would keep a full batch off the graph almost every step. 1: admit at once (serving).
    min_admit: int = 1
    # A step with both decoding and prefilling requests: True runs the decoding ones through the decode step (its
    # CUDA graph, which also drafts their next blocks) and only the rest through the varlen path; False runs every
    # row on the varlen path, then an eager draft pass. Same outputs either way (tested on CPU). On the GPU it paid
    # 1.09x at draft-data's shape (docs/results/2026-12-03-h200-datagen-split-mixed-steps.md), which turns it on;
    # serving leaves it off until measured at small
    # batches. On CPU every forward reads all the weights, so one combined pass stays cheaper there.
    split_mixed_steps: bool = False
    # While the GPU runs decode step n, the host enqueues step n+1 of the same requests (its inputs derived on the
    # device from step n's result) and only then reads step n's tokens, commits them and does its bookkeeping: the
    # host's per-step work hides behind the GPU's. Same tokens as off in fp32 and with --batch-invariant (tested); in
    # default bf16 a step chained next to a request that has just finished runs a larger batch than the synchronous
    # engine would, which can move a near-tie as any other batch change does. A request that finishes in step n
    # wastes its row of step n+1. None (default): on for CUDA, off on the CPU (a step runs when launched: nothing to
    # hide); True forces it on the CPU too (tests check the chained path there). Never under tensor parallelism (its
    # ranks mirror the synchronous runner calls).
    overlap: bool | None = field(default=None, metadata={
        "help": "overlap the host's work with the GPU's decode steps (default: on for CUDA, off on the CPU)"})
    # "auto": the decode step wherever every scheduled request decodes with the same (K, K'), else the varlen step;
    # "varlen": every step on the varlen path (tests compare the two paths; same outputs)
    step_path: str = "auto"
    # None: the drafter's recorded table for this device (speculative/schedule.py), else K throughout. "auto" (the
    # commands' and the LLM facade's default): that table, else measured on this machine (engine/calibrate.py). "off":
    # K throughout, table or not (eval-draft: a drafter's acceptance at K)
    draft_len_schedule: dict[int, int] | str | None = field(default=None, metadata={
        "metavar": "auto|off|B:K,...",
        "help": "draft length by batch size, e.g. 1:15,16:7,64:3 (K of the largest B <= the running batch); auto "
                "(default without --num-draft-tokens): step costs measured on this machine once and cached, K "
                "re-picked as generation goes from the acceptance it sees, K = 0 where drafting does not pay by a "
                "margin; off: K throughout"})
    # "torch" (reference) | "triton" (GPU kernels) | "auto": triton on CUDA
    attention_backend: str = field(default="auto", metadata={"help": "torch | triton | auto (triton on CUDA)"})
    # True: the decode step runs the same code uncaptured
    enforce_eager: bool = field(default=False, metadata={"help": "never capture CUDA graphs (same results, slower)"})
    tensor_parallel_size: int = field(default=1, metadata={
        "help": "split the target and drafter over N processes (GPUs: NCCL, one per rank; CPU: gloo)"})

    def __post_init__(self) -> None:
        for name in ("max_num_seqs", "max_num_batched_tokens", "block_size", "kv_cache_tokens", "tensor_parallel_size",
                     "min_admit"):
            v = getattr(self, name)
            if not isinstance(v, int) or v < 1:
                raise ConfigError(f"{name}={v!r} must be an integer >= 1")
        if self.step_path not in STEP_PATHS:
            raise ConfigError(f"step_path={self.step_path!r} must be one of {', '.join(STEP_PATHS)}", field="step_path")
        if self.overlap and self.tensor_parallel_size > 1:
            raise ConfigError("overlap=True does not go with tensor parallelism (its ranks run each step in turn)",
                              field="overlap")
        if self.num_kv_blocks is not None and (not isinstance(self.num_kv_blocks, int) or self.num_kv_blocks < 2):
            raise ConfigError(f"num_kv_blocks={self.num_kv_blocks!r} must be an integer >= 2")
        if self.draft_len_schedule in (AUTO, OFF):
            pass  # resolved by the engine (OFF) and the LLM facade once the engine exists (AUTO: engine/calibrate.py)
        elif isinstance(self.draft_len_schedule, str):
            raise ConfigError(f"draft_len_schedule={self.draft_len_schedule!r}: expected {AUTO!r}, {OFF!r}, None or a "
                              f"{{batch: K}} mapping", field="draft_len_schedule")
        elif self.draft_len_schedule is not None:
            sched = {int(k): int(v) for k, v in self.draft_len_schedule.items()}
            if not sched or min(sched) < 1 or min(sched.values()) < 0:
                raise ConfigError(f"draft_len_schedule={self.draft_len_schedule!r}: keys (batch sizes) must be >= 1 "
                                  f"and values (draft lengths) >= 0")
            self.draft_len_schedule = sched
