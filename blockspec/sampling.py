"""SamplingParams and the token sampler (temperature, then top_k, top_p and min_p; greedy at temperature 0).

A sampling parameter is declared here and nowhere else: its SamplingParams field, whose metadata makes it a flag of
the commands that sample ("help": cli/flags.py) and a field of the server's requests ("api": server/protocol.py); its
check in __post_init__; its per-row tensor and flag in SamplingRows; its filter in processed_probs_rows.

Sampling uses the exponential race (argmax of p / E with E ~ Exp(1)), which draws exactly from p and needs no host
sync. The noise E is a counter-based hash of (request seed, token position) (blockspec.rng), so a seeded request is
reproducible in any batch, on any path, inside a CUDA graph.

torch is imported where it is used: the commands build their sampling flags from SamplingParams, and `--help`
imports no torch."""

from __future__ import annotations

import secrets
from dataclasses import dataclass, field, fields, replace
from typing import TYPE_CHECKING, Callable

from blockspec.errors import ConfigError

if TYPE_CHECKING:
    import torch


@dataclass
class SamplingParams:
    # metadata "help": a flag of generate and chat; "api": a request field of the server ("api_default": its default
    # there, where OpenAI's differs)
    temperature: float = field(default=0.0, metadata={"help": "0 = greedy", "api": True, "api_default": 1.0})
    top_k: int = field(default=0, metadata={"help": "keep the K most likely tokens (0 or -1: off)", "api": True})
    top_p: float = field(default=1.0, metadata={
        "help": "keep the smallest set of most likely tokens whose probability reaches P (1: off)", "api": True})
    min_p: float = field(default=0.0, metadata={
        "help": "keep the tokens at least P times as likely as the most likely one (0: off)", "api": True})
    seed: int | None = field(default=None, metadata={"help": "sampling seed (default: a random one)"})
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
        if isinstance(self.min_p, bool) or not isinstance(self.min_p, (int, float)) or not 0.0 <= self.min_p <= 1.0:
            raise bad("min_p", self.min_p, "must be in [0, 1] (0 disables it)")
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
    """Per-row sampling parameters of a batch of logit rows: a tensor [N] per parameter, on device, and host flags.
    An engine step builds them once, one row per request, and selects the rows each stage reads. `use_*`: a filter that no row uses is skipped (and rows that do not use it are left bit-identical to a batch
    without it); the flags are a captured step's sampling mode (`mode`: one graph each), the tensors its inputs."""

    temperature: torch.Tensor  # [N] fp32, 0 = greedy
    top_k: torch.Tensor  # [N] int64, 0 = off
    top_p: torch.Tensor  # [N] fp32, 1 = off
    seeds: torch.Tensor  # [N] int64
    all_greedy: bool
    use_top_k: bool
    use_top_p: bool
    min_p: torch.Tensor  # [N] fp32, 0 = off
    use_min_p: bool

    @classmethod
    def build(cls, params: list[SamplingParams], seeds: list[int], device: torch.device | str,
              vocab_size: int) -> SamplingRows:
        import torch

        from blockspec.host_tensors import host_tensor

        def floats(name: str) -> torch.Tensor:
            return host_tensor([float(getattr(p, name)) for p in params], torch.float32, device)

        top_k = [p.top_k if 0 < p.top_k < vocab_size else 0 for p in params]
        return cls(temperature=floats("temperature"), top_k=host_tensor(top_k, torch.int64, device),
                   top_p=floats("top_p"), seeds=host_tensor(seeds, torch.int64, device), min_p=floats("min_p"),
                   **cls.flags(params, vocab_size))

    @staticmethod
    def flags(params: list[SamplingParams], vocab_size: int) -> dict[str, bool]:
        """The host flags of rows with these params (a top_k of the whole vocabulary or more keeps every token)."""
        return {"all_greedy": all(p.greedy for p in params),
                "use_top_k": any(0 < p.top_k < vocab_size for p in params),
                "use_top_p": any(p.top_p < 1.0 for p in params), "use_min_p": any(p.min_p > 0 for p in params)}

    @classmethod
    def allocate(cls, n: int, device: torch.device | str) -> SamplingRows:
        """n rows of the defaults (greedy, every filter off) on `device`: the static inputs of a captured step,
        which copy_to fills."""
        return cls.build([SamplingParams()] * n, [0] * n, device, 0)

    def tensors(self) -> dict[str, torch.Tensor]:
        """The per-row tensors by field name."""
        return {f.name: v for f in fields(self) if not isinstance(v := getattr(self, f.name), bool)}

    @property
    def mode(self) -> tuple[bool, ...]:
        """The host flags (all_greedy, use_*): what a captured step depends on besides its shapes."""
        return tuple(v for f in fields(self) if isinstance(v := getattr(self, f.name), bool))

    def _map(self, fn: Callable[[torch.Tensor], torch.Tensor]) -> SamplingRows:
        return replace(self, **{k: fn(t) for k, t in self.tensors().items()})

    def repeat(self, n: int) -> SamplingRows:
        """Each row n times (the K+1 verify rows of one request share its parameters)."""
        return self._map(lambda t: t.repeat_interleave(n))

    def rows(self, start: int, stop: int) -> SamplingRows:
        return self._map(lambda t: t[start:stop])

    def select(self, index: torch.Tensor, flags: dict[str, bool]) -> SamplingRows:
        """The rows at `index` [M] (on the device) under `flags`, the flags of those rows' params (`flags(...)`, on
        the host: a subset's flags can be narrower than the batch's, and a filter that none of its rows uses is
        skipped)."""
        return replace(self._map(lambda t: t[index]), **flags)

    def copy_to(self, static: SamplingRows) -> SamplingRows:
        """These rows written into `static`'s tensors of the same shapes (one non-blocking copy each) and returned
        as those tensors under these rows' flags: the inputs of a captured step for this batch."""
        mine = self.tensors()
        for name, dst in static.tensors().items():
            dst.copy_(mine[name], non_blocking=True)
        return replace(self, **static.tensors())


def processed_probs_rows(logits: torch.Tensor, rows: SamplingRows) -> torch.Tensor:
    """logits [N, V] -> the distribution actually sampled from, [N, V] fp32: temperature, then top_k, top_p and min_p,
    each on what the one before kept (the order of Hugging Face's warpers and SGLang's sampler)."""
    import torch

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
    if rows.use_min_p:
        # drop the tokens below min_p x the top token's probability (a ratio that top_k and top_p, which keep the top
        # token and rescale what they keep, leave as it was); the top token itself always stays
        floor = probs.amax(dim=-1, keepdim=True) * rows.min_p[:, None]
        kept = probs.masked_fill(probs < floor, 0.0)
        kept = kept / kept.sum(-1, keepdim=True)
        probs = torch.where((rows.min_p > 0)[:, None], kept, probs)
    return probs


def processed_probs(logits: torch.Tensor, temperature: float, top_k: int, top_p: float,
                    min_p: float = 0.0) -> torch.Tensor:
    """Scalar-parameter form of processed_probs_rows (same arithmetic)."""
    return processed_probs_for(logits, SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p))


def processed_probs_for(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """The distribution one request's params sample from, for its logit rows [N, V] -> [N, V] fp32."""
    n = logits.shape[0]
    return processed_probs_rows(logits, SamplingRows.build([params] * n, [0] * n, logits.device, logits.shape[-1]))


def race(probs: torch.Tensor, exp_noise: torch.Tensor) -> torch.Tensor:
    """The exponential race: argmax of p / E with E ~ Exp(1) draws exactly from p. [N, V] -> [N]."""
    return (probs / exp_noise).argmax(dim=-1)


def sample_rows(logits: torch.Tensor, rows: SamplingRows, positions: torch.Tensor, chunk: int = 64) -> torch.Tensor:
    """logits [N, V] -> token ids [N]: argmax for greedy rows, else a draw with the noise of (seed, position) where
    `positions` [N] are the positions of the tokens being sampled. Rows go `chunk` at a time: the noise and the
    processed distribution are [rows, V] temporaries (a 1024-row verify batch over a 152k vocabulary would need
    several GB at once)."""
    import torch

    from blockspec import rng

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
