"""How an epoch's iterable resumes at a loaded position: by itself, by skipping its batch
sampler's indices, or by drawing and dropping what was trained on already.

- An iterable that saves and restores its own position (``state_dict`` and
  ``load_state_dict``: torchdata's ``StatefulDataLoader``, the ``Stateful`` protocol of
  ``torch.distributed.checkpoint``) is not skipped for: its loaded state resumes it. Where
  its iterator reports how far into the epoch it stands (a DataLoader iterator's count of
  batches yielded), that must be the accumulator's position. Accelerate's prepared
  DataLoader has both methods whatever it wraps: it restores itself only over a
  ``StatefulDataLoader`` (`gradaccum.foreign.prepared_loader`).
- A ``torch.utils.data.DataLoader`` over a map-style dataset skips at the index level: its
  batch sampler's first batches are drawn as indices and dropped (a ``BatchSampler``'s by
  stepping over its sampler's indices, without building a batch), and the rest are loaded
  by a DataLoader with the same settings, so no skipped sample is loaded.
- Any other iterable is drawn from and the microbatches trained on already are dropped.

A DataLoader with persistent workers resumes its order exactly only if that order is not
drawn from the generator of its workers' seed: see `workers_seed_refusal`, which a resumed
run raises and `Accumulator.state_dict` warns with.

`global_order` reads where an epoch's microbatches lie in one order of its samples over all
the ranks, so that a state saved on one number of ranks resumes on another.
"""

from __future__ import annotations

import functools
import inspect
import itertools
from collections.abc import Iterable, Iterator, Sized
from typing import Any, TypeVar

import torch
from torch.utils.data import BatchSampler, DataLoader, DistributedSampler, IterableDataset

from gradaccum import foreign
from gradaccum.errors import ConfigError, ConfigTypeError, describe, warn
from gradaccum.order import GlobalOrder

__all__ = [
    "check_workers_seed",
    "global_order",
    "loader_state",
    "restores_own_position",
    "resumed",
    "workers_seed_refusal",
]

T = TypeVar("T")

# The DataLoader settings that the index-level skip passes on as they are. The others are
# the batch sampler's (which it wraps) or the loader's own lifetime (persistent_workers:
# the skipping loader lives for one epoch).
_SETTINGS = (
    "num_workers",
    "collate_fn",
    "pin_memory",
    "timeout",
    "worker_init_fn",
    "multiprocessing_context",
    "generator",
    "prefetch_factor",
    "pin_memory_device",
    "in_order",
)
_IN_THE_BATCH_SAMPLER = ("batch_size", "shuffle", "sampler", "batch_sampler", "drop_last")


def restores_own_position(iterable: object) -> bool:
    """The iterable saves and restores its own position in the epoch, so the accumulator
    does not skip for it: it has ``state_dict`` and ``load_state_dict`` methods (for
    Accelerate's prepared DataLoader, which always has them, the loader it wraps)."""
    wrapped = foreign.prepared_loader(iterable)
    if wrapped is not None:
        return restores_own_position(wrapped)
    return callable(getattr(iterable, "state_dict", None)) and callable(
        getattr(iterable, "load_state_dict", None)
    )


def loader_state(loader: object) -> dict[str, Any] | None:
    """The state to save for ``loader`` in a checkpoint, or None when it has none to save.

    A loader that keeps its own position (torchdata's ``StatefulDataLoader``, Accelerate's
    prepared loader over one) gives its ``state_dict()``: load it back into the fresh
    loader when resuming mid-epoch. Any other loader gives None: the accumulator skips
    the trained microbatches for it. Accelerate's prepared loader over a plain
    ``DataLoader`` has a ``state_dict`` method that raises ``AttributeError``; it gives
    None here.

    Args:
        loader: The iterable the loop passes to ``acc.epoch``: a DataLoader, a prepared
            or stateful one, a list.

    Returns:
        ``loader.state_dict()`` for a loader that restores its own position, else None.

    Raises:
        ConfigTypeError: ``loader`` is None or an iterator (``iter(loader)``), whose state
            is not the loader's.

    Example:
        >>> from torch.utils.data import DataLoader
        >>> loader_state(DataLoader(range(8), batch_size=2)) is None
        True
    """
    if loader is None or isinstance(loader, Iterator):
        msg = (
            f"loader must be the iterable you pass to acc.epoch(), got {describe(loader)}; "
            f"pass the loader itself, not None or an iterator over it"
        )
        raise ConfigTypeError(msg)
    if not restores_own_position(loader):
        return None
    state = loader.state_dict()  # type: ignore[attr-defined]
    return dict(state)


def global_order(iterable: object, length: int | None, world_size: int) -> GlobalOrder | None:
    """The global order of the epoch ``iterable`` is about to hand out (``length``
    microbatches per rank, agreed; None: unsized) on ``world_size`` data-parallel ranks: what
    its ``global_order()`` method declares, or, for a ``DataLoader`` whose sampler is a
    ``DistributedSampler`` (of exactly that type: a subclass may order otherwise), what its
    sampler and batch size make it. None where neither, or where the order is not sharded
    over these ranks into ``length`` microbatches: not known.

    Raises:
        ConfigTypeError: ``global_order()`` returned something else than a `GlobalOrder`.
    """
    declare = getattr(iterable, "global_order", None)
    if callable(declare):
        order = declare()
        if not isinstance(order, GlobalOrder):
            msg = (
                f"the epoch's iterable's global_order() must return a gradaccum.GlobalOrder, "
                f"got {describe(order)}"
            )
            raise ConfigTypeError(msg)
    elif (
        isinstance(iterable, DataLoader)
        and type(iterable.sampler) is DistributedSampler
        and iterable.batch_size is not None
    ):
        sampler, batch = iterable.sampler, iterable.batch_size
        per_rank = sampler.num_samples  # the permutation, padded or cut to the ranks
        if iterable.drop_last:  # and the loader drops a last, shorter batch
            per_rank -= per_rank % batch
        data = (
            f"DistributedSampler(shuffle={sampler.shuffle}, seed={sampler.seed}) of "
            f"{len(sampler.dataset)} samples"  # type: ignore[arg-type]
        )
        epoch = sampler.epoch if sampler.shuffle else None
        order = GlobalOrder(
            data, epoch, per_rank * sampler.num_replicas, batch, sampler.num_replicas
        )
    else:
        return None
    if order.world_size != world_size or order.microbatches != length:
        return None
    return order


def resumed(
    iterable: Iterable[T], skip: int, *, resumes_run: bool = False, handed_out: bool = False
) -> Iterator[T]:
    """An iterator over ``iterable``'s epoch from microbatch ``skip`` on; with
    ``resumes_run`` the first epoch of a run resumed past its start; with ``handed_out``
    the state was saved with microbatch ``skip`` handed out (at the top of the loop body,
    also at ``skip`` 0), so the saved run had drawn it too.

    Raises:
        ConfigError: ``iterable`` restores its own position and its iterator stands
            elsewhere, or it ends before ``skip`` (drawn and dropped), or (resuming a
            run) it cannot resume its order (`check_workers_seed`).
    """
    if resumes_run:
        check_workers_seed(iterable)
    if restores_own_position(iterable):
        iterator = iter(iterable)
        _check_stands_at(iterator, skip, _fast_forwarded(iterable))
        return iterator
    if not (skip or handed_out):
        return iter(iterable)
    if isinstance(iterable, DataLoader) and _order_generator(iterable) is None:
        warn(
            "resuming mid-epoch over a DataLoader that shuffles with torch's global random "
            "state (its sampler has no generator): the resumed epoch's order is drawn "
            "anew, not the interrupted epoch's, so it skips and trains on other "
            "microbatches than the uninterrupted run; give the DataLoader a generator "
            "seeded at each epoch's start: DataLoader(data, shuffle=True, generator=order) "
            "and order.manual_seed(seed + epoch) before each epoch"
        )
    # The interrupted run drew what the epoch's start draws from torch's global random
    # state (a DataLoader's workers' seed, drawn when it makes its iterator), what its
    # trained microbatches drew, and what the one it had handed out drew (augmentation in
    # the main process), before the checkpoint's random state was saved: so that the
    # resumed run draws after that state as the interrupted one did, none of them moves it.
    loader = _index_skippable(iterable) if skip else None
    with torch.random.fork_rng(devices=[]):
        if loader is not None:
            iterator = iter(_skipping_loader(loader, skip))
        else:
            iterator = _drawn_and_dropped(iter(iterable), skip)
        if handed_out:
            iterator = _drawn_ahead(iterator)
    return iterator


def check_workers_seed(iterable: object) -> None:
    """Refuse to resume a run with a DataLoader whose persistent workers' seed is drawn from
    the generator its order comes from (`workers_seed_refusal`); warn when it is drawn from
    torch's global state.

    Raises:
        ConfigError: The order is drawn from that generator: every epoch from here on would
            be shuffled differently.
    """
    refusal = workers_seed_refusal(iterable)
    if refusal is not None:
        raise ConfigError(refusal)
    loader = _persistent(iterable)
    if loader is not None and loader.generator is None:
        warn(
            "the DataLoader has persistent_workers=True and no generator: its workers' seed "
            "is drawn from torch's global random state at this resumed run's first epoch, "
            "where the uninterrupted run drew none, so what draws from it afterwards "
            "(dropout) differs from the uninterrupted run; pass generator=torch.Generator() "
            "to the DataLoader"
        )


def workers_seed_refusal(iterable: object) -> str | None:
    """Why a run resumed past its start over ``iterable`` is refused, with the fix; None
    where it is not. The one decision of `check_workers_seed`, which raises it when a
    resumed run's first epoch begins, and of the warning `Accumulator.state_dict` gives
    when it saves a state that such an epoch would refuse.

    A DataLoader draws its workers' base seed from its ``generator`` (None: torch's global
    random state) whenever it creates an iterator, before the sampler draws the epoch's
    order. With persistent workers it creates one at its first epoch and reuses it, so the
    uninterrupted run draws that seed at its first epoch only; a resumed run draws it again
    at its own first (and a mid-epoch resume's skipping loader, which lives for one epoch,
    once more), where the uninterrupted run did not. That moves the order where it is drawn
    from that generator (the sampler's is the loader's, or both are None). Loaders that
    restore their own position are left to their state.
    """
    loader = _persistent(iterable)
    if loader is None or _order_generator(loader) is not loader.generator:
        return None
    source = "torch's global random state" if loader.generator is None else "its generator"
    return (
        "the DataLoader has persistent_workers=True and draws its order from the "
        f"generator its workers' seed is drawn from ({source}): a DataLoader draws "
        "that seed when it starts its workers, so a resumed run draws it where the "
        "uninterrupted run did not, and shuffles every epoch from here on differently. "
        "Give the sampler a generator of its own, seeded at each epoch's start: "
        "DataLoader(data, sampler=RandomSampler(data, generator=order), "
        "generator=torch.Generator(), persistent_workers=True, ...), or pass "
        "persistent_workers=False"
    )


def _persistent(iterable: object) -> DataLoader[Any] | None:
    """``iterable`` if it is a DataLoader with persistent workers that does not restore its
    own position."""
    if (
        isinstance(iterable, DataLoader)
        and iterable.persistent_workers
        and iterable.num_workers > 0
        and not restores_own_position(iterable)
    ):
        return iterable
    return None


_NO_GENERATOR = object()


def _order_generator(loader: DataLoader[Any]) -> object:
    """The generator ``loader``'s order is drawn from, where its sampler (or batch sampler)
    has one (None: torch's global random state, as a ``RandomSampler`` without one draws
    from); otherwise a sentinel that is no generator."""
    source: object = loader.batch_sampler if loader.batch_sampler is not None else loader.sampler
    sampler = getattr(source, "sampler", source)  # a BatchSampler's
    return getattr(sampler, "generator", _NO_GENERATOR)


def _fast_forwarded(iterable: object) -> bool:
    """``iterable`` is a loader over an ``IterableDataset`` without a state of its own, which
    torchdata's ``StatefulDataLoader`` restores by drawing the batches yielded already
    again, and counting them on top of the restored count (torchdata 0.11: 6 + 6 = 12)."""
    wrapped = foreign.prepared_loader(iterable)
    dataset = getattr(iterable if wrapped is None else wrapped, "dataset", None)
    return isinstance(dataset, IterableDataset) and not restores_own_position(dataset)


def _check_stands_at(iterator: Iterator[Any], skip: int, fast_forwarded: bool) -> None:
    """Refuse an iterator whose own count of microbatches yielded (a DataLoader iterator's
    ``_num_yielded``, which torchdata's restores) is not the accumulator's position (twice
    it where the loader was ``fast_forwarded``)."""
    yielded = getattr(iterator, "_num_yielded", None)
    if type(yielded) is int and yielded != skip and not (fast_forwarded and yielded == 2 * skip):
        msg = (
            f"the epoch's iterable restores its own position and stands at microbatch "
            f"{yielded} of its epoch, but the accumulator resumes at microbatch {skip}; "
            "load the iterable's state_dict() saved at the same point as the accumulator's "
            "(after the `with` block of a window's last microstep, or between epochs)"
        )
        raise ConfigError(msg)


def _index_skippable(iterable: object) -> DataLoader[Any] | None:
    """``iterable`` if it is a plain DataLoader whose batches come from a batch sampler
    over a map-style dataset, and this torch's DataLoader takes no setting unknown here."""
    if (
        type(iterable) is DataLoader
        and iterable.batch_sampler is not None
        and not isinstance(iterable.dataset, IterableDataset)
        and _knows_every_setting()
    ):
        return iterable
    return None


def _parameters() -> set[str]:
    return set(inspect.signature(DataLoader.__init__).parameters)


@functools.cache
def _knows_every_setting() -> bool:
    """Every parameter of ``DataLoader()`` is passed on or belongs to the batch sampler (a
    newer torch with a setting unknown here draws and drops instead)."""
    known = {"self", "dataset", "persistent_workers", *_SETTINGS, *_IN_THE_BATCH_SAMPLER}
    return _parameters() <= known


def _skipping_loader(loader: DataLoader[T], skip: int) -> DataLoader[T]:
    """A DataLoader like ``loader`` whose batch sampler skips its first ``skip`` batches."""
    settings = {name: getattr(loader, name) for name in _SETTINGS if name in _parameters()}
    batches = _SkipBatches(loader.batch_sampler, skip)  # type: ignore[arg-type]
    return DataLoader(loader.dataset, batch_sampler=batches, **settings)


class _SkipBatches:
    """A batch sampler's batches after its first ``skip``: their indices are drawn, so the
    order is that of the whole epoch (the same shuffle), but no sample is loaded."""

    def __init__(self, batches: Iterable[list[int]], skip: int) -> None:
        self.batches = batches
        self.skip = skip

    def __iter__(self) -> Iterator[list[int]]:
        if type(self.batches) is BatchSampler:
            return _batched_after(self.batches, self.skip)
        # Another batch sampler's batches are opaque: each skipped one is built, then dropped.
        return itertools.islice(iter(self.batches), self.skip, None)

    def __len__(self) -> int:
        if not isinstance(self.batches, Sized):
            msg = f"the batch sampler {type(self.batches).__name__} has no len()"
            raise TypeError(msg)
        return max(0, len(self.batches) - self.skip)


def _batched_after(batches: BatchSampler, skip: int) -> Iterator[list[int]]:
    """What ``batches`` yields after its first ``skip`` batches, without building them: every
    skipped batch is full (a short one can only be last), so they are the sampler's first
    ``skip * batch_size`` indices, stepped over by ``islice`` at C speed (a list per skipped
    batch cost about 0.3 us each); the rest is batched as `BatchSampler.__iter__` does. A
    generator, so that, as with a BatchSampler, nothing is drawn from the sampler before the
    first ``next()``: a DataLoader draws its workers' seed after ``iter()`` of its batch
    sampler, and before its order."""
    indices = iter(batches.sampler)
    size = batches.batch_size
    next(itertools.islice(indices, skip * size, skip * size), None)
    if batches.drop_last:
        yield from map(list, zip(*[indices] * size, strict=False))
    else:
        yield from iter(lambda: [*itertools.islice(indices, size)], [])


def _drawn_ahead(iterator: Iterator[T]) -> Iterator[T]:
    """``iterator`` with its next item drawn now (an exhausted one as it is)."""
    first = next(iterator, _ENDED)
    return iterator if first is _ENDED else itertools.chain([first], iterator)


_ENDED: Any = object()


def _drawn_and_dropped(iterator: Iterator[T], skip: int) -> Iterator[T]:
    """``iterator`` after drawing and dropping the ``skip`` microbatches trained already.

    Raises:
        ConfigError: It ends before.
    """
    drawn = sum(1 for _ in itertools.islice(iterator, skip))
    if drawn < skip:
        msg = (
            f"the loaded state resumes at microbatch {skip} of the epoch, but the iterable "
            f"ended after {drawn}; pass the same data"
        )
        raise ConfigError(msg)
    return iterator
