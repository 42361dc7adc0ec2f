"""Running out of memory inside a window of `Accumulator.step`: what counts as it, the
gradients as they were before the window (to put back when it is discarded), and the
freeing of the failed try's memory."""

from __future__ import annotations

import gc

import torch

__all__ = ["Kept", "out_of_memory", "release"]


def out_of_memory(error: BaseException) -> bool:
    """``error`` is an allocation failure: ``torch.OutOfMemoryError`` (CUDA, and other
    devices' allocators), or the CPU allocator's ``RuntimeError`` ("can't allocate
    memory", glibc's malloc failing)."""
    if isinstance(error, torch.OutOfMemoryError):
        return True
    return isinstance(error, RuntimeError) and "can't allocate memory" in str(error)


class Kept:
    """The gradients of ``params`` before a window, put back by `restore`.

    After a window's step (``zero_grad(set_to_none=True)``) every gradient is None, and
    keeping them costs a list of Nones; a gradient that exists already (a backward run
    outside the accumulator, which the window adds to) is copied once, and copied again at
    each `restore`, since the re-run adds to it in place.
    """

    __slots__ = ("grads", "params")

    def __init__(self, params: list[torch.Tensor]) -> None:
        self.params = params
        self.grads = [
            None if param.grad is None else param.grad.detach().clone() for param in params
        ]

    def restore(self) -> None:
        """Put the gradients back as they were before the window."""
        for param, grad in zip(self.params, self.grads, strict=True):
            param.grad = None if grad is None else grad.clone()


def release() -> None:
    """Free what the failed try held: its autograd graphs are unreferenced once its error
    is dropped; a collection breaks any cycle through a traceback, and the CUDA caching
    allocator gives its cached blocks back, so that the smaller try starts from a clean
    heap."""
    gc.collect()
    if torch.cuda.is_initialized():  # type: ignore[no-untyped-call]
        torch.cuda.empty_cache()
