"""Data-parallel execution under torchrun: the process group, rank helpers and the few collectives that
distillation and the training loop need.

torchrun (`python -m torch.distributed.run`) starts one process per device and gives each RANK, WORLD_SIZE,
LOCAL_RANK, MASTER_ADDR and MASTER_PORT; `process_group()` joins them (gloo on CPU, NCCL on CUDA, each
process on its own GPU). Outside torchrun, or with one process, nothing is initialised and every helper
answers as the single process it is (rank 0 of 1): single-process runs are exactly what they were.

Rank 0 is the main process: it alone writes outputs (manifest, checkpoints, the trained folders).
Every process reads the same inputs and checkpoints, so on several nodes those folders must be on a
filesystem all nodes share.
"""

from __future__ import annotations

import contextlib
import datetime
import os
from typing import Any, Iterator

import torch
import torch.distributed as dist

# A collective waits this long for the slowest rank (a distillation rank with one more shard, the main
# rank writing a checkpoint). DRELAY_DIST_TIMEOUT_S overrides it.
DEFAULT_TIMEOUT_S = 4 * 3600


def launched() -> bool:
    """Whether this process is one of several that torchrun started (WORLD_SIZE > 1 in its environment)."""
    return int(os.environ.get("WORLD_SIZE", "1")) > 1


def active() -> bool:
    """Whether a process group is initialised (the collectives below then talk to the other ranks)."""
    return dist.is_available() and dist.is_initialized()


def rank() -> int:
    return dist.get_rank() if active() else 0


def world_size() -> int:
    return dist.get_world_size() if active() else 1


def local_rank() -> int:
    """The process's index on its node (its GPU), from torchrun's LOCAL_RANK; 0 outside torchrun."""
    return int(os.environ.get("LOCAL_RANK", "0"))


def is_main() -> bool:
    return rank() == 0


def backend_for(device: str | torch.device) -> str:
    return "nccl" if torch.device(device).type == "cuda" else "gloo"


@contextlib.contextmanager
def process_group(device: str | torch.device = "cpu") -> Iterator[None]:
    """Join torchrun's process group for the block and leave it after (no-op outside torchrun, with one
    process, or when a group is already initialised). On CUDA each process takes GPU LOCAL_RANK, so a
    plain "cuda" device is that GPU."""
    if not launched() or active():
        yield
        return
    backend = backend_for(device)
    if backend == "nccl":
        torch.cuda.set_device(local_rank())
    timeout = datetime.timedelta(seconds=float(os.environ.get("DRELAY_DIST_TIMEOUT_S", DEFAULT_TIMEOUT_S)))
    dist.init_process_group(backend, timeout=timeout)
    try:
        yield
    finally:
        dist.destroy_process_group()


def _device() -> torch.device:
    """Where collective tensors live: the process's GPU under NCCL, else the CPU."""
    if active() and dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def barrier() -> None:
    if active():
        dist.barrier()


def sum_over_ranks(tensor: torch.Tensor) -> torch.Tensor:
    """The sum of `tensor` over every rank (a new tensor on tensor's device; itself when single)."""
    if not active():
        return tensor
    total = tensor.detach().clone()
    dist.all_reduce(total)
    return total


def mean_over_ranks(values: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Scalar tensors averaged over the ranks in one collective (float32; the input when single)."""
    if not active() or not values:
        return values
    names = list(values)
    stacked = torch.stack([values[n].detach().float().reshape(()) for n in names]).to(_device())
    dist.all_reduce(stacked)
    stacked = (stacked / world_size()).cpu()
    return {n: stacked[i] for i, n in enumerate(names)}


def sum_numbers(*numbers: float) -> list[float]:
    """Python numbers summed over the ranks (float64)."""
    if not active():
        return list(numbers)
    t = torch.tensor(numbers, dtype=torch.float64, device=_device())
    dist.all_reduce(t)
    return t.cpu().tolist()


def max_numbers(*numbers: float) -> list[float]:
    if not active():
        return list(numbers)
    t = torch.tensor(numbers, dtype=torch.float64, device=_device())
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.cpu().tolist()


def broadcast_object(obj: Any, src: int = 0) -> Any:
    """Rank `src`'s `obj` on every rank (pickled); `obj` itself when single."""
    if not active():
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=src, device=_device() if dist.get_backend() == "nccl" else None)
    return box[0]


def gather_objects(obj: Any) -> list[Any]:
    """Every rank's `obj`, in rank order; [obj] when single."""
    if not active():
        return [obj]
    out: list[Any] = [None] * world_size()
    dist.all_gather_object(out, obj)
    return out


def data_parallel(module: torch.nn.Module) -> torch.nn.Module:
    """`module` wrapped in DistributedDataParallel: its backward averages every gradient over the ranks.
    Unused parameters are allowed (a method's optional parts); buffers are constants here: synced once, not
    before every step. Parameters that do not train (the target's frozen embedding) are not synced."""
    from torch.nn.parallel import DistributedDataParallel

    frozen = [name for name, p in module.named_parameters() if not p.requires_grad]
    if frozen:
        DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(module, frozen)
    device = next((p.device for p in module.parameters() if p.requires_grad), torch.device("cpu"))
    return DistributedDataParallel(module, device_ids=[device.index] if device.type == "cuda" else None,
                                   find_unused_parameters=True, forward_sync_buffers=False)
