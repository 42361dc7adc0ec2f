"""The global order of an epoch's samples over the data-parallel ranks, and where a state
saved on one number of ranks resumes on another (integers only, no torch).

A `GlobalOrder` says how the ranks' microbatches walk one order of the epoch's samples that
does not depend on their number ``V``: the ``j``-th microbatches of the ``V`` ranks
together hold its positions ``j*V*b`` up to ``(j+1)*V*b`` (``b`` on each rank), the last
ones what is left up to the order's end. A ``DistributedSampler`` shards this way: rank
``r`` takes positions ``r, r + V, ...`` of the epoch's permutation repeated cyclically
(``drop_last=False`` pads it with its first samples) or cut (``drop_last=True``) to a
multiple of ``V``, so a position below both ends holds the same sample on any number of
ranks.

So a window of ``steps`` microbatches on ``V`` ranks holds ``steps*V*b`` consecutive
positions, and after ``k`` microbatches on every rank the job has trained the first
``k*V*b``. On ``V'`` ranks with ``steps' = steps*V/V'`` the windows from the same position
hold the same positions, as long as the epoch's end cuts them alike: `Windows` is that cut,
compared whole (its samples, and in mean mode what each weighs) by `Rescale.check`.
"""

from __future__ import annotations

from dataclasses import dataclass
from fractions import Fraction

from gradaccum.errors import ConfigError, ConfigTypeError, describe
from gradaccum.schedule import check_count, check_positive, divisors, listed

__all__ = ["GlobalOrder", "Rescale", "Windows", "ranks_text", "windows"]


@dataclass(frozen=True)
class GlobalOrder:
    """How the ranks' microbatches of an epoch walk one global order of its samples: what an
    iterable declares, with a ``global_order()`` method that returns one, so that a state
    saved on one number of ranks resumes on another (`Accumulator.load_state_dict` with
    ``allow_world_size_change``). A ``DataLoader`` over a ``DistributedSampler`` needs none:
    gradaccum reads its sampler.

    The ``j``-th microbatches of the ``world_size`` ranks together hold the order's positions
    ``j*world_size*batch_size`` up to ``(j+1)*world_size*batch_size`` (``batch_size`` on
    each rank), the last ones what is left up to ``samples`` (as many on each rank); a
    position holds the same sample whatever the number of ranks, as with a
    ``DistributedSampler``'s rank ``r`` taking positions ``r, r + world_size, ...``.

    Args:
        data: What is ordered, the same every epoch and on any number of ranks (a resume
            mid-epoch needs the same): e.g. ``"DistributedSampler(shuffle=True, seed=0) of
            1000 samples"``.
        epoch: The epoch this order was drawn for (a ``DistributedSampler``'s
            ``set_epoch``), or None where every epoch has the same order.
        samples: The positions the ranks' microbatches hold this epoch: a multiple of
            ``world_size``.
        batch_size: Positions per rank and microbatch (the last microbatch may hold fewer).
        world_size: The ranks the order is sharded over.

    Raises:
        ConfigTypeError, ConfigError: A field has the wrong type or value.

    Examples:
        >>> order = GlobalOrder("my corpus, seed 0", epoch=3, samples=1000, batch_size=8,
        ...                     world_size=4)
        >>> order.microbatches  # per rank: 31 of 8 samples, then one of 2
        32
    """

    data: str
    epoch: int | None
    samples: int
    batch_size: int
    world_size: int

    def __post_init__(self) -> None:
        if not isinstance(self.data, str):
            msg = f"data must be a str that names what is ordered, got {describe(self.data)}"
            raise ConfigTypeError(msg)
        if self.epoch is not None:
            check_count(self.epoch, "epoch")
        check_count(self.samples, "samples")
        check_positive(self.batch_size, "batch_size")
        check_positive(self.world_size, "world_size")
        if self.samples % self.world_size:
            msg = (
                f"samples must be a multiple of world_size (as many positions on each rank), "
                f"got samples={self.samples} and world_size={self.world_size}"
            )
            raise ConfigError(msg)

    @property
    def microbatches(self) -> int:
        """Microbatches per rank."""
        return -(-self.samples // self.row)

    @property
    def row(self) -> int:
        """Positions in the ``j``-th microbatches of all the ranks together."""
        return self.world_size * self.batch_size

    def trained_after(self, position: int) -> int:
        """The positions the first ``position`` microbatches of every rank hold."""
        return min(position * self.row, self.samples)

    def named(self) -> str:
        """``data`` and the epoch, for messages."""
        return self.data if self.epoch is None else f"{self.data}, epoch {self.epoch}"


@dataclass(frozen=True)
class Windows:
    """How the trained rest of an epoch is cut into windows, as positions of its order:
    ``full`` windows of ``size`` positions from ``start``, each of whole microbatches (in
    mean mode every position weighs ``1/size``), then, where the epoch ends otherwise, one
    ``last`` window: its runs of (positions, the weight of each in mean mode). A window
    that holds the epoch's last, shorter microbatches weighs those more (their loss is a
    mean over fewer samples, divided by the window's microbatches like any other)."""

    start: int
    size: int
    full: int
    last: tuple[tuple[int, Fraction], ...] = ()

    @property
    def end(self) -> int:
        """Where the trained windows end."""
        return self.start + self.full * self.size + sum(count for count, _ in self.last)

    def same_samples(self, other: Windows) -> bool:
        """Both cut the same positions into the same windows (what ``num_items`` needs)."""
        return (self.start, self.size, self.full, self.end) == (
            other.start,
            other.size,
            other.full,
            other.end,
        )

    def __str__(self) -> str:
        cut = [f"{self.full} window{'s' if self.full > 1 else ''} of {self.size} samples"]
        if self.last:
            count = sum(count for count, _ in self.last)
            if len(self.last) == 1:
                weights = f"each weighing {self.last[0][1]}"
            else:
                weights = ", ".join(f"{count} weighing {weight}" for count, weight in self.last)
            cut.append(f"a last window of {count} samples ({weights})")
        if not self.full:
            cut.pop(0)
        return f"{', then '.join(cut) or 'no window'}, from sample {self.start}"


def windows(order: GlobalOrder, start: int, steps: int, drop_last: bool) -> Windows:
    """The windows of ``steps`` microbatches that the rest of an epoch over ``order`` is cut
    into from microbatch ``start`` (per rank, at most ``order.microbatches``), as the
    accumulator cuts them: the trailing ones that do not fill a window dropped
    (``drop_last``), or one shorter window."""
    row = order.row
    short = order.samples % row  # the last microbatches' positions, when they are fewer
    count, rest = divmod(order.microbatches - start, steps)
    begin = order.trained_after(start)
    size = steps * row
    # The window with the short microbatches is not a full one; it is trained unless it
    # is a trailing one of fewer than steps microbatches that drop_last drops.
    if rest and not drop_last:
        last = _runs(rest, row, short)
    elif short and not rest and count:
        count, last = count - 1, _runs(steps, row, short)
    else:
        last = ()
    return Windows(begin, size, count, last)


def _runs(microbatches: int, row: int, short: int) -> tuple[tuple[int, Fraction], ...]:
    """A window of ``microbatches``, the last holding ``short`` positions (0: a whole one),
    as runs of (positions, weight in mean mode): a microbatch's loss is the mean over its
    samples, divided by the window's microbatches and averaged over the ranks. (The short
    run's weight is never the whole ones': ``short < row``.)"""
    whole = microbatches - (short > 0)
    runs = [(whole * row, Fraction(1, microbatches * row))] if whole else []
    if short:
        runs.append((short, Fraction(1, microbatches * short)))
    return tuple(runs)


def ranks_text(count: int) -> str:
    """``"1 rank"``, ``"4 ranks"``: for messages."""
    return f"{count} rank{'s' if count != 1 else ''}"


@dataclass(frozen=True)
class Rescale:
    """A state saved on ``world_size`` ranks with ``steps``, loaded on another number of
    ranks: where its epoch resumes there, checked against the next epoch's order when it
    begins.

    Attributes:
        order: The order of the epoch the state was saved in (between epochs: of the last
            epoch run); None where the iterable declared none.
        trained: The positions of that order trained: the global position in samples
            (0 between epochs).
        world_size: The ranks the state was saved on.
        steps: Its ``steps``.
        by_items: Its windows passed ``num_items`` (the last one closed); None: no window
            closed yet.
    """

    order: GlobalOrder | None
    trained: int
    world_size: int
    steps: int
    by_items: bool | None

    def skip(self, world_size: int) -> int:
        """The microbatches of each of ``world_size`` ranks that hold the trained positions.

        Raises:
            ConfigError: The position falls inside a microbatch there (windows were cut
                from a position that these ranks' microbatches do not start at).
        """
        if not self.trained or self.order is None:
            return 0
        row = world_size * self.order.batch_size
        skip, inside = divmod(self.trained, row)
        if inside and self.trained != self.order.samples:  # (the order's end: all trained)
            working = [
                ranks
                for ranks in divisors(self.world_size * self.steps)
                if self.trained % (ranks * self.order.batch_size) == 0
            ]
            msg = (
                f"the loaded state resumes after sample {self.trained} of its epoch's order, "
                f"which falls inside a microbatch of {ranks_text(world_size)} ({world_size} x "
                f"{self.order.batch_size} = {row} samples each): its windows were cut from a "
                f"position that {ranks_text(world_size)} do not reach (steps was changed "
                f"mid-epoch); resume on {listed(working)} rank{'s' if working != [1] else ''}, "
                "or from a checkpoint between epochs"
            )
            raise ConfigError(msg)
        return skip + (inside > 0)

    def check(
        self, here: GlobalOrder | None, steps: int, drop_last: bool, *, restores_itself: bool
    ) -> None:
        """Refuse an epoch over ``here`` (None: its order is not known), on ``steps``, that
        would not continue the saved run exactly: mid-epoch, the same order from the same
        position, cut into the same windows to the epoch's end; and an epoch of the same
        data cut alike, which the epochs after it are.

        Raises:
            ConfigError: What differs, with the numbers and what would work.
        """
        saved, ranks = self.order, ranks_text(self.world_size)
        as_saved = f"resume on {ranks} with steps={self.steps}, as saved"
        if self.trained and saved is not None:
            where = f"the loaded state resumes after sample {self.trained} of {saved.named()}"
            if restores_itself:
                msg = (
                    f"{where}, saved on {ranks}, but this epoch's iterable restores its own "
                    "position from a state that each of those ranks saved, which does not "
                    "carry over to another number of ranks; pass a DataLoader over a "
                    f"DistributedSampler (gradaccum skips its trained samples), or {as_saved}"
                )
                raise ConfigError(msg)
            if here is None:
                msg = (
                    f"{where}, but this epoch's iterable does not declare its global order (a "
                    "DataLoader over a DistributedSampler sharded over the ranks that average "
                    "the gradients, or an iterable with len() and a global_order() method), "
                    f"so where that sample falls on these ranks is not known; pass such an "
                    f"iterable, or {as_saved}"
                )
                raise ConfigError(msg)
            if (here.data, here.epoch) != (saved.data, saved.epoch):
                msg = (
                    f"{where}, but this epoch's order is {here.named()}; pass the data the "
                    "state was saved with, in the epoch's order (with a DistributedSampler, "
                    f"call sampler.set_epoch({saved.epoch}) before the epoch)"
                )
                raise ConfigError(msg)
            self._check_batch_size(here)
            skip = self.skip(here.world_size)
            if skip > here.microbatches:
                msg = (
                    f"{where}, but on {ranks_text(here.world_size)} this epoch holds only "
                    f"{here.samples} samples (the sampler cuts the order to a multiple of the "
                    f"ranks); {as_saved}"
                )
                raise ConfigError(msg)
            start = -(-self.trained // saved.row)
            self._compare(
                windows(saved, start, self.steps, drop_last),
                windows(here, skip, steps, drop_last),
                "the rest of this epoch",
                here,
                steps,
            )
        if saved is not None and here is not None and saved.data == here.data:
            self._check_batch_size(here)
            self._compare(
                windows(saved, 0, self.steps, drop_last),
                windows(here, 0, steps, drop_last),
                "an epoch of this data",
                here,
                steps,
            )

    def _check_batch_size(self, here: GlobalOrder) -> None:
        saved = self.order
        assert saved is not None
        if here.batch_size != saved.batch_size:
            msg = (
                f"the loaded state was saved with batches of {saved.batch_size} samples per "
                f"rank, but this epoch's are of {here.batch_size}; the windows keep the "
                f"global batch of {self.steps * saved.row} samples only with the batch size "
                f"they were saved with: pass batch_size={saved.batch_size}"
            )
            raise ConfigError(msg)

    def _compare(
        self, saved: Windows, here: Windows, what: str, order: GlobalOrder, steps: int
    ) -> None:
        """Refuse ``here`` unless it cuts what ``saved`` cut (with ``num_items``: the same
        samples in the same windows, whatever each weighs)."""
        if saved == here or (self.by_items and saved.same_samples(here)):
            return
        assert self.order is not None
        ranks = ranks_text(order.world_size)
        if saved.same_samples(here):
            why = (
                "the same samples, weighed otherwise in mean mode: a last window that holds "
                "the epoch's last, shorter microbatches weighs their samples more (this "
                "resume would be exact with num_items)"
            )
        elif self.order.samples != order.samples:
            why = (
                f"the order holds {self.order.samples} samples on {ranks_text(self.world_size)} "
                f"and {order.samples} on {ranks} (the sampler pads or cuts it to a multiple "
                "of the ranks, and the loader's drop_last may drop a last, shorter batch)"
            )
        else:
            why = "the epoch's end cuts the windows otherwise"
        msg = (
            f"on {ranks_text(self.world_size)} (steps={self.steps}) {what} is {saved}, but on "
            f"{ranks} (steps={steps}) it would be {here}: {why}; resume on "
            f"{ranks_text(self.world_size)} with steps={self.steps}, as saved"
        )
        raise ConfigError(msg)
