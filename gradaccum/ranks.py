"""The ranks that hold the model's gradients: the scalar collectives the accumulator adds
(length agreement, the item total, the finite flag, `Accumulator.step`'s agreement on
running out of memory) and the record of which rank failed."""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist

from gradaccum import faults
from gradaccum.errors import warn

__all__ = ["Ranks", "collective_device"]


def collective_device(device: torch.device, supported: Sequence[torch.device]) -> torch.device:
    """Where the scalar collectives run, for parameters on ``device`` and a group whose
    backends take tensors on the ``supported`` device types (torch's record of the group's
    backends; empty where it has none): the parameters' device, unless they are on the
    CPU and no backend of the group takes CPU tensors, as NCCL alone does not under CPU
    offloading (FSDP's ``CPUOffloadPolicy``, ``CPUOffload(offload_params=True)``): then
    the group's device, at its current index (``torch.cuda.set_device``). Gloo takes CUDA
    tensors, so CUDA parameters stay on their device under it."""
    if device.type != "cpu" or not supported or any(each.type == "cpu" for each in supported):
        return device
    return torch.device(supported[0].type)


class Ranks:
    """The process group the gradients are averaged over (``None``: this process alone).

    Attributes:
        group: The process group, or ``None``.
        count: How many ranks hold the gradients (1 without a group).
        device: Where the scalar collectives' tensors live: the parameters' device, or
            the group's where it takes no tensor there (`collective_device`).
    """

    def __init__(self, group: dist.ProcessGroup | None, device: torch.device) -> None:
        self.group = group
        self.count = 1 if group is None else dist.get_world_size(group)
        supported = () if group is None else getattr(group, "_device_types", ())
        self.device = collective_device(device, supported)
        self._warned = False

    @property
    def rank(self) -> int:
        """This process's global rank (0 alone)."""
        return 0 if self.group is None else dist.get_rank()

    def agree(self, n: int, unequal: str) -> int:
        """The least of ``n`` over the ranks: one all-reduce, read on the host. When the
        ranks differ, warn once (on rank 0) with ``unequal``, formatted with ``least`` and
        ``most``."""
        if self.count == 1:
            return n
        ends = torch.tensor([n, -n], device=self.device)
        dist.all_reduce(ends, op=dist.ReduceOp.MIN, group=self.group)
        least, negated_most = (int(end) for end in ends.tolist())
        if -negated_most > least and not self._warned:
            self._warned = True
            if dist.get_rank() == 0:
                warn(
                    unequal.format(least=least, most=-negated_most)
                    + ", so that no rank waits on a collective the others never call; shard "
                    "the data evenly (e.g. DistributedSampler) to train on all of it"
                )
        return least

    def least(self, values: list[int]) -> list[int]:
        """The element-wise least of ``values`` over the ranks: one all-reduce, read on
        the host."""
        if self.count == 1:
            return values
        ends = torch.tensor(values, dtype=torch.int64, device=self.device)
        dist.all_reduce(ends, op=dist.ReduceOp.MIN, group=self.group)
        return [int(end) for end in ends.tolist()]

    def total(self, local: torch.Tensor) -> torch.Tensor:
        """``local`` summed over the ranks, in place (a float64 or int64 0-dim tensor)."""
        if self.count > 1:
            dist.all_reduce(local, group=self.group)
        return local

    def all(self, flag: torch.Tensor) -> bool:
        """Whether ``flag`` (a 0-dim bool tensor) holds on every rank: one host sync, and
        one scalar all-reduce over several ranks, so that every rank decides the same."""
        if self.count > 1:
            flag = flag.to(device=self.device, dtype=torch.int32)
            dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=self.group)
        return bool(flag.item())

    def record_failure(self, window: int, applied: bool, error: BaseException) -> None:
        """Record that this rank failed in ``window`` (numbered from 1, applied or not) with
        ``error``, unless another rank recorded a failure first."""
        what = f"{type(error).__name__}: {error}"
        faults.record_failure(faults.Failure(self.rank, window, applied, what))

    def first_failure(self) -> faults.Failure | None:
        """Another rank's failure, recorded first; None when it was this one's."""
        found = faults.first_failure()
        return found if found is not None and found.rank != self.rank else None
