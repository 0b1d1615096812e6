"""What the engine can do with a built, platform-prepared model beyond running it eagerly on one device as a target:
capture its decode step in a CUDA graph (graph_refusal), shard it over tensor-parallel ranks (sharding_refusal), run
it as a classic draft model (draft_model_refusal). Each answers from the modules the model is made of, never from its
architecture's name, so a new family with the shared layers gets all three and one with its own gets a one-line
reason. The platform plan records the first (PlatformPlan.with_graphs); distributed/factory.py asks the second before
any rank starts, speculative/draft_model.py the third before any pool is sized."""

from __future__ import annotations

from torch import nn

from blockspec.layers.moe import SparseMoeBlock
from blockspec.models.decoder import MLP, Attention


def graph_refusal(model: nn.Module) -> str | None:
    """Why a step of this (prepared) target cannot be captured in a CUDA graph, else None: routed experts that are
    not stacked for the fused kernel (SparseMoeBlock.stacked: plain bias-free experts only) run the grouped path
    (layers/moe.grouped_experts), which reads each expert's row count back to the host in every layer. gpt-oss's
    experts (biases, the clamped SwiGLU) and Gemma 4's are such."""
    for name, module in model.named_modules():
        if isinstance(getattr(module, "experts", None), nn.ModuleList) and getattr(module, "stacked", None) is None:
            return (f"the routed experts ({name or 'model'}: {type(module).__name__}) run the grouped path, which "
                    f"syncs with the host every layer")
    return None


def _attention_extras(layer: nn.Module) -> str | None:
    """What a layer's attention has beyond the shared decoder's (q/k/v heads, one causal softmax), else None."""
    attn = getattr(layer, "self_attn", None)
    if type(attn) is not Attention:
        return f"its attention ({type(attn).__name__})"
    return "its learned attention sinks" if hasattr(attn, "sinks") else None


def _first_layer(model: nn.Module, what) -> tuple[int, str] | None:
    for i, layer in enumerate(getattr(model, "layers", ())):
        found = what(layer)
        if found is not None:
            return i, found
    return None


def _arch(model: nn.Module) -> str:
    return getattr(getattr(model, "config", None), "architecture", type(model).__name__)


def sharding_refusal(model: nn.Module) -> str | None:
    """Why tensor parallelism cannot shard this target, else None. distributed/shard.py splits the shared decoder's
    attention (q/k/v heads, nothing else per head), its dense MLP and plain routed experts; any other layer part
    would be split wrongly (learned per-head sinks left whole) or not at all (a family's own attention or experts):
    gpt-oss and Gemma 4 are refused here, in one line, before any rank starts."""
    found = _first_layer(model, lambda layer: _attention_extras(layer) or (
        None if isinstance(getattr(layer, "mlp", None), (MLP, SparseMoeBlock))
        else f"its feed-forward ({type(getattr(layer, 'mlp', None)).__name__})"))
    if found is None:
        return None
    return (f"tensor parallelism does not support {_arch(model)} targets yet: {found[1]} in layer {found[0]} is not "
            f"what distributed/shard.py splits; use tensor_parallel_size=1")


def draft_model_refusal(model: nn.Module) -> str | None:
    """Why this model cannot draft as a classic draft model, else None: its in-flight rows are attended through the
    backend's draft attention (causal, each layer's own new k/v, no window, no sinks), which a layer with learned
    sinks or a family's own attention (Gemma 4's windows, K/V shared between layers) would not get right."""
    found = _first_layer(model, _attention_extras)
    if found is None:
        return None
    return (f"{_arch(model)} is not supported as a draft model yet: {found[1]} in layer {found[0]} is not what the "
            f"draft attention computes; use a DFlash drafter, n-gram lookup or a dense draft model")
