"""The checkpoint record: the saved format of `Accumulator.state_dict`, its versions, and
its parsing, validated whole before anything is loaded (no torch: tensors are opaque).

Version 8 (this one): ``position`` is where the next window starts, or with a ``window``
the microbatches its saved gradient holds; a microbatch handed out but not yet
back-propagated is not counted, so the resumed epoch hands it out again. The rest of the
epoch is cut into windows from ``position`` with the saved ``steps``, which is what the
uninterrupted run does after a ``steps`` change. ``epochs_completed`` counts the epochs run
to their end, so the loop knows which epoch it resumes. ``world_size`` is the number of
data-parallel ranks the state was saved on, and ``epoch_length`` the length (microbatches
per rank) of the sized epoch that ``position`` lies in (None between epochs and for an
iterable without ``len``): a resume on another world size is refused when loading, and a
position in an epoch of another length when that epoch begins, unless the load opts in to
another world size. For that, ``global_order`` is the order of the samples that the epoch
``position`` lies in walks over all the ranks (or of the last epoch run, between epochs:
what the next epoch is compared with), where the loader lets the accumulator know it
(`gradaccum.order`), and ``global_position`` the samples of it trained (where it is not
known: ``global_order``'s fields and ``global_position`` are None);
``by_items`` is whether the last window closed passed ``num_items``; ``handed_out``
whether a microbatch had been handed out and not yet back-propagated (a state saved at the
top of the loop body, also of an epoch's first microbatch, at ``position`` 0): the
uninterrupted run drew it, and made the epoch's iterator, before the random state saved
with the state, so the resumed epoch draws it again where that does not move the random
state, as it draws the microbatches trained. ``microbatch`` is the rows per microbatch of
`Accumulator.step` (fixed, or found by ``microbatch="auto"``; None: the whole batch, or not
found yet).

Versions 1 to 7 load the same way, with nothing recorded to check (no ``world_size`` or
``epoch_length`` before 5, no ``global_order`` before 6, so that a state saved mid-epoch
resumes on its own world size only), no epoch completed (no ``epochs_completed`` before
4, no ``skipped_steps`` in 1), nothing ``handed_out`` (before 7) and no ``microbatch``
(before 8).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from copy import copy
from dataclasses import dataclass, fields
from typing import Any, TypedDict, cast

from typing_extensions import NotRequired

from gradaccum.errors import ConfigError, ConfigTypeError, GradaccumError, describe
from gradaccum.order import GlobalOrder, Rescale, ranks_text
from gradaccum.schedule import check_bool, check_count, check_positive, check_steps, kept_on

__all__ = [
    "VERSION",
    "Checkpoint",
    "OrderDict",
    "SavedWindow",
    "StateDict",
    "WindowDict",
    "parse",
]

VERSION = 8


class OrderDict(TypedDict):
    """A `GlobalOrder` as saved (its ``world_size`` is the state's), or every field None
    where the order is not known: the same keys either way, as
    ``torch.distributed.checkpoint`` needs (it loads into the keys of a fresh accumulator's
    state)."""

    data: str | None
    epoch: int | None
    samples: int | None
    batch_size: int | None


class WindowDict(TypedDict):
    """An open window as saved: its progress, losses, item counts and gradients."""

    microsteps: int
    size: int
    divisor: int
    by_items: bool
    items: list[Any]
    losses: list[Any]
    grads: list[Any]


class StateDict(TypedDict):
    """What `Accumulator.state_dict` returns (``world_size``, ``epoch_length``,
    ``global_position`` and ``by_items``: None where not recorded, and the fields of
    ``global_order``)."""

    version: int
    steps: int
    position: int
    global_step: int
    skipped_steps: int
    epochs_completed: int
    drop_last: bool
    sync: str
    world_size: int | None
    epoch_length: int | None
    global_order: OrderDict
    global_position: int | None
    by_items: bool | None
    handed_out: bool
    microbatch: int | None
    window: NotRequired[WindowDict]


@dataclass(frozen=True)
class SavedWindow:
    """An open window, in memory."""

    microsteps: int
    size: int
    divisor: int
    by_items: bool
    items: list[Any]
    losses: list[Any]
    grads: list[Any]

    def to_dict(self) -> WindowDict:
        """The saved form: the same fields (lists copied, tensors shared)."""
        saved = {field.name: getattr(self, field.name) for field in fields(self)}
        return cast(WindowDict, {key: copy(value) for key, value in saved.items()})


@dataclass(frozen=True)
class Checkpoint:
    """An accumulator's state, in memory.

    Attributes:
        world_size: The data-parallel ranks it was saved on; None: not recorded (before
            version 5), so not checked.
        epoch_length: The length of the sized epoch that ``position`` lies in; None: no
            position to resume, an epoch without ``len``, or not recorded.
        order: The global order of the epoch ``position`` lies in (between epochs: of the
            last epoch run); None: not known, or not recorded (before version 6).
        global_position: The samples of ``order`` trained; None with no ``order``.
        by_items: The last window closed passed ``num_items``; None: no window closed, or
            not recorded.
        handed_out: A microbatch had been handed out and not yet back-propagated (saved
            at the top of the loop body; False: not, or not recorded).
        microbatch: The rows per microbatch of `Accumulator.step` (fixed, or found by
            ``microbatch="auto"``); None: the whole batch, not found yet, or not recorded
            (before version 8).
    """

    steps: int
    position: int
    global_step: int
    skipped_steps: int
    drop_last: bool
    sync: str
    window: SavedWindow | None = None
    epochs_completed: int = 0
    world_size: int | None = None
    epoch_length: int | None = None
    order: GlobalOrder | None = None
    global_position: int | None = None
    by_items: bool | None = None
    handed_out: bool = False
    microbatch: int | None = None

    def to_dict(self) -> StateDict:
        state = StateDict(
            version=VERSION,
            steps=self.steps,
            position=self.position,
            global_step=self.global_step,
            skipped_steps=self.skipped_steps,
            epochs_completed=self.epochs_completed,
            drop_last=self.drop_last,
            sync=self.sync,
            world_size=self.world_size,
            epoch_length=self.epoch_length,
            global_order=_order_dict(self.order),
            global_position=self.global_position,
            by_items=self.by_items,
            handed_out=self.handed_out,
            microbatch=self.microbatch,
        )
        if self.window is not None:
            state["window"] = self.window.to_dict()
        return state

    def check_fits(
        self,
        *,
        world_size: int,
        steps: int,
        drop_last: bool,
        allow_steps_change: bool,
        allow_world_size_change: bool = False,
    ) -> Rescale | None:
        """Refuse to load into an accumulator on another number of data-parallel ranks
        (unless allowed, where the run can be continued there exactly), with another
        ``drop_last``, or with another ``steps`` unless allowed between windows.

        Returns:
            Where the state resumes on ``world_size`` ranks, when that is another number;
            None on the saved one.

        Raises:
            ConfigError: It does not fit, with the fix.
        """
        rescale = self._check_world_size(world_size, steps, allow_world_size_change)
        if self.drop_last != drop_last:
            msg = (
                f"the state was saved with drop_last={self.drop_last!r} but this "
                f"Accumulator has drop_last={drop_last!r}; construct it with "
                f"drop_last={self.drop_last!r} to resume"
            )
            raise ConfigError(msg)
        if rescale is not None or self.steps == steps:
            return rescale
        if allow_steps_change and self.window is None:
            return None
        msg = (
            f"the state was saved with steps={self.steps} but this Accumulator has "
            f"steps={steps}; construct it with steps={self.steps} to resume"
        )
        if self.window is not None:
            msg += " (it was saved mid-window, where steps cannot change)"
        else:
            msg += f", or pass allow_steps_change=True to keep steps={steps}"
        raise ConfigError(msg)

    def _check_world_size(self, world_size: int, steps: int, allowed: bool) -> Rescale | None:
        """Refuse another world size unless ``allowed``: the saved position counts each
        rank's microbatches of its own shard, and a window the microbatches of every rank
        (the global batch). Allowed, it resumes where the global window (``world_size *
        steps`` microbatches) is kept, the state was saved between windows and, mid-epoch,
        its global position is known."""
        if self.world_size is None or self.world_size == world_size:
            return None
        saved = ranks_text(self.world_size)
        rows = self.world_size * self.steps
        where = f"the state was saved with world_size={self.world_size} (data-parallel ranks)"
        if not allowed:
            msg = (
                f"{where} but this Accumulator has world_size={world_size}: its position "
                f"counts the microbatches of each rank's shard and its windows the global "
                f"batch of {saved}, which this run would not continue; resume on {saved}, as "
                f"saved, or pass allow_world_size_change=True to continue {kept_on(rows)} "
                "(the same global batch)"
            )
            raise ConfigError(msg)
        window = f"a global window of {self.world_size} x {self.steps} = {rows} microbatches"
        if rows % world_size:
            msg = (
                f"{where} and steps={self.steps}, {window}, which {ranks_text(world_size)} cannot "
                f"keep ({rows} is not a multiple of {world_size}); resume {kept_on(rows)}"
            )
            raise ConfigError(msg)
        if steps * world_size != rows:
            msg = (
                f"{where} and steps={self.steps}, {window}, but this Accumulator has "
                f"steps={steps} on {ranks_text(world_size)} ({world_size * steps} microbatches); "
                f"construct it with steps={rows // world_size} to keep the global batch "
                "(gradaccum.steps_for(global_batch, micro_batch, world_size))"
            )
            raise ConfigError(msg)
        if self.window is not None:
            msg = (
                f"{where} mid-window ({self.window.microsteps} of {self.window.size} "
                f"microsteps, include_grads=True): each rank's partial gradient holds its own "
                f"microbatches, which do not carry over to {ranks_text(world_size)}; resume on "
                f"{saved}, as saved, or from a checkpoint after a window's last microstep"
            )
            raise ConfigError(msg)
        if self.position and self.order is None:
            msg = (
                f"{where} at microbatch {self.position} of an epoch whose global order was not "
                "known (an iterable other than a DataLoader over a DistributedSampler, without "
                "a global_order() method, or a state from before version 6), so where the job "
                f"stands in its samples was not recorded; resume on {saved}, as saved, or from "
                "a checkpoint between epochs"
            )
            raise ConfigError(msg)
        rescale = Rescale(
            self.order, self.global_position or 0, self.world_size, self.steps, self.by_items
        )
        rescale.skip(world_size)  # refuses a position inside a microbatch there
        return rescale


def _order_dict(order: GlobalOrder | None) -> OrderDict:
    if order is None:
        return OrderDict(data=None, epoch=None, samples=None, batch_size=None)
    return OrderDict(
        data=order.data, epoch=order.epoch, samples=order.samples, batch_size=order.batch_size
    )


_UNKNOWN = _order_dict(None)


def _parse_order(
    saved: object, trained_at: object, world_size: int | None, position: int
) -> tuple[GlobalOrder | None, int | None]:
    """``state['global_order']`` and ``state['global_position']``, which must be where
    ``position`` stands in it."""
    if saved is None or saved == _UNKNOWN:
        if trained_at is not None:
            msg = f"state['global_position'] is {describe(trained_at)}, without a global_order"
            raise ConfigError(msg)
        return None, None
    fields = saved if isinstance(saved, Mapping) else {}
    try:
        if world_size is None or set(fields) != {"data", "epoch", "samples", "batch_size"}:
            raise ConfigError
        order = GlobalOrder(
            fields["data"], fields["epoch"], fields["samples"], fields["batch_size"], world_size
        )
    except GradaccumError:
        msg = (
            "state['global_order'] is not a global order from state_dict() (with a "
            f"world_size), got {describe(saved)}"
        )
        raise ConfigError(msg) from None
    trained = check_count(trained_at, "state['global_position']")
    if trained != order.trained_after(position):
        msg = (
            f"state['global_position'] is {trained}, but {position} microbatches of "
            f"{order.world_size} x {order.batch_size} samples into an epoch of {order.samples} "
            f"(state['position'], state['global_order']) are {order.trained_after(position)}"
        )
        raise ConfigError(msg)
    return order, trained


def parse(state: object, is_tensor: Callable[[object], bool]) -> Checkpoint:
    """Read ``state`` (from `Accumulator.state_dict`, any version) into a `Checkpoint`.

    Args:
        state: The mapping to read.
        is_tensor: Whether a value is a tensor (the losses and gradients of a window).

    Raises:
        ConfigTypeError: ``state`` is not a mapping.
        ConfigError: A field is missing or malformed; the message names its key.
    """
    if not isinstance(state, Mapping):
        msg = f"state must be a mapping from Accumulator.state_dict(), got {describe(state)}"
        raise ConfigTypeError(msg)
    version = check_count(state.get("version"), "state['version']")
    if version not in range(1, VERSION + 1):
        msg = (
            f"state['version'] is {version}, but this gradaccum reads versions 1 to "
            f"{VERSION}; load it with the gradaccum that saved it"
        )
        raise ConfigError(msg)
    steps = check_steps(state.get("steps"), "state['steps']")
    position = check_count(state.get("position"), "state['position']")
    global_step = check_count(state.get("global_step"), "state['global_step']")
    skipped = check_count(state.get("skipped_steps", 0), "state['skipped_steps']")
    if skipped > global_step:
        msg = f"state['skipped_steps'] is {skipped}, more than its {global_step} windows"
        raise ConfigError(msg)
    epochs = check_count(
        state.get("epochs_completed", 0 if version < 4 else None), "state['epochs_completed']"
    )
    drop_last = check_bool(state.get("drop_last"), "state['drop_last']")
    sync = state.get("sync", "auto")
    if not isinstance(sync, str):
        msg = f"state['sync'] must be a str, got {describe(sync)}"
        raise ConfigTypeError(msg)
    world_size, length = state.get("world_size"), state.get("epoch_length")
    if version < 5:  # neither recorded: nothing to check
        world_size = length = None
    if world_size is not None:
        world_size = check_positive(world_size, "state['world_size']")
    if length is not None:
        length = check_positive(length, "state['epoch_length']")
        if position > length:
            msg = f"state['epoch_length'] is {length}, less than its position {position}"
            raise ConfigError(msg)
    order, trained, by_items = None, None, None
    if version >= 6:
        order, trained = _parse_order(
            state.get("global_order"), state.get("global_position"), world_size, position
        )
        by_items = state.get("by_items")
        if by_items is not None:
            by_items = check_bool(by_items, "state['by_items']")
    handed_out = version >= 7 and check_bool(state.get("handed_out"), "state['handed_out']")
    microbatch = state.get("microbatch") if version >= 8 else None
    if microbatch is not None:
        microbatch = check_positive(microbatch, "state['microbatch']")
    saved = state.get("window")
    window = None if saved is None else _parse_window(saved, is_tensor)
    return Checkpoint(
        steps=steps,
        position=position,
        global_step=global_step,
        skipped_steps=skipped,
        drop_last=drop_last,
        sync=sync,
        window=window,
        epochs_completed=epochs,
        world_size=world_size,
        epoch_length=length,
        order=order,
        global_position=trained,
        by_items=by_items,
        handed_out=handed_out,
        microbatch=microbatch,
    )


def _parse_window(window: object, is_tensor: Callable[[object], bool]) -> SavedWindow:
    fields = window if isinstance(window, Mapping) else {}
    done, size, divisor = fields.get("microsteps"), fields.get("size"), fields.get("divisor")
    by_items, items, losses = fields.get("by_items"), fields.get("items"), fields.get("losses")
    grads = fields.get("grads")
    if not (
        type(done) is int
        and type(size) is int
        and type(divisor) is int
        and isinstance(by_items, bool)
        and isinstance(items, list)
        and isinstance(losses, list)
        and isinstance(grads, list)
        and 0 < done < size
        and divisor >= 1
        and len(losses) == done
        and len(items) == (done if by_items else 0)
        and all(type(item) is int or is_tensor(item) for item in items)
        and all(is_tensor(loss) for loss in losses)
        and all(grad is None or is_tensor(grad) for grad in grads)
    ):
        msg = f"state['window'] is not a window from state_dict(), got {describe(window)}"
        raise ConfigError(msg)
    return SavedWindow(done, size, divisor, by_items, list(items), list(losses), list(grads))
