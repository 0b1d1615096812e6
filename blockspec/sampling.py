"""SamplingParams and the token sampler (temperature, top_k, top_p; greedy at temperature 0).

Sampling uses the exponential race (argmax of p / E with E ~ Exp(1)), which draws exactly from p, needs no host
sync and lets the noise come from a per-request torch.Generator, so a seeded request is reproducible."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from blockspec.errors import ConfigError


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
            return ConfigError(f"invalid sampling value {name}={value!r}: {rule}")

        if not isinstance(self.temperature, (int, float)) or not (0.0 <= self.temperature < float("inf")):
            raise bad("temperature", self.temperature, "must be a finite number >= 0 (0 means greedy)")
        if not isinstance(self.top_k, int) or self.top_k < -1:
            raise bad("top_k", self.top_k, "must be an integer >= 0 (0 or -1 disables it)")
        if not isinstance(self.top_p, (int, float)) or not (0.0 < self.top_p <= 1.0):
            raise bad("top_p", self.top_p, "must be in (0, 1]")
        if not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise bad("max_tokens", self.max_tokens, "must be an integer >= 1")
        if self.seed is not None and (not isinstance(self.seed, int) or self.seed < 0):
            raise bad("seed", self.seed, "must be a non-negative integer")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    def make_generator(self, device: torch.device) -> torch.Generator | None:
        if self.greedy:
            return None
        g = torch.Generator(device=device)
        g.manual_seed(self.seed if self.seed is not None else int(torch.randint(0, 2**62, (1,)).item()))
        return g


def processed_probs(logits: torch.Tensor, temperature: float, top_k: int, top_p: float) -> torch.Tensor:
    """logits [N, V] -> the distribution actually sampled from, [N, V] fp32 (temperature, then top_k, then top_p)."""
    logits = logits.float() / max(temperature, 1e-5)
    V = logits.shape[-1]
    if 0 < top_k < V:
        kth = torch.topk(logits, top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    if top_p < 1.0:
        sorted_p, idx = probs.sort(dim=-1, descending=True)
        # keep the smallest prefix whose mass reaches top_p (always at least the top token)
        drop = (sorted_p.cumsum(-1) - sorted_p) >= top_p
        sorted_p = sorted_p.masked_fill(drop, 0.0)
        probs = torch.zeros_like(probs).scatter_(-1, idx, sorted_p)
        probs = probs / probs.sum(-1, keepdim=True)
    return probs


def sample_from(probs: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
    """probs [N, V] -> token ids [N] by the exponential race."""
    # clamp: a zero draw would turn 0/0 into NaN, which argmax ranks first
    noise = torch.empty_like(probs).exponential_(generator=generator).clamp_min_(1e-30)
    return (probs / noise).argmax(dim=-1)


def sample(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None) -> torch.Tensor:
    """logits [N, V] -> token ids [N]."""
    if params.greedy:
        return logits.argmax(dim=-1)
    return sample_from(processed_probs(logits, params.temperature, params.top_k, params.top_p), generator)
