"""blockspec's native Q4 x Q8 CPU kernel (blockspec/native/q4gemm.c): every path (AMX, AVX512-VNNI, AVX2, scalar) gives
the same bits, a row of an M-row call equals the row alone at 1 and 2 threads, and the result is the dequantized
model's within the rounding of the int8 activations."""

from __future__ import annotations

import pytest
import torch

from blockspec.layers import cpu_quant
from blockspec.native import q4

pytestmark = pytest.mark.skipif(q4.library() is None, reason="no C compiler here: q4 runs torch's kernel")
PATHS = [p for p in (0, 1, 2, 3) if p <= q4.best_path()]  # 3: AMX at 2+ rows, where the CPU has it


def weights(N: int, K: int, seed: int) -> tuple[torch.Tensor, q4.Q4Weights]:
    w = torch.randn(N, K, generator=torch.Generator().manual_seed(seed)) * 0.05
    return w, q4.Q4Weights(*cpu_quant.q4_1_quantize(w))


def same_bits_everywhere(W: q4.Q4Weights | q4.Q8Weights, x: torch.Tensor) -> torch.Tensor:
    """W @ x [17, K] on every path at 1 and 2 threads: the first M rows of a call and each row alone equal the full
    call's, and every path and thread count gives the same bits; returns the result."""
    outs = []
    for threads in (1, 2):
        torch.set_num_threads(threads)
        for path in PATHS:
            full = W.matmul(x, path)
            outs.append(full)
            for M in range(1, 18):
                assert torch.equal(W.matmul(x[:M], path), full[:M]), (threads, path, M)
            assert all(torch.equal(W.matmul(x[i:i + 1], path), full[i:i + 1]) for i in range(17))
    assert len(PATHS) >= 1 and all(torch.equal(o, outs[0]) for o in outs)
    return outs[0]


@pytest.mark.parametrize("N,K", [(8, 32), (24, 96), (64, 576)])
def test_paths_and_threads_give_the_same_bits_and_rows_are_alone(N, K):
    _, W = weights(N, K, N + K)
    x = torch.randn(17, K, generator=torch.Generator().manual_seed(1)) * 3
    x[3] = 0  # a zero row: scale 0
    assert torch.all(same_bits_everywhere(W, x)[3] == 0)


def test_within_the_rounding_of_the_int8_activations():
    w, W = weights(48, 160, 7)
    x = torch.randn(9, 160, generator=torch.Generator().manual_seed(2)).double()
    w_deq = cpu_quant.reference_weight("q4", w, native=True).double()
    got = W.matmul(x.float()).double()
    want = x @ w_deq.T
    # each activation is off by at most half its block's step (max |x| / 127 / 2): the bound below, plus fp32 rounding
    step = x.view(9, 5, 32).abs().amax(-1) / 127 / 2  # [M, blocks]
    bound = torch.einsum("mb,nb->mn", step, w_deq.view(48, 5, 32).abs().sum(-1))
    assert torch.all((got - want).abs() <= bound * 1.001 + 1e-5 * want.abs() + 1e-6)
    assert (got - want).abs().max() > 0  # the activations are really quantized (this is not the fp32 product)


def test_quantize_picks_the_native_kernel_for_q4_and_falls_back(monkeypatch):
    w = torch.randn(32, 64)
    assert isinstance(cpu_quant.quantize("q4", w, None), cpu_quant.NativeQ4Linear)
    monkeypatch.setattr(q4, "library", lambda: None)  # no compiler: torch's int4 kernel
    assert type(cpu_quant.quantize("q4", w, None)) is cpu_quant.Int4Linear


def q8_weights(N: int, K: int, seed: int) -> tuple[torch.Tensor, q4.Q8Weights]:
    w = torch.randn(N, K, generator=torch.Generator().manual_seed(seed)) * 0.05
    w[0, :32] = -w[0, :32].abs().max()  # a block of -127 codes: |w| x x at its largest in the AVX2 sums
    return w, q4.Q8Weights(*cpu_quant.q8_0_quantize(w))


@pytest.mark.parametrize("N,K", [(8, 32), (24, 96), (64, 576)])
def test_q8_paths_and_threads_give_the_same_bits_and_rows_are_alone(N, K):
    w, W = q8_weights(N, K, N * K)
    assert int(cpu_quant.q8_0_quantize(w)[0].min()) == -127
    x = torch.randn(17, K, generator=torch.Generator().manual_seed(3)) * 3
    x[2] = 0
    out = same_bits_everywhere(W, x)
    assert torch.all(out[2] == 0)
    w_deq = cpu_quant.reference_weight("q8", w, native=True).double()
    x8 = x.view(17, K // 32, 32)
    amax = x8.abs().amax(-1, keepdim=True)
    xq = (torch.round(x8 * torch.where(amax > 0, 127 / amax, 0)) * amax / 127).view(17, K).double()
    torch.testing.assert_close(out.double(), xq @ w_deq.T, rtol=1e-5, atol=1e-5)


def test_a_q8_heads_row_prefix_is_a_view_computing_the_prefix_alone():
    """The drafter's vocabulary prefix of a q4 target's int8 head (loading/prepare.py): the head's own blocks, no
    copy, the same bits as the prefix quantized and computed on its own."""
    w = torch.randn(96, 64, generator=torch.Generator().manual_seed(8))
    head = cpu_quant.NativeQ8Linear(w, None)
    prefix = head.rows(40)
    x = torch.randn(3, 64, generator=torch.Generator().manual_seed(9))
    assert prefix.weights.packed.data_ptr() == head.weights.packed.data_ptr()
    assert torch.equal(prefix(x), cpu_quant.NativeQ8Linear(w[:40], None)(x))
    assert torch.equal(prefix(x), head(x)[:, :40])


def test_activation_codes_equal_the_formula():
    """q8 activations (the AVX2 path where the CPU has it, else the scalar loop): per block of 32, sx = max|x| / 127,
    codes = x * (127 / max|x|) rounded half to even and clamped to +-127, xs = sx * (the codes' sum), bit for bit."""
    g = torch.Generator().manual_seed(5)
    x = torch.randn(7, 96, generator=g) * torch.logspace(-3, 3, 7)[:, None]
    x[2] = 0  # scale 0
    x[4, :31], x[4, 31] = torch.arange(31) - 15.5, 127  # scale 1: codes on .5 ties, rounded to even
    qx, sx, xs = q4.quantize_rows(x, 3)
    blocks = x.view(7, 3, 32)
    amax = blocks.abs().amax(-1)
    want_sx = amax / 127
    inv = torch.where(amax > 0, 127 / amax, torch.zeros_like(amax))
    codes = torch.round(blocks * inv[..., None]).clamp(-127, 127)
    assert torch.equal(sx, want_sx)
    assert torch.equal(qx.view(7, 3, 32).float(), codes)
    assert torch.equal(xs, want_sx * codes.sum(-1))
