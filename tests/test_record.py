"""The checkpoint record (gradaccum/record.py): its saved form, the versions it reads, and
its refusals, each naming the key at fault. Tensors are opaque to it, so a tiny stand-in
takes their place and these tests need no torch."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from gradaccum.errors import ConfigError, ConfigTypeError, GradaccumError
from gradaccum.order import GlobalOrder, Rescale
from gradaccum.record import VERSION, Checkpoint, SavedWindow, parse
from gradaccum.schedule import kept_on

ROOT = Path(__file__).resolve().parents[1]


class FakeTensor:
    """Stands in for a tensor: record.py only asks ``is_tensor`` about it."""

    __slots__ = ("name",)

    def __init__(self, name: str) -> None:
        self.name = name

    def __repr__(self) -> str:
        return f"FakeTensor({self.name!r})"


def is_tensor(value: object) -> bool:
    return isinstance(value, FakeTensor)


def never_tensor(value: object) -> bool:
    return False


fakes = st.builds(FakeTensor, st.text(max_size=3))
counts = st.integers(min_value=0, max_value=10**12)


@st.composite
def saved_windows(draw: st.DrawFn) -> SavedWindow:
    size = draw(st.integers(min_value=2, max_value=16))
    done = draw(st.integers(min_value=1, max_value=size - 1))
    by_items = draw(st.booleans())
    items = draw(st.lists(st.integers(0, 10**6) | fakes, min_size=done, max_size=done))
    return SavedWindow(
        microsteps=done,
        size=size,
        divisor=draw(st.integers(min_value=1, max_value=size)),
        by_items=by_items,
        items=items if by_items else [],
        losses=draw(st.lists(fakes, min_size=done, max_size=done)),
        grads=draw(st.lists(st.none() | fakes, max_size=4)),
    )


@st.composite
def orders(draw: st.DrawFn, world_size: int) -> GlobalOrder:
    return GlobalOrder(
        draw(st.text(max_size=8)),
        draw(st.none() | counts),
        world_size * draw(st.integers(0, 10**6)),
        draw(st.integers(1, 64)),
        world_size,
    )


@st.composite
def checkpoints(draw: st.DrawFn) -> Checkpoint:
    global_step, position = draw(counts), draw(counts)
    world_size = draw(st.none() | st.integers(min_value=1, max_value=4096))
    order = None if world_size is None else draw(st.none() | orders(world_size))
    trained = None if order is None else order.trained_after(position)
    return Checkpoint(
        steps=draw(st.integers(min_value=1, max_value=1024)),
        position=position,
        global_step=global_step,
        skipped_steps=draw(st.integers(min_value=0, max_value=global_step)),
        drop_last=draw(st.booleans()),
        sync=draw(st.sampled_from(["auto", "every", "boundary"])),
        window=draw(st.none() | saved_windows()),
        epochs_completed=draw(counts),
        world_size=world_size,
        epoch_length=draw(st.none() | st.integers(min_value=max(1, position), max_value=10**13)),
        order=order,
        global_position=trained,
        by_items=draw(st.none() | st.booleans()),
        handed_out=draw(st.booleans()),
        microbatch=draw(st.none() | st.integers(min_value=1, max_value=10**6)),
    )


def state(**changes: Any) -> dict[str, Any]:
    """A valid saved state with ``changes`` (a value of ``...`` removes the key)."""
    saved: dict[str, Any] = {
        "version": VERSION,
        "steps": 4,
        "position": 8,
        "global_step": 2,
        "skipped_steps": 0,
        "epochs_completed": 3,
        "drop_last": True,
        "sync": "auto",
        "world_size": 2,
        "epoch_length": 13,
        "handed_out": False,
    }
    saved.update(changes)
    return {key: value for key, value in saved.items() if value is not ...}


def window(**changes: Any) -> dict[str, Any]:
    """A valid saved window with ``changes`` (a value of ``...`` removes the key)."""
    saved: dict[str, Any] = {
        "microsteps": 2,
        "size": 4,
        "divisor": 4,
        "by_items": False,
        "items": [],
        "losses": [FakeTensor("a"), FakeTensor("b")],
        "grads": [FakeTensor("g"), None],
    }
    saved.update(changes)
    return {key: value for key, value in saved.items() if value is not ...}


class TestCheckpointToDict:
    @given(checkpoint=checkpoints())
    def test_parse_round_trips(self, checkpoint: Checkpoint) -> None:
        """parse() reads back exactly what to_dict() saved, window included."""
        assert parse(checkpoint.to_dict(), is_tensor) == checkpoint

    def test_the_saved_form(self) -> None:
        """to_dict() saves version 8 and the fields by name, the world size, the epoch
        length, the global order and position, the last window's mode always (None
        where not known), whether a microbatch was handed out, and acc.step's microbatch;
        no ``window`` key between windows."""
        saved = Checkpoint(
            steps=4,
            position=8,
            global_step=2,
            skipped_steps=1,
            drop_last=True,
            sync="auto",
            epochs_completed=5,
            world_size=2,
            epoch_length=13,
            order=GlobalOrder("corpus", 3, 104, 4, 2),
            global_position=64,
            by_items=True,
            handed_out=True,
            microbatch=16,
        ).to_dict()
        assert saved == {
            "version": 8,
            "steps": 4,
            "position": 8,
            "global_step": 2,
            "skipped_steps": 1,
            "epochs_completed": 5,
            "drop_last": True,
            "sync": "auto",
            "world_size": 2,
            "epoch_length": 13,
            "global_order": {"data": "corpus", "epoch": 3, "samples": 104, "batch_size": 4},
            "global_position": 64,
            "by_items": True,
            "handed_out": True,
            "microbatch": 16,
        }
        assert VERSION == 8

    def test_an_unknown_order_saves_the_same_keys(self) -> None:
        """Where the order is not known its fields are None under the same keys, so that
        torch.distributed.checkpoint, which loads into the keys of a fresh accumulator's
        state (no order known yet), finds every key it saved; both read back."""
        unknown = Checkpoint(4, 0, 2, 1, True, "auto").to_dict()
        known = Checkpoint(
            4, 0, 2, 1, True, "auto", None, 0, 2, None, GlobalOrder("c", 0, 8, 2, 2), 0
        ).to_dict()
        assert unknown["global_order"] == dict.fromkeys(known["global_order"])
        assert parse(unknown, is_tensor).order is None
        assert parse(known, is_tensor).order == GlobalOrder("c", 0, 8, 2, 2)

    def test_the_saved_window(self) -> None:
        """A saved window is a plain dict of its fields, in new lists: changing the saved
        form does not change the checkpoint."""
        loss, grad = FakeTensor("l"), FakeTensor("g")
        opened = SavedWindow(1, 4, 4, True, [3], [loss], [grad, None])
        checkpoint = Checkpoint(4, 1, 0, 0, False, "auto", opened)
        saved = checkpoint.to_dict()
        assert saved["window"] == {
            "microsteps": 1,
            "size": 4,
            "divisor": 4,
            "by_items": True,
            "items": [3],
            "losses": [loss],
            "grads": [grad, None],
        }
        saved["window"]["losses"].clear()
        saved["window"]["items"].append(5)
        saved["window"]["grads"].clear()
        assert opened == SavedWindow(1, 4, 4, True, [3], [loss], [grad, None])

    def test_parse_copies_the_lists(self) -> None:
        """The parsed window does not share its lists with the state it was read from."""
        saved = state(window=window())
        parsed = parse(saved, is_tensor)
        saved["window"]["losses"].clear()
        saved["window"]["grads"].clear()
        assert parsed.window is not None
        assert len(parsed.window.losses) == 2
        assert len(parsed.window.grads) == 2


class TestParseVersions:
    @pytest.mark.parametrize("version", [1, 2, 3, 4, 5, 6, 7, 8])
    def test_known_versions_load(self, version: int) -> None:
        """Versions 1 to 8 are read the same way."""
        parsed = parse(state(version=version), never_tensor)
        assert (parsed.steps, parsed.position, parsed.global_step) == (4, 8, 2)

    @pytest.mark.parametrize("version", [1, 2, 3, 4])
    def test_before_version_5_nothing_is_recorded_to_check(self, version: int) -> None:
        """Before version 5 neither the world size nor the epoch length was saved: they
        read as None (not checked), whatever the keys hold, and are not required."""
        parsed = parse(state(version=version, world_size=2, epoch_length=3), never_tensor)
        assert (parsed.world_size, parsed.epoch_length) == (None, None)
        parsed = parse(state(version=version, world_size=..., epoch_length=...), never_tensor)
        assert (parsed.world_size, parsed.epoch_length) == (None, None)

    def test_version_5_reads_the_world_size_and_the_epoch_length(self) -> None:
        """Version 5 reads both as saved; None (or absent) is not recorded."""
        parsed = parse(state(), never_tensor)
        assert (parsed.world_size, parsed.epoch_length) == (2, 13)
        parsed = parse(state(world_size=None, epoch_length=...), never_tensor)
        assert (parsed.world_size, parsed.epoch_length) == (None, None)

    @pytest.mark.parametrize("version", [1, 2, 3, 4, 5])
    def test_before_version_6_no_global_order_is_recorded(self, version: int) -> None:
        """Before version 6 neither the global order, its position nor the last window's
        mode was saved: they read as None (a mid-epoch state resumes on its own world
        size only), whatever the keys hold."""
        order = {"data": "corpus", "epoch": 0, "samples": 104, "batch_size": 4}
        saved = state(version=version, global_order=order, global_position=64, by_items=True)
        parsed = parse(saved, never_tensor)
        assert (parsed.order, parsed.global_position, parsed.by_items) == (None, None, None)

    @pytest.mark.parametrize("version", [1, 2, 3, 4, 5, 6])
    def test_before_version_7_nothing_was_handed_out(self, version: int) -> None:
        """Before version 7 a microbatch handed out (a save at the top of the loop body)
        was not recorded: it reads as False, whatever the key holds, and is not required."""
        assert not parse(state(version=version, handed_out=True), never_tensor).handed_out
        assert not parse(state(version=version, handed_out=...), never_tensor).handed_out

    def test_version_7_reads_what_was_handed_out(self) -> None:
        """Version 7 reads ``handed_out`` as saved, a bool, and requires it."""
        assert parse(state(handed_out=True), never_tensor).handed_out
        for bad in ("yes", ..., None):
            with pytest.raises(GradaccumError, match=r"state\[.handed_out.\]"):
                parse(state(handed_out=bad), never_tensor)

    @pytest.mark.parametrize("version", [1, 2, 3, 4, 5, 6, 7])
    def test_before_version_8_no_microbatch_was_recorded(self, version: int) -> None:
        """Before version 8 acc.step's microbatch was not saved: it reads as None,
        whatever the key holds."""
        assert parse(state(version=version, microbatch=8), never_tensor).microbatch is None

    def test_version_8_reads_the_microbatch(self) -> None:
        """Version 8 reads ``microbatch`` as saved: a positive int, or None (or absent);
        anything else is refused naming the key."""
        assert parse(state(microbatch=8), never_tensor).microbatch == 8
        assert parse(state(microbatch=None), never_tensor).microbatch is None
        for bad in (0, "8", True):
            with pytest.raises(GradaccumError, match=r"state\[.microbatch.\]"):
                parse(state(microbatch=bad), never_tensor)

    def test_version_5_loads_as_before(self) -> None:
        """A version-5 state (world size and epoch length, nothing more) reads as saved."""
        parsed = parse(state(version=5), never_tensor)
        assert parsed == Checkpoint(4, 8, 2, 0, True, "auto", None, 3, 2, 13)

    def test_version_6_reads_the_global_order(self) -> None:
        """Version 6 reads the global order (with the state's world size), the samples of
        it trained and the last window's mode; all may be None."""
        order = {"data": "corpus", "epoch": None, "samples": 104, "batch_size": 4}
        parsed = parse(state(global_order=order, global_position=64, by_items=False), never_tensor)
        assert parsed.order == GlobalOrder("corpus", None, 104, 4, 2)
        assert (parsed.global_position, parsed.by_items) == (64, False)
        parsed = parse(state(global_order=None, global_position=None), never_tensor)
        assert (parsed.order, parsed.global_position, parsed.by_items) == (None, None, None)

    @pytest.mark.parametrize(
        ("changes", "message"),
        [
            (
                {"global_order": None, "global_position": 3},
                "state['global_position'] is 3 (int), without a global_order",
            ),
            (
                {"global_order": {"data": "c", "epoch": 0, "samples": 103, "batch_size": 4}},
                "state['global_order'] is not a global order from state_dict() (with a "
                "world_size), got {'data': 'c', 'epoch': 0, 'samples': 103, 'batch_size': 4} "
                "(dict)",
            ),
            (
                {"global_order": {"data": "c", "samples": 104, "batch_size": 4}},
                "state['global_order'] is not a global order from state_dict() (with a "
                "world_size), got {'data': 'c', 'samples': 104, 'batch_size': 4} (dict)",
            ),
            (
                {
                    "world_size": None,
                    "global_order": {"data": "c", "epoch": 0, "samples": 4, "batch_size": 4},
                },
                "state['global_order'] is not a global order from state_dict() (with a "
                "world_size), got {'data': 'c', 'epoch': 0, 'samples': 4, 'batch_size': 4} "
                "(dict)",
            ),
            (
                {"global_order": {"data": "c", "epoch": 0, "samples": 8, "batch_size": 4}},
                "state['global_position'] must be a non-negative int, got None (NoneType)",
            ),
            (
                {
                    "global_order": {"data": "c", "epoch": 0, "samples": 8, "batch_size": 4},
                    "global_position": 4,
                },
                "state['global_position'] is 4, but 8 microbatches of 2 x 4 samples into an "
                "epoch of 8 (state['position'], state['global_order']) are 8",
            ),
            ({"by_items": 1}, "state['by_items'] must be a bool, got 1 (int)"),
        ],
    )
    def test_a_malformed_global_order_is_refused(
        self, changes: dict[str, Any], message: str
    ) -> None:
        """A global order, position or mode that state_dict() cannot have saved is refused,
        naming the key."""
        with pytest.raises(GradaccumError) as caught:
            parse(state(**changes), never_tensor)
        assert str(caught.value) == message

    def test_an_epoch_length_below_the_position_is_refused(self) -> None:
        """A position past its own epoch's end cannot come from state_dict()."""
        with pytest.raises(ConfigError) as caught:
            parse(state(position=8, epoch_length=7), never_tensor)
        assert str(caught.value) == "state['epoch_length'] is 7, less than its position 8"
        assert parse(state(position=8, epoch_length=8), never_tensor).epoch_length == 8

    @pytest.mark.parametrize("version", [1, 2, 3])
    def test_before_version_4_no_epoch_is_completed(self, version: int) -> None:
        """A state saved before version 4 has no ``epochs_completed``: it reads as 0."""
        parsed = parse(state(version=version, epochs_completed=...), never_tensor)
        assert parsed.epochs_completed == 0

    def test_version_4_reads_the_epochs_completed(self) -> None:
        """Version 4 reads ``epochs_completed`` as saved, and requires it."""
        assert parse(state(epochs_completed=7), never_tensor).epochs_completed == 7
        with pytest.raises(ConfigTypeError, match=r"state\['epochs_completed'\]"):
            parse(state(epochs_completed=...), never_tensor)

    def test_version_1_has_no_skipped_steps(self) -> None:
        """A version-1 state (no ``skipped_steps``) reads as none skipped."""
        assert parse(state(version=1, skipped_steps=...), never_tensor).skipped_steps == 0

    def test_missing_sync_reads_as_auto(self) -> None:
        """A state without ``sync`` reads as the default policy."""
        assert parse(state(sync=...), never_tensor).sync == "auto"

    @given(version=st.integers(min_value=0, max_value=10**6).filter(lambda v: v not in range(1, 9)))
    def test_other_versions_are_refused(self, version: int) -> None:
        """Any other version is refused, saying which versions this gradaccum reads."""
        with pytest.raises(ConfigError) as caught:
            parse(state(version=version), never_tensor)
        assert str(caught.value) == (
            f"state['version'] is {version}, but this gradaccum reads versions 1 to 8; "
            "load it with the gradaccum that saved it"
        )

    @pytest.mark.parametrize(
        ("version", "error"),
        [
            (..., ConfigTypeError),
            (None, ConfigTypeError),
            ("3", ConfigTypeError),
            (3.0, ConfigTypeError),
            (True, ConfigTypeError),
            (-1, ConfigError),
        ],
    )
    def test_malformed_version_is_refused(self, version: Any, error: type) -> None:
        """A missing or non-count version is refused, naming the key."""
        with pytest.raises(error, match=r"state\['version'\]"):
            parse(state(version=version), never_tensor)


class TestParseFields:
    @pytest.mark.parametrize("value", [[], None, (("version", 3),), "state", 3])
    def test_not_a_mapping(self, value: Any) -> None:
        """A state that is not a mapping is a ConfigTypeError (a TypeError) quoting it."""
        with pytest.raises(ConfigTypeError) as caught:
            parse(value, never_tensor)
        assert str(caught.value).startswith(
            "state must be a mapping from Accumulator.state_dict(), got "
        )
        assert repr(value) in str(caught.value)
        assert isinstance(caught.value, TypeError)

    @pytest.mark.parametrize(
        ("key", "value", "error"),
        [
            ("steps", ..., ConfigTypeError),
            ("steps", None, ConfigTypeError),
            ("steps", 0, ConfigError),
            ("steps", -4, ConfigError),
            ("steps", True, ConfigTypeError),
            ("steps", 4.0, ConfigTypeError),
            ("steps", "4", ConfigTypeError),
            ("position", ..., ConfigTypeError),
            ("position", -1, ConfigError),
            ("position", 8.0, ConfigTypeError),
            ("position", False, ConfigTypeError),
            ("global_step", ..., ConfigTypeError),
            ("global_step", -2, ConfigError),
            ("global_step", "2", ConfigTypeError),
            ("skipped_steps", None, ConfigTypeError),
            ("skipped_steps", -1, ConfigError),
            ("skipped_steps", 0.0, ConfigTypeError),
            ("epochs_completed", None, ConfigTypeError),
            ("epochs_completed", -1, ConfigError),
            ("epochs_completed", 1.0, ConfigTypeError),
            ("epochs_completed", True, ConfigTypeError),
            ("drop_last", ..., ConfigTypeError),
            ("drop_last", None, ConfigTypeError),
            ("drop_last", 1, ConfigTypeError),
            ("drop_last", "True", ConfigTypeError),
            ("world_size", 0, ConfigError),
            ("world_size", -2, ConfigError),
            ("world_size", 2.0, ConfigTypeError),
            ("world_size", True, ConfigTypeError),
            ("world_size", "2", ConfigTypeError),
            ("epoch_length", 0, ConfigError),
            ("epoch_length", 13.0, ConfigTypeError),
            ("epoch_length", "13", ConfigTypeError),
        ],
    )
    def test_malformed_field_is_refused_by_name(self, key: str, value: Any, error: type) -> None:
        """A missing or malformed field is refused, naming its key; the error is a
        GradaccumError (and a ValueError or TypeError)."""
        with pytest.raises(error) as caught:
            parse(state(**{key: value}), never_tensor)
        assert f"state['{key}']" in str(caught.value)
        assert isinstance(caught.value, GradaccumError)
        assert isinstance(caught.value, ValueError | TypeError)

    @given(global_step=st.integers(0, 100), more=st.integers(1, 100))
    def test_more_skipped_than_windows_is_refused(self, global_step: int, more: int) -> None:
        """skipped_steps above global_step cannot come from state_dict() and is refused."""
        skipped = global_step + more
        with pytest.raises(ConfigError) as caught:
            parse(state(global_step=global_step, skipped_steps=skipped), never_tensor)
        assert str(caught.value) == (
            f"state['skipped_steps'] is {skipped}, more than its {global_step} windows"
        )

    @given(global_step=st.integers(0, 100), data=st.data())
    def test_skipped_up_to_windows_is_read(self, global_step: int, data: st.DataObject) -> None:
        """Up to every window skipped is accepted."""
        skipped = data.draw(st.integers(0, global_step))
        assert (
            parse(state(global_step=global_step, skipped_steps=skipped), never_tensor).skipped_steps
            == skipped
        )


class TestParseWindow:
    @pytest.mark.parametrize("value", [..., None])
    def test_no_window(self, value: Any) -> None:
        """A state without a window (as saved between windows) reads as none."""
        assert parse(state(window=value), never_tensor).window is None

    def test_a_window_is_read(self) -> None:
        """A well-formed window is read field by field."""
        loss_a, loss_b, grad = FakeTensor("a"), FakeTensor("b"), FakeTensor("g")
        parsed = parse(state(window=window(losses=[loss_a, loss_b], grads=[grad, None])), is_tensor)
        assert parsed.window == SavedWindow(2, 4, 4, False, [], [loss_a, loss_b], [grad, None])

    def test_items_may_be_ints_or_tensors(self) -> None:
        """A by_items window's item counts are ints or (0-dim) tensors."""
        count = FakeTensor("n")
        parsed = parse(state(window=window(by_items=True, items=[3, count])), is_tensor)
        assert parsed.window is not None
        assert parsed.window.items == [3, count]

    @pytest.mark.parametrize(
        "changes",
        [
            {"microsteps": ...},
            {"microsteps": 0, "losses": []},
            {"microsteps": 4, "losses": [FakeTensor(str(i)) for i in range(4)]},  # == size
            {"microsteps": 2.0},
            {"microsteps": True, "losses": [FakeTensor("a")]},
            {"size": ...},
            {"size": 4.0},
            {"size": 2},  # microsteps == size
            {"divisor": ...},
            {"divisor": 4.0},
            {"divisor": None},
            {"by_items": ...},
            {"by_items": 0},
            {"by_items": "False"},
            {"items": ...},
            {"items": (1, 2)},
            {"items": [1.5, 2]},
            {"items": [True, 2]},
            {"items": ["1"]},
            {"losses": ...},
            {"losses": (FakeTensor("a"), FakeTensor("b"))},
            {"losses": [FakeTensor("a")]},  # fewer than microsteps
            {"losses": [FakeTensor("a"), 1.0]},
            {"losses": [FakeTensor("a"), None]},
            {"grads": ...},
            {"grads": (None,)},
            {"grads": [1.0]},
            {"grads": [[FakeTensor("g")]]},
        ],
    )
    def test_malformed_window_is_refused_by_name(self, changes: dict[str, Any]) -> None:
        """A window that state_dict() cannot have saved is refused, naming
        ``state['window']`` and its type (a dict's repr would not fit on a line)."""
        bad = window(**changes)
        with pytest.raises(ConfigError) as caught:
            parse(state(window=bad), is_tensor)
        assert str(caught.value).startswith(
            "state['window'] is not a window from state_dict(), got "
        )
        assert str(caught.value).endswith("(dict)") or str(caught.value).endswith("type dict")

    @pytest.mark.parametrize("value", [[1, 2], "window", 3, (("microsteps", 2),)])
    def test_a_window_that_is_not_a_mapping_is_refused(self, value: Any) -> None:
        """A non-mapping window is refused, naming ``state['window']`` and its type."""
        with pytest.raises(ConfigError) as caught:
            parse(state(window=value), is_tensor)
        assert str(caught.value) == (
            f"state['window'] is not a window from state_dict(), got {value!r} "
            f"({type(value).__name__})"
        )

    def test_losses_must_be_tensors(self) -> None:
        """With an is_tensor that recognizes nothing, a saved window's losses are refused."""
        with pytest.raises(ConfigError, match=r"state\['window'\]"):
            parse(state(window=window()), never_tensor)

    @pytest.mark.parametrize("value", [0, False, "", [], {}])
    def test_a_falsy_malformed_window_is_refused(self, value: Any) -> None:
        """A window that is neither absent nor None nor a saved window is refused, like
        any other malformed field (state_dict() never saves these)."""
        with pytest.raises(ConfigError, match=r"state\['window'\]"):
            parse(state(window=value), is_tensor)


class TestCheckpointCheckFits:
    @staticmethod
    def saved(
        steps: int = 4, drop_last: bool = True, window: bool = False, world_size: int | None = 1
    ) -> Checkpoint:
        opened = SavedWindow(1, 4, 4, False, [], [FakeTensor("l")], []) if window else None
        position = 1 if window else 8
        return Checkpoint(steps, position, 2, 0, drop_last, "auto", opened, world_size=world_size)

    @given(
        steps=st.integers(1, 64),
        drop_last=st.booleans(),
        window=st.booleans(),
        allow=st.booleans(),
    )
    def test_the_same_accumulator_fits(
        self, steps: int, drop_last: bool, window: bool, allow: bool
    ) -> None:
        """A state loads into an accumulator with its steps and drop_last, always."""
        self.saved(steps, drop_last, window).check_fits(
            world_size=1, steps=steps, drop_last=drop_last, allow_steps_change=allow
        )

    @pytest.mark.parametrize("saved_drop_last", [False, True])
    @pytest.mark.parametrize("allow", [False, True])
    def test_another_drop_last_is_refused(self, saved_drop_last: bool, allow: bool) -> None:
        """Another drop_last is refused, allow_steps_change or not, naming the fix."""
        with pytest.raises(ConfigError) as caught:
            self.saved(drop_last=saved_drop_last).check_fits(
                world_size=1, steps=4, drop_last=not saved_drop_last, allow_steps_change=allow
            )
        assert str(caught.value) == (
            f"the state was saved with drop_last={saved_drop_last} but this Accumulator has "
            f"drop_last={not saved_drop_last}; construct it with "
            f"drop_last={saved_drop_last} to resume"
        )

    def test_drop_last_is_checked_before_steps(self) -> None:
        """With both differing, the refusal is about drop_last."""
        with pytest.raises(ConfigError, match="drop_last"):
            self.saved(steps=4, drop_last=True).check_fits(
                world_size=1, steps=8, drop_last=False, allow_steps_change=False
            )

    def test_another_steps_is_refused_with_both_fixes(self) -> None:
        """Another steps between windows is refused, offering allow_steps_change."""
        with pytest.raises(ConfigError) as caught:
            self.saved(steps=4).check_fits(
                world_size=1, steps=8, drop_last=True, allow_steps_change=False
            )
        assert str(caught.value) == (
            "the state was saved with steps=4 but this Accumulator has steps=8; construct "
            "it with steps=4 to resume, or pass allow_steps_change=True to keep steps=8"
        )

    def test_allow_steps_change_between_windows(self) -> None:
        """allow_steps_change accepts another steps for a state without a window."""
        self.saved(steps=4).check_fits(
            world_size=1, steps=8, drop_last=True, allow_steps_change=True
        )

    @pytest.mark.parametrize("allow", [False, True])
    def test_a_saved_window_keeps_its_steps(self, allow: bool) -> None:
        """A state saved mid-window refuses another steps even with allow_steps_change,
        and says why instead of offering it."""
        with pytest.raises(ConfigError) as caught:
            self.saved(steps=4, window=True).check_fits(
                world_size=1, steps=8, drop_last=True, allow_steps_change=allow
            )
        assert str(caught.value) == (
            "the state was saved with steps=4 but this Accumulator has steps=8; construct "
            "it with steps=4 to resume (it was saved mid-window, where steps cannot change)"
        )

    @pytest.mark.parametrize(("saved", "here"), [(2, 1), (1, 2), (8, 4)])
    @pytest.mark.parametrize("window", [False, True])
    def test_another_world_size_is_refused(self, saved: int, here: int, window: bool) -> None:
        """A state saved on another number of data-parallel ranks is refused, between
        windows or mid-window, naming both numbers and the fix."""
        with pytest.raises(ConfigError) as caught:
            self.saved(window=window, world_size=saved).check_fits(
                world_size=here, steps=4, drop_last=True, allow_steps_change=True
            )
        ranks = f"{saved} rank{'s' if saved > 1 else ''}"
        assert str(caught.value) == (
            f"the state was saved with world_size={saved} (data-parallel ranks) but this "
            f"Accumulator has world_size={here}: its position counts the microbatches of "
            f"each rank's shard and its windows the global batch of {ranks}, which this run "
            f"would not continue; resume on {ranks}, as saved, or pass "
            f"allow_world_size_change=True to continue {kept_on(saved * 4)} (the same global "
            "batch)"
        )

    def test_the_world_size_is_checked_first(self) -> None:
        """With the steps and drop_last differing too, the refusal is about the world size
        (a resume on another world size would change steps to keep the global batch)."""
        with pytest.raises(ConfigError, match="world_size=2"):
            self.saved(steps=4, drop_last=True, world_size=2).check_fits(
                world_size=1, steps=8, drop_last=False, allow_steps_change=False
            )

    @given(here=st.integers(1, 4096))
    def test_an_unrecorded_world_size_is_not_checked(self, here: int) -> None:
        """A state from before version 5 (no world size) loads on any number of ranks."""
        self.saved(world_size=None).check_fits(
            world_size=here, steps=4, drop_last=True, allow_steps_change=False
        )


class TestCheckpointCheckFitsAnotherWorldSize:
    """check_fits(allow_world_size_change=True): a state saved on 2 ranks with steps 4
    (a global window of 8 microbatches), 8 microbatches of 4 samples into an epoch of
    104 samples (position 64)."""

    ORDER = GlobalOrder("corpus", 0, 104, 4, 2)

    @staticmethod
    def saved(
        window: bool = False, order: GlobalOrder | None = ORDER, position: int = 8
    ) -> Checkpoint:
        opened = SavedWindow(1, 4, 4, False, [], [FakeTensor("l")], []) if window else None
        trained = None if order is None else order.trained_after(position)
        return Checkpoint(4, position, 2, 0, True, "auto", opened, 0, 2, 13, order, trained, False)

    def fits(self, saved: Checkpoint, world_size: int, steps: int) -> Rescale | None:
        return saved.check_fits(
            world_size=world_size,
            steps=steps,
            drop_last=True,
            allow_steps_change=False,
            allow_world_size_change=True,
        )

    @pytest.mark.parametrize(("world_size", "steps", "skip"), [(1, 8, 16), (4, 2, 4), (8, 1, 2)])
    def test_the_global_window_kept_resumes_at_the_same_sample(
        self, world_size: int, steps: int, skip: int
    ) -> None:
        """On W' ranks with W' * steps' == 2 * 4 the state resumes after the same 64
        samples: 64 / (W' * 4) microbatches of each rank."""
        rescale = self.fits(self.saved(), world_size, steps)
        assert rescale == Rescale(self.ORDER, 64, 2, 4, False)
        assert rescale.skip(world_size) == skip

    def test_the_same_world_size_needs_no_rescale(self) -> None:
        """On the saved world size nothing is rescaled."""
        assert self.fits(self.saved(), 2, 4) is None

    def test_a_world_size_that_cannot_keep_the_global_window_is_refused(self) -> None:
        """3 ranks cannot hold a global window of 8 microbatches: the message names the
        numbers of ranks and the steps that would."""
        with pytest.raises(ConfigError) as caught:
            self.fits(self.saved(), 3, 3)
        assert str(caught.value) == (
            "the state was saved with world_size=2 (data-parallel ranks) and steps=4, a "
            "global window of 2 x 4 = 8 microbatches, which 3 ranks cannot keep (8 is not a "
            "multiple of 3); resume on 1, 2, 4 or 8 ranks with steps 8, 4, 2 or 1"
        )

    def test_steps_that_change_the_global_window_are_refused(self) -> None:
        """On 4 ranks with steps=4 (16 microbatches a window) the message names steps=2."""
        with pytest.raises(ConfigError) as caught:
            self.fits(self.saved(), 4, 4)
        assert str(caught.value) == (
            "the state was saved with world_size=2 (data-parallel ranks) and steps=4, a "
            "global window of 2 x 4 = 8 microbatches, but this Accumulator has steps=4 on 4 "
            "ranks (16 microbatches); construct it with steps=2 to keep the global batch "
            "(gradaccum.steps_for(global_batch, micro_batch, world_size))"
        )

    def test_a_saved_window_is_refused(self) -> None:
        """A state saved mid-window (include_grads) holds each rank's partial gradient."""
        with pytest.raises(ConfigError) as caught:
            self.fits(self.saved(window=True, position=1), 4, 2)
        assert str(caught.value) == (
            "the state was saved with world_size=2 (data-parallel ranks) mid-window (1 of 4 "
            "microsteps, include_grads=True): each rank's partial gradient holds its own "
            "microbatches, which do not carry over to 4 ranks; resume on 2 ranks, as saved, "
            "or from a checkpoint after a window's last microstep"
        )

    def test_mid_epoch_without_a_global_order_is_refused(self) -> None:
        """Mid-epoch, the global position is needed; between epochs it is not."""
        with pytest.raises(ConfigError) as caught:
            self.fits(self.saved(order=None), 4, 2)
        assert str(caught.value) == (
            "the state was saved with world_size=2 (data-parallel ranks) at microbatch 8 of "
            "an epoch whose global order was not known (an iterable other than a DataLoader "
            "over a DistributedSampler, without a global_order() method, or a state from "
            "before version 6), so where the job stands in its samples was not recorded; "
            "resume on 2 ranks, as saved, or from a checkpoint between epochs"
        )
        assert self.fits(self.saved(order=None, position=0), 4, 2) == Rescale(None, 0, 2, 4, False)

    def test_a_position_inside_a_microbatch_there_is_refused(self) -> None:
        """After 7 microbatches of 2 ranks (56 samples), 4 ranks' microbatches of 16
        samples do not start there: the message names the ranks that would."""
        with pytest.raises(ConfigError) as caught:
            self.fits(self.saved(position=7), 4, 2)
        assert str(caught.value) == (
            "the loaded state resumes after sample 56 of its epoch's order, which falls "
            "inside a microbatch of 4 ranks (4 x 4 = 16 samples each): its windows were cut "
            "from a position that 4 ranks do not reach (steps was changed mid-epoch); resume "
            "on 1 or 2 ranks, or from a checkpoint between epochs"
        )

    def test_the_world_size_change_is_checked_before_drop_last(self) -> None:
        """drop_last is still checked on another world size."""
        with pytest.raises(ConfigError, match="drop_last=True but this Accumulator has"):
            self.saved().check_fits(
                world_size=4,
                steps=2,
                drop_last=False,
                allow_steps_change=False,
                allow_world_size_change=True,
            )
