"""--fsdp: the frozen target's decoder layers sharded over the ranks (FSDP2, torch.distributed.fsdp.fully_shard), for
targets whose weights do not fit one device.

Each rank keeps 1/world_size of every decoder layer's weights. A layer's forward all-gathers its full weights from
all ranks, runs, and frees them again (reshard_after_forward), so at most one layer is whole at a time. Every rank
runs the target over its own micro-batch, so the taps of every position reach that rank's drafter as without FSDP;
because each layer's all-gather is a collective, every rank runs the same number of target passes per step
(trainer: filler passes). The embedding, the final norm and the lm_head stay whole on every rank: the drafter reads
the embedding for its block inputs and the lm_head for its loss outside the target's forward."""

from __future__ import annotations

from torch import nn

from blockspec.train.distributed import DataParallel


def shard_target(model: nn.Module, dp: DataParallel) -> nn.Module:
    """Shard model.layers over dp's ranks onto dp.device; move the rest (whole) there too. The model may arrive on
    the CPU (a target too large for one device is loaded into host memory first)."""
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import fully_shard

    mesh = DeviceMesh.from_group(dp.group, dp.device.type)
    model.requires_grad_(False)
    for layer in model.layers:
        # explicit: FSDP2 would otherwise keep a root module's weights gathered after its forward, and each layer is
        # a root here (the model itself is not sharded)
        fully_shard(layer, mesh=mesh, reshard_after_forward=True)
    for name, child in model.named_children():
        if name != "layers":
            child.to(dp.device)
    return model


def sharded_bytes(model: nn.Module) -> int:
    """Bytes of target weights this rank holds (its layer shards and the whole embedding, norm and lm_head)."""
    total = 0
    for p in model.parameters():  # each tied weight once
        local = p.to_local() if hasattr(p, "to_local") else p  # a sharded layer weight is a DTensor
        total += local.numel() * local.element_size()
    return total
