"""SamplingParams and the token sampler (temperature, top_k, top_p; greedy at temperature 0).

Sampling uses the exponential race (argmax of p / E with E ~ Exp(1)), which draws exactly from p and needs no host
sync. The noise E is a counter-based hash of (request seed, token position) (blockspec.rng), so a seeded request is
reproducible in any batch, on any path, inside a CUDA graph."""

from __future__ import annotations

import secrets
from dataclasses import dataclass, field

import torch

from blockspec import rng
from blockspec.errors import ConfigError
from blockspec.host_tensors import host_tensor


@dataclass
class SamplingParams:
    temperature: float = 0.0  # 0 -> greedy
    top_k: int = 0  # 0 or -1 -> off
    top_p: float = 1.0
    seed: int | None = None
    max_tokens: int = 128
    stop_token_ids: list[int] = field(default_factory=list)  # in addition to the model's own stop ids
    ignore_eos: bool = False

    def __post_init__(self) -> None:
        def bad(name: str, value: object, rule: str) -> ConfigError:
            return ConfigError(f"invalid sampling value {name}={value!r}: {rule}", field=name)

        if not isinstance(self.temperature, (int, float)) or not (0.0 <= self.temperature < float("inf")):
            raise bad("temperature", self.temperature, "must be a finite number >= 0 (0 means greedy)")
        if not isinstance(self.top_k, int) or self.top_k < -1:
            raise bad("top_k", self.top_k, "must be an integer >= 0 (0 or -1 disables it)")
        if not isinstance(self.top_p, (int, float)) or not (0.0 < self.top_p <= 1.0):
            raise bad("top_p", self.top_p, "must be in (0, 1]")
        if not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise bad("max_tokens", self.max_tokens, "must be an integer >= 1")
        if self.seed is not None and (not isinstance(self.seed, int) or not 0 <= self.seed < 2**63):
            raise bad("seed", self.seed, "must be an integer in [0, 2**63)")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    def resolve_seed(self) -> int:
        """The seed of this request's noise (blockspec.rng): the given one, else a fresh random one."""
        return self.seed if self.seed is not None else secrets.randbits(62)


@dataclass
class SamplingRows:
    """Per-row sampling parameters of a batch of logit rows, on device. `use_*` are host flags: a filter that no
    row uses is skipped (and rows that do not use it are left bit-identical to a batch without it)."""

    temperature: torch.Tensor  # [N] fp32, 0 = greedy
    top_k: torch.Tensor  # [N] int64, 0 = off
    top_p: torch.Tensor  # [N] fp32, 1 = off
    seeds: torch.Tensor  # [N] int64
    all_greedy: bool
    use_top_k: bool
    use_top_p: bool

    @classmethod
    def build(cls, params: list[SamplingParams], seeds: list[int], device: torch.device, vocab_size: int) -> "SamplingRows":
        top_k = [p.top_k if 0 < p.top_k < vocab_size else 0 for p in params]
        return cls(
            host_tensor([float(p.temperature) for p in params], torch.float32, device),
            host_tensor(top_k, torch.int64, device),
            host_tensor([float(p.top_p) for p in params], torch.float32, device),
            host_tensor(seeds, torch.int64, device),
            all(p.greedy for p in params), any(k > 0 for k in top_k), any(p.top_p < 1.0 for p in params),
        )

    def repeat(self, n: int) -> "SamplingRows":
        """Each row n times (the K+1 verify rows of one request share its parameters)."""
        r = lambda t: t.repeat_interleave(n)  # noqa: E731
        return SamplingRows(r(self.temperature), r(self.top_k), r(self.top_p), r(self.seeds), self.all_greedy,
                            self.use_top_k, self.use_top_p)

    def rows(self, start: int, stop: int) -> "SamplingRows":
        return SamplingRows(self.temperature[start:stop], self.top_k[start:stop], self.top_p[start:stop],
                            self.seeds[start:stop], self.all_greedy, self.use_top_k, self.use_top_p)


def processed_probs_rows(logits: torch.Tensor, rows: SamplingRows) -> torch.Tensor:
    """logits [N, V] -> the distribution actually sampled from, [N, V] fp32 (temperature, then top_k, then top_p)."""
    x = logits.float() / rows.temperature.clamp_min(1e-5)[:, None]
    if rows.use_top_k:
        sorted_x = x.sort(dim=-1, descending=True).values
        kth = sorted_x.gather(1, (rows.top_k - 1).clamp_min(0)[:, None])
        x = x.masked_fill((rows.top_k > 0)[:, None] & (x < kth), float("-inf"))
    probs = torch.softmax(x, dim=-1)
    if rows.use_top_p:
        sorted_p, idx = probs.sort(dim=-1, descending=True)
        # keep the smallest prefix whose mass reaches top_p, and always the top token: a top_p that underflows to 0
        # in fp32 (1e-300) would otherwise drop every token and leave NaN
        drop = (sorted_p.cumsum(-1) - sorted_p) >= rows.top_p[:, None]
        drop[:, 0] = False
        kept = torch.zeros_like(probs).scatter_(-1, idx, sorted_p.masked_fill(drop, 0.0))
        kept = kept / kept.sum(-1, keepdim=True)
        probs = torch.where((rows.top_p < 1.0)[:, None], kept, probs)
    return probs


def processed_probs(logits: torch.Tensor, temperature: float, top_k: int, top_p: float) -> torch.Tensor:
    """Scalar-parameter form of processed_probs_rows (same arithmetic)."""
    p = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p)
    return processed_probs_rows(logits, SamplingRows.build([p] * logits.shape[0], [0] * logits.shape[0],
                                                           logits.device, logits.shape[-1]))


def race(probs: torch.Tensor, exp_noise: torch.Tensor) -> torch.Tensor:
    """The exponential race: argmax of p / E with E ~ Exp(1) draws exactly from p. [N, V] -> [N]."""
    return (probs / exp_noise).argmax(dim=-1)


def sample_rows(logits: torch.Tensor, rows: SamplingRows, positions: torch.Tensor, chunk: int = 64) -> torch.Tensor:
    """logits [N, V] -> token ids [N]: argmax for greedy rows, else a draw with the noise of (seed, position) where
    `positions` [N] are the positions of the tokens being sampled. Rows go `chunk` at a time: the noise and the
    processed distribution are [rows, V] temporaries (a 1024-row verify batch over a 152k vocabulary would need
    several GB at once)."""
    greedy = logits.max(dim=-1).indices  # = argmax (the first maximum on ties), about 3x faster on CPU
    if rows.all_greedy:
        return greedy
    drawn = []
    for a in range(0, logits.shape[0], chunk):
        b = min(a + chunk, logits.shape[0])
        noise = rng.exponential(rows.seeds[a:b], positions[a:b], rng.STREAM_TARGET, logits.shape[-1])
        drawn.append(race(processed_probs_rows(logits[a:b], rows.rows(a, b)), noise))
    return torch.where(rows.temperature == 0, greedy, torch.cat(drawn))


def sample(logits: torch.Tensor, params: SamplingParams, seed: int, positions: torch.Tensor) -> torch.Tensor:
    """One request's rows: logits [N, V] for the tokens at `positions` [N] -> token ids [N]."""
    n = logits.shape[0]
    return sample_rows(logits, SamplingRows.build([params] * n, [seed] * n, logits.device, logits.shape[-1]), positions)
