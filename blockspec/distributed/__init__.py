"""Tensor parallelism on torch.distributed: NCCL on GPUs, gloo on CPU (docs/tensor-parallel.md)."""
