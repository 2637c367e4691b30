"""Each rank's own copy of a module's weights when the ranks were started from a fork server.

``torch.multiprocessing`` passes every tensor it pickles to a new process in shared memory. Lightning copies a
module's tensors out again under ``start_method="spawn"`` on CPU (Lightning-AI/pytorch-lightning#18238) but not
under ``"forkserver"``, where the ranks on one host would all step on one set of weights: DDP's all-reduce then
updates it once per rank, and no step equals one process on the union of the ranks' samples.
"""

from __future__ import annotations

import itertools

import torch

__all__ = ["unshare_module_memory"]


@torch.no_grad()
def unshare_module_memory(module: torch.nn.Module) -> int:
    """Copy ``module``'s CPU parameters and buffers that live in shared memory into this process's own memory
    (before the optimizer or DDP hold them). Returns how many tensors were copied."""
    copied = 0
    for tensor in itertools.chain(module.parameters(), module.buffers()):
        if tensor.device.type == "cpu" and tensor.is_shared():
            tensor.data = tensor.data.clone()
            copied += 1
    return copied
