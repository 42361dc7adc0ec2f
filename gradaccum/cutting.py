"""Cutting one per-rank batch into microbatches along dim 0, for `Accumulator.step`.

A batch is a tensor, or dicts, lists, tuples (named ones too) and dataclasses of them, to
any depth. Every tensor with a dim 0 is cut; every other leaf (a 0-dim tensor, a string,
a number, None) is passed to every microbatch as it is. The tensors' dim 0 must agree:
that is the batch's rows.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator, Mapping
from typing import Any

import torch

from gradaccum.errors import ConfigError, describe

__all__ = ["cut", "rows"]


def rows(batch: object) -> int:
    """The rows of ``batch``: the dim 0 that all its tensors share.

    Raises:
        ConfigError: The tensors disagree on dim 0, the batch has no tensor with a dim 0,
            or it has no rows.
    """
    first: tuple[str, int] | None = None
    for path, tensor in _tensors(batch, "batch"):
        size = tensor.shape[0]
        if first is None:
            first = (path, size)
        elif size != first[1]:
            msg = (
                f"batch's tensors disagree on dim 0: {first[0]} has {first[1]} rows but "
                f"{path} has {size}; acc.step cuts every tensor of the batch along dim 0, so "
                "pass a batch whose tensors all have one row per sample (a per-batch value "
                "as a 0-dim tensor or a Python number, which every microbatch gets as it is)"
            )
            raise ConfigError(msg)
    if first is None:
        msg = (
            f"batch holds no tensor with a dim 0 to cut into microbatches, got "
            f"{describe(batch)}; pass a tensor, or a dict, list, tuple or dataclass of "
            "tensors with one row per sample"
        )
        raise ConfigError(msg)
    if first[1] == 0:
        msg = f"batch has 0 rows (dim 0 of {first[0]}); pass a batch with at least one row"
        raise ConfigError(msg)
    return first[1]


def cut(batch: Any, total: int, size: int) -> list[tuple[Any, int]]:
    """``batch`` of ``total`` rows cut into microbatches of ``size`` rows (the last one
    shorter when ``size`` does not divide ``total``), each with its rows. The tensors'
    pieces are views: nothing is copied."""
    return [
        (_piece(batch, start, min(start + size, total)), min(size, total - start))
        for start in range(0, total, size)
    ]


def _tensors(batch: object, path: str) -> Iterator[tuple[str, torch.Tensor]]:
    """Every tensor with a dim 0 in ``batch``, with the path that names it in messages."""
    if isinstance(batch, torch.Tensor):
        if batch.dim() > 0:
            yield path, batch
    elif isinstance(batch, Mapping):
        for key, value in batch.items():
            yield from _tensors(value, f"{path}[{key!r}]")
    elif isinstance(batch, (list, tuple)):
        for index, value in enumerate(batch):
            yield from _tensors(value, f"{path}[{index}]")
    elif dataclasses.is_dataclass(batch) and not isinstance(batch, type):
        for field in dataclasses.fields(batch):
            yield from _tensors(getattr(batch, field.name), f"{path}.{field.name}")


def _piece(batch: Any, start: int, stop: int) -> Any:
    """Rows ``start`` to ``stop`` of ``batch``, in containers of its types."""
    if isinstance(batch, torch.Tensor):
        return batch[start:stop] if batch.dim() > 0 else batch
    if isinstance(batch, Mapping):
        cut = {key: _piece(value, start, stop) for key, value in batch.items()}
        return cut if type(batch) is dict else type(batch)(cut)  # type: ignore[call-arg]
    if isinstance(batch, tuple):
        items = [_piece(value, start, stop) for value in batch]
        return type(batch)(*items) if hasattr(batch, "_fields") else type(batch)(items)
    if isinstance(batch, list):
        return [_piece(value, start, stop) for value in batch]
    if dataclasses.is_dataclass(batch) and not isinstance(batch, type):
        changes = {
            field.name: _piece(getattr(batch, field.name), start, stop)
            for field in dataclasses.fields(batch)
            if field.init
        }
        return dataclasses.replace(batch, **changes)
    return batch
