"""Resuming an epoch (gradaccum/resuming.py and the accumulator's epoch): an iterable that
restores its own position is not skipped for, a DataLoader skips by its batch sampler's
indices, anything else is drawn and dropped; each bit for bit at every window boundary."""

from __future__ import annotations

import importlib.util
import io
import re
import sys
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.utils.data import (
    BatchSampler,
    DataLoader,
    Dataset,
    DistributedSampler,
    IterableDataset,
    RandomSampler,
    TensorDataset,
)
from torchdata.stateful_dataloader import StatefulDataLoader

import gradaccum
from gradaccum import resuming
from tests import resumes
from tests.helpers import Batch, make_batches, make_model, mean_loss, sgd

ROOT = Path(__file__).resolve().parents[1]

pytestmark = pytest.mark.filterwarnings("ignore:'set_vital' is deprecated:UserWarning")


class Counting(Dataset[tuple[torch.Tensor, torch.Tensor]]):
    """``n`` samples of a regression problem; counts the samples loaded."""

    def __init__(self, n: int) -> None:
        generator = torch.Generator().manual_seed(3)
        self.x = torch.randn(n, 5, generator=generator, dtype=torch.float64)
        self.y = torch.randn(n, 1, generator=generator, dtype=torch.float64)
        self.loaded = 0

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        self.loaded += 1
        return self.x[index], self.y[index]


class Positions:
    """An iterable without len that saves and restores its own position, as the
    ``Stateful`` protocol of torch.distributed.checkpoint has it."""

    def __init__(self, batches: list[Any]) -> None:
        self.batches = batches
        self.start = self.at = 0

    def __iter__(self) -> Iterator[Any]:
        self.at, self.start = self.start, 0
        while self.at < len(self.batches):
            self.at += 1
            yield self.batches[self.at - 1]

    def state_dict(self) -> dict[str, int]:
        return {"at": self.at}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.start = state["at"]


def saved(value: Any) -> Any:
    """``value`` through torch.save and torch.load, as a checkpoint file holds it."""
    buffer = io.BytesIO()
    torch.save(value, buffer)
    return torch.load(io.BytesIO(buffer.getvalue()))


def step_through(acc: gradaccum.Accumulator, model: torch.nn.Module, iterable: Any) -> None:
    for batch in acc.epoch(iterable):
        with acc.microstep(mean_loss(model, batch)):
            pass


class TestRestoresOwnPosition:
    def test_what_restores_its_own_position(self) -> None:
        """State_dict and load_state_dict both make an iterable restore itself; a plain
        DataLoader, a list, or only one of the two methods do not."""
        data = TensorDataset(torch.zeros(4, 1))
        assert resuming.restores_own_position(StatefulDataLoader(data))
        assert resuming.restores_own_position(Positions([]))
        assert not resuming.restores_own_position(DataLoader(data))
        assert not resuming.restores_own_position([1, 2])

        class OnlySaves:
            def state_dict(self) -> dict[str, int]:
                return {}

        assert not resuming.restores_own_position(OnlySaves())


class TestStatefulDataLoader:
    def build(self) -> tuple[torch.nn.Module, torch.optim.Optimizer, Any, Any]:
        model = make_model()
        optimizer = sgd(model)
        acc = gradaccum.Accumulator(model, optimizer, steps=4)
        data = Counting(52)
        loader = StatefulDataLoader(
            data, batch_size=4, shuffle=True, generator=torch.Generator().manual_seed(5)
        )
        return model, optimizer, acc, loader

    def test_it_is_not_skipped_twice(self) -> None:
        """The issue's case: 52 samples in batches of 4, steps=4, a checkpoint of the
        loader and the accumulator at the 4th optimizer step (4 microbatches into the
        second epoch). The resumed epoch trains the loader's last 8 microbatches, as the
        uninterrupted run does (before: the 4 were skipped again, and the epoch ended
        after 9 of 13 with a ConfigError)."""
        model, _, acc, loader = self.build()
        checkpoint = None
        for _ in range(2):
            for batch in acc.epoch(loader):
                with acc.microstep(mean_loss(model, batch)):
                    pass
                if acc.global_step == 4 and checkpoint is None:
                    checkpoint = saved(
                        {
                            "model": model.state_dict(),
                            "acc": acc.state_dict(),
                            "loader": loader.state_dict(),
                        }
                    )
        assert checkpoint is not None
        assert checkpoint["acc"]["position"] == 4
        resumed, _, again, restored = self.build()
        resumed.load_state_dict(checkpoint["model"])
        again.load_state_dict(checkpoint["acc"])
        restored.load_state_dict(checkpoint["loader"])
        step_through(again, resumed, restored)
        assert again.global_step == acc.global_step == 6
        assert all(
            torch.equal(p, q) for p, q in zip(model.parameters(), resumed.parameters(), strict=True)
        )
        assert restored.dataset.loaded == 8 * 4  # the loader loaded only what was trained on
        assert checkpoint["acc"]["epochs_completed"] == 1
        assert again.epochs_completed == acc.epochs_completed == 2

    def checkpoint_at(self, handed_out: int, acc_at: int) -> tuple[Any, Any]:
        """The accumulator's state after ``acc_at`` microsteps (at a window's end), and
        the loader's after it had handed out ``handed_out`` microbatches."""
        model, _, acc, loader = self.build()
        acc_state = loader_state = None
        for index, batch in enumerate(acc.epoch(loader), 1):
            if index == handed_out:
                loader_state = saved(loader.state_dict())
            with acc.microstep(mean_loss(model, batch)):
                pass
            if index == acc_at:
                acc_state = saved(acc.state_dict())
            if index == max(handed_out, acc_at):
                break
        return acc_state, loader_state

    @pytest.mark.parametrize(("handed_out", "stands_at"), [(5, 5), (3, 3)])
    def test_a_loader_state_one_microbatch_apart_is_refused(
        self, handed_out: int, stands_at: int
    ) -> None:
        """A loader state taken one microbatch after or before the accumulator's is
        refused at the resumed epoch's first next(), before any microbatch is handed out."""
        acc_state, loader_state = self.checkpoint_at(handed_out, acc_at=4)
        model, _, acc, loader = self.build()
        acc.load_state_dict(acc_state)
        loader.load_state_dict(loader_state)
        with pytest.raises(gradaccum.ConfigError) as caught:
            next(iter(acc.epoch(loader)))
        assert str(caught.value) == (
            f"the epoch's iterable restores its own position and stands at microbatch "
            f"{stands_at} of its epoch, but the accumulator resumes at microbatch 4; load the "
            "iterable's state_dict() saved at the same point as the accumulator's (after the "
            "`with` block of a window's last microstep, or between epochs)"
        )
        assert acc.global_step == 1
        assert all(p.grad is None for p in model.parameters())

    def test_a_refused_resume_can_be_retried(self) -> None:
        """After a refusal nothing was handed out and the loaded position stays: loading
        the loader's right state and starting the epoch again resumes it."""
        acc_state, early = self.checkpoint_at(3, acc_at=4)
        _, right = self.checkpoint_at(4, acc_at=4)
        model, _, acc, loader = self.build()
        acc.load_state_dict(acc_state)
        loader.load_state_dict(early)
        with pytest.raises(gradaccum.ConfigError):
            next(iter(acc.epoch(loader)))
        assert acc.position == 4
        loader.load_state_dict(right)
        step_through(acc, model, loader)
        assert (acc.global_step, acc.epochs_completed) == (3, 1)
        assert loader.dataset.loaded == 8 * 4

    def test_a_loader_without_its_state_is_refused(self) -> None:
        """Resuming mid-epoch with a loader whose state was not loaded is refused: it would
        train the epoch's first microbatches again."""
        acc_state, _ = self.checkpoint_at(4, acc_at=4)
        _, _, acc, loader = self.build()
        acc.load_state_dict(acc_state)
        with pytest.raises(gradaccum.ConfigError, match="stands at microbatch 0 of its epoch"):
            next(iter(acc.epoch(loader)))

    def test_a_loader_state_from_the_end_of_an_epoch_is_refused(self) -> None:
        """The accumulator stops an epoch at its last trained microbatch, so the loader's
        state after it still stands in that epoch: loaded with a state from between epochs
        (position 0), it is refused (the guide loads the loader's state mid-epoch only)."""
        model, _, acc, loader = self.build()
        step_through(acc, model, loader)
        state = saved({"acc": acc.state_dict(), "loader": loader.state_dict()})
        assert (state["acc"]["position"], state["acc"]["epochs_completed"]) == (0, 1)
        _, _, again, restored = self.build()
        again.load_state_dict(state["acc"])
        restored.load_state_dict(state["loader"])
        with pytest.raises(gradaccum.ConfigError, match="stands at microbatch 12 of its epoch"):
            next(iter(again.epoch(restored)))

    @pytest.mark.parametrize("apart", [0, 1])
    def test_an_iterable_dataset_without_a_state_of_its_own_resumes(self, apart: int) -> None:
        """Over an IterableDataset with no state_dict, torchdata restores the position by
        drawing the batches yielded again, and counts them on top of the restored count
        (12 for 6); such a resume was refused as standing at microbatch 12. It resumes,
        with the uninterrupted run's parameters exactly; a loader state one microbatch
        apart is still refused."""

        class Stream(torch.utils.data.IterableDataset[Batch]):
            def __iter__(self) -> Iterator[Batch]:
                yield from make_batches([2] * 12)

        def run(state: dict[str, Any] | None) -> tuple[torch.nn.Module, dict[str, Any]]:
            model = make_model()
            acc = gradaccum.Accumulator(model, sgd(model), steps=2)
            loader = StatefulDataLoader(Stream(), batch_size=None)
            if state is not None:
                model.load_state_dict(state["model"])
                acc.load_state_dict(state["acc"])
                loader.load_state_dict(state["loader"])
            found: dict[str, Any] = {}
            for index, batch in enumerate(acc.epoch(loader)):
                with acc.microstep(mean_loss(model, batch)):
                    pass
                if state is None and index == 5:  # (plain SGD: no optimizer state)
                    found["acc"] = saved(acc.state_dict())
                    found["model"] = saved(model.state_dict())
                if state is None and index == 5 + apart:
                    found["loader"] = saved(loader.state_dict())
            return model, found

        whole, state = run(None)
        if apart:
            with pytest.raises(gradaccum.ConfigError, match="stands at microbatch 14 of"):
                run(state)
            return
        resumed, _ = run(state)
        assert all(
            torch.equal(p, q) for p, q in zip(whole.parameters(), resumed.parameters(), strict=True)
        )

    def test_a_checkpoint_at_the_top_of_the_loop_body_is_refused(self) -> None:
        """At the top of the loop body the loader has handed out a microbatch that no
        microstep used: its state would not hand it out again, so state_dict() refuses."""
        model, _, acc, loader = self.build()
        for index, batch in enumerate(acc.epoch(loader)):
            if index == 4:
                with pytest.raises(gradaccum.UsageError) as caught:
                    acc.state_dict()
                break
            with acc.microstep(mean_loss(model, batch)):
                pass
        assert str(caught.value).startswith(
            "the epoch's iterable restores its own position (it has state_dict and "
            "load_state_dict) and has handed out 5 microbatches of this epoch, but only 4 "
            "are trained on"
        )
        assert "checkpoint after the `with` block of a window's last microstep" in str(caught.value)


class TestUnsizedSelfRestoring:
    def test_resumes_between_windows_with_drop_last(self) -> None:
        """An iterable without len that restores its own position resumes bit for bit
        from a checkpoint between windows: with drop_last nothing is drawn ahead."""
        batches = resumes_batches()
        model, acc = fresh(drop_last=True)
        checkpoint = None
        for batch in acc.epoch(positions := Positions(batches)):
            with acc.microstep(mean_loss(model, batch)):
                pass
            if acc.global_step == 1 and checkpoint is None:
                checkpoint = saved(
                    {
                        "model": model.state_dict(),
                        "acc": acc.state_dict(),
                        "data": positions.state_dict(),
                    }
                )
        assert checkpoint is not None
        resumed, again = fresh(drop_last=True)
        resumed.load_state_dict(checkpoint["model"])
        again.load_state_dict(checkpoint["acc"])
        restored = Positions(batches)
        restored.load_state_dict(checkpoint["data"])
        step_through(again, resumed, restored)
        assert again.global_step == acc.global_step == 3
        assert all(
            torch.equal(p, q) for p, q in zip(model.parameters(), resumed.parameters(), strict=True)
        )

    def test_drawn_ahead_without_drop_last_is_refused(self) -> None:
        """With drop_last=False an epoch without len is drawn one microbatch ahead to find
        its last: a checkpoint between windows is refused, saying why."""
        model, acc = fresh(drop_last=False)
        for batch in acc.epoch(Positions(resumes_batches())):
            with acc.microstep(mean_loss(model, batch)):
                pass
            if acc.global_step == 1:
                with pytest.raises(
                    gradaccum.UsageError, match=r"drawn ahead to find the epoch's end"
                ):
                    acc.state_dict()
                break


def resumes_batches() -> list[Any]:
    data = Counting(13 * 2)
    return [(data.x[i : i + 2], data.y[i : i + 2]) for i in range(0, 26, 2)]


def fresh(drop_last: bool) -> tuple[torch.nn.Module, gradaccum.Accumulator]:
    model = make_model()
    return model, gradaccum.Accumulator(model, sgd(model), steps=4, drop_last=drop_last)


def collate_with_worker(samples: list[Any]) -> dict[str, Any]:
    """Batches that say which worker loaded them, and that its init function ran."""
    info = torch.utils.data.get_worker_info()
    return {
        "x": torch.stack([x for x, _ in samples]),
        "worker": -1 if info is None else info.id,
        "initialized": getattr(info.dataset, "initialized", False) if info is not None else False,
    }


def mark_initialized(worker_id: int) -> None:
    torch.utils.data.get_worker_info().dataset.initialized = True  # type: ignore[union-attr]


class TestIndexLevelSkip:
    def loader(self, data: Dataset[Any], **options: Any) -> DataLoader[Any]:
        return DataLoader(
            data, batch_size=8, shuffle=True, generator=torch.Generator().manual_seed(11), **options
        )

    def resumed_at(self, position: int, iterable: Any, steps: int = 4) -> list[Any]:
        """What the resumed epoch hands out after a state saved at ``position``."""
        model = make_model()
        acc = gradaccum.Accumulator(model, sgd(model), steps=steps)
        acc.load_state_dict(
            {
                "version": 4,
                "steps": steps,
                "position": position,
                "global_step": position // steps,
                "skipped_steps": 0,
                "epochs_completed": 0,
                "drop_last": True,
                "sync": "auto",
            }
        )
        return list(acc.epoch(iterable))

    def test_only_the_trained_samples_are_loaded(self) -> None:
        """Resuming at microbatch 40 of 48 (batches of 8) loads the 64 samples trained on,
        the same batches as the uninterrupted epoch's last 8; drawing and dropping (a
        generator over the same loader) loads 384."""
        data = Counting(48 * 8)
        whole = [x for x, _ in self.loader(data)]
        data.loaded = 0
        got = self.resumed_at(40, self.loader(data))
        assert data.loaded == 8 * 8
        assert all(torch.equal(x, want) for (x, _), want in zip(got, whole[40:], strict=True))
        data.loaded = 0
        self.resumed_at(40, (batch for batch in self.loader(data)))
        assert data.loaded == 48 * 8

    def test_the_loader_settings_carry_over(self) -> None:
        """The skipping loader has the loader's collate_fn, workers, worker_init_fn and
        generator, and its batch sampler's drop_last: the same batches as the tail of
        the uninterrupted epoch, loaded by initialized workers."""
        data = Counting(8 * 12 + 5)  # the batch sampler drops the last 5 samples
        options = {
            "collate_fn": collate_with_worker,
            "num_workers": 2,
            "worker_init_fn": mark_initialized,
            "drop_last": True,
        }
        whole = list(self.loader(data, **options))
        assert len(whole) == 12
        got = self.resumed_at(8, self.loader(data, **options))
        assert [batch["worker"] for batch in got] == [0, 1, 0, 1]
        assert all(batch["initialized"] for batch in got)
        assert all(torch.equal(a["x"], b["x"]) for a, b in zip(got, whole[8:], strict=True))

    @settings(max_examples=300, deadline=None)
    @given(
        samples=st.integers(1, 40),
        size=st.integers(1, 9),
        drop_last=st.booleans(),
        shuffle=st.booleans(),
        data=st.data(),
    )
    def test_a_batch_sampler_is_skipped_by_its_indices(
        self, samples: int, size: int, drop_last: bool, shuffle: bool, data: st.DataObject
    ) -> None:
        """Skipping the first ``skip`` batches of a BatchSampler yields exactly what it yields
        after them, shuffled or not, with or without drop_last, whether its batch size
        divides the samples or not, and past its end; its own iterator (a list per batch)
        is never called: its sampler's indices are stepped over instead."""

        def batches() -> BatchSampler:
            order = torch.Generator().manual_seed(5)
            sampler = RandomSampler(range(samples), generator=order) if shuffle else range(samples)
            return BatchSampler(sampler, size, drop_last)

        whole = list(batches())
        skip = data.draw(st.integers(0, len(whole) + 2))
        builds = BatchSampler.__iter__
        try:
            BatchSampler.__iter__ = None  # type: ignore[assignment,method-assign]
            got = list(resuming._SkipBatches(batches(), skip))
        finally:
            BatchSampler.__iter__ = builds  # type: ignore[method-assign]
        assert got == whole[skip:]
        assert all(type(batch) is list for batch in got)

    def test_another_batch_sampler_is_drawn_batch_by_batch(self) -> None:
        """A batch sampler of another type (its batches may not be its sampler's indices in
        runs of batch_size) keeps the batch-level skip: its own batches after the first."""

        class Pairs(BatchSampler):
            def __iter__(self) -> Iterator[list[int]]:
                return iter([[index, index] for index in range(5)])

        assert list(resuming._SkipBatches(Pairs(range(5), 3, False), 2)) == [[2, 2], [3, 3], [4, 4]]

    @pytest.mark.parametrize("kind", ["subclass", "iterable dataset", "no batch sampler"])
    def test_other_loaders_are_drawn_and_dropped(self, kind: str) -> None:
        """A DataLoader subclass (its own __init__ may differ), one over an IterableDataset,
        and one without a batch sampler (batch_size=None) are drawn and dropped."""
        data = Counting(6 * 4)

        class Streamed(IterableDataset[Any]):
            def __iter__(self) -> Iterator[Any]:
                return (data[i] for i in range(len(data)))

        class Subclass(DataLoader[Any]):
            pass

        if kind == "subclass":
            loader: DataLoader[Any] = Subclass(data, batch_size=4)
        elif kind == "iterable dataset":
            loader = DataLoader(Streamed(), batch_size=4)
        else:
            loader = DataLoader(data, batch_size=None)
        assert resuming._index_skippable(loader) is None
        self.resumed_at(4, loader, steps=2)
        assert data.loaded == len(data)

    def test_a_dataloader_with_an_unknown_setting_is_drawn_and_dropped(
        self, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        """Index-level skip rebuilds the loader from the settings it knows; a DataLoader
        with a parameter it does not know (a newer torch) is drawn and dropped instead."""
        assert resuming._knows_every_setting()

        class Newer(DataLoader[Any]):
            def __init__(self, dataset: Any, *, prefetch_to: str = "", **options: Any) -> None:
                super().__init__(dataset, **options)

        monkeypatch.setattr(resuming, "DataLoader", Newer)
        assert not resuming._knows_every_setting.__wrapped__()


class TestAnotherEpochLength:
    """A state saved mid-epoch resumes only an epoch of the length it was saved in: another
    batch size (or dataset) would resume at another sample. 52 samples, steps=4."""

    def build(self, batch_size: int) -> tuple[torch.nn.Module, Any, Any]:
        model = make_model()
        acc = gradaccum.Accumulator(model, sgd(model), steps=4)
        loader = DataLoader(
            Counting(52),
            batch_size=batch_size,
            shuffle=True,
            generator=torch.Generator().manual_seed(5),
        )
        return model, acc, loader

    def saved_after(self, windows: int | None) -> Any:
        """The state after ``windows`` windows of batches of 4 (13 microbatches, 3 windows
        per epoch), or (None) after the first epoch."""
        model, acc, loader = self.build(4)
        for batch in acc.epoch(loader):
            with acc.microstep(mean_loss(model, batch)):
                pass
            if acc.global_step == windows:
                break
        return saved(acc.state_dict())

    @pytest.mark.parametrize(("batch_size", "length"), [(2, 26), (8, 7)])
    def test_another_batch_size_mid_epoch_is_refused(self, batch_size: int, length: int) -> None:
        """Saved 8 microbatches into an epoch of 13, resumed with another batch size: the
        first next() refuses, naming both lengths and the likely cause, before anything
        is drawn (no sample loaded, the loader's generator untouched) or changed; the
        loaded state stays, so the right loader then resumes it (before: batches of 2
        resumed at their 8th microbatch, samples 16 on, and trained 4 more windows)."""
        state = self.saved_after(2)
        assert (state["position"], state["epoch_length"]) == (8, 13)
        model, acc, loader = self.build(batch_size)
        acc.load_state_dict(state)
        before = [p.clone() for p in model.parameters()]
        with pytest.raises(gradaccum.ConfigError) as caught:
            next(iter(acc.epoch(loader)))
        assert str(caught.value) == (
            f"the loaded state resumes at microbatch 8 of an epoch of 13 microbatches (per "
            f"rank), but this epoch has {length}: another batch size, another dataset, or "
            "the data sharded over another number of processes; resume with the data and "
            "batch size the state was saved with (a state saved between epochs may change "
            "them)"
        )
        assert loader.dataset.loaded == 0
        assert torch.equal(
            loader.generator.get_state(), torch.Generator().manual_seed(5).get_state()
        )
        assert (acc.global_step, acc.position, acc.epochs_completed) == (2, 8, 0)
        assert all(torch.equal(p, q) for p, q in zip(model.parameters(), before, strict=True))
        assert all(p.grad is None for p in model.parameters())
        _, _, right = self.build(4)
        step_through(acc, model, right)
        assert (acc.global_step, acc.epochs_completed, right.dataset.loaded) == (3, 1, 16)

    def test_between_epochs_any_batch_size_resumes(self) -> None:
        """A state saved between epochs resumes no position (it records no epoch length):
        the next epoch is a fresh one, and may have another batch size."""
        state = self.saved_after(None)
        assert (state["position"], state["epochs_completed"], state["epoch_length"]) == (0, 1, None)
        model, acc, loader = self.build(2)
        acc.load_state_dict(state)
        step_through(acc, model, loader)
        assert (acc.global_step, acc.epochs_completed) == (3 + 26 // 4, 2)

    def test_a_version_4_state_is_not_checked(self) -> None:
        """A state saved before version 5 recorded no epoch length: it loads and resumes as
        it did, whatever the length (nothing to check it against)."""
        state = self.saved_after(2)
        old = {
            key: value for key, value in state.items() if key not in ("world_size", "epoch_length")
        }
        model, acc, loader = self.build(2)
        acc.load_state_dict(old | {"version": 4})
        step_through(acc, model, loader)
        assert (acc.global_step, acc.epochs_completed) == (2 + (26 - 8) // 4, 1)


def persistent(data: Dataset[Any], **options: Any) -> DataLoader[Any]:
    """A DataLoader of ``data`` with two persistent workers (none started until iterated)."""
    return DataLoader(data, num_workers=2, persistent_workers=True, **options)


def on_one_generator(data: Dataset[Any]) -> DataLoader[Any]:
    generator = torch.Generator()
    batches = BatchSampler(RandomSampler(data, generator=generator), 4, drop_last=False)
    return persistent(data, batch_sampler=batches, generator=generator)


# {name: (the loader of a dataset, what resuming a run with it does)}
LOADERS: dict[str, tuple[Callable[[Dataset[Any]], Any], str]] = {
    "shuffled, its generator": (
        lambda data: persistent(data, shuffle=True, generator=torch.Generator()),
        "its generator",
    ),
    "shuffled, no generator": (
        lambda data: persistent(data, shuffle=True),
        "torch's global random state",
    ),
    "a batch sampler on its generator": (on_one_generator, "its generator"),
    "a sampler's own generator": (
        lambda data: persistent(
            data,
            sampler=RandomSampler(data, generator=torch.Generator()),
            generator=torch.Generator(),
        ),
        "exact",
    ),
    "a DistributedSampler": (
        lambda data: persistent(
            data, sampler=DistributedSampler(data, 1, 0), generator=torch.Generator()
        ),
        "exact",
    ),
    "in order": (lambda data: persistent(data, generator=torch.Generator()), "exact"),
    "a sampler's own generator, no generator": (
        lambda data: persistent(data, sampler=RandomSampler(data, generator=torch.Generator())),
        "warned",
    ),
    "a DistributedSampler, no generator": (
        lambda data: persistent(data, sampler=DistributedSampler(data, 1, 0)),
        "warned",
    ),
    "not persistent": (
        lambda data: DataLoader(data, shuffle=True, num_workers=2),
        "exact",
    ),
    "a StatefulDataLoader": (
        lambda data: StatefulDataLoader(data, shuffle=True, num_workers=2, persistent_workers=True),
        "exact",
    ),
    "a plain DataLoader": (lambda data: DataLoader(data, shuffle=True), "exact"),
}


def workers_seed_refusal(source: str) -> str:
    """What a resumed run over a persistent loader whose order and workers' seed are drawn
    from ``source`` is refused with: the cause and the fix."""
    return (
        "the DataLoader has persistent_workers=True and draws its order from the "
        f"generator its workers' seed is drawn from ({source}): a DataLoader "
        "draws that seed when it starts its workers, so a resumed run draws it where "
        "the uninterrupted run did not, and shuffles every epoch from here on "
        "differently. Give the sampler a generator of its own, seeded at each "
        "epoch's start: DataLoader(data, sampler=RandomSampler(data, "
        "generator=order), generator=torch.Generator(), persistent_workers=True, "
        "...), or pass persistent_workers=False"
    )


SAVED_REFUSED = "a run resumed from this state is refused when its first epoch begins: "


class TestPersistentWorkers:
    """A DataLoader with persistent workers draws its workers' seed from its generator at
    its first epoch only: a resumed run draws it once more. Exact where the order has a
    generator of its own; refused where it is drawn from the same one."""

    def test_its_own_generator_for_the_order_resumes_bit_for_bit(self) -> None:
        """The guide's fix (a RandomSampler with the generator seeded at each epoch, the
        workers' seed from another; num_workers=2, persistent): every checkpoint of two
        epochs resumes to the uninterrupted run's parameters, including a mid-epoch one
        (the skipping loader) followed by a later epoch of the loader's own workers."""
        outcome = resumes.resumed_everywhere("persistent")
        assert list(outcome) == resumes.CHECKPOINTS
        assert all(outcome.values()), outcome

    def test_one_generator_for_the_order_and_the_workers_is_refused(self) -> None:
        """The issue's case (shuffle=True and generator=, seeded at each epoch; num_workers=2,
        persistent): the uninterrupted run trains; a run resumed from its first epoch,
        between epochs or from its second epoch is refused at its first next(), before
        anything is drawn from the generator, naming the fix (before: another order)."""
        saves: dict[str, bytes] = {}

        def checkpoint(run: resumes.Run) -> None:
            where = f"step {run.acc.global_step}" if run.acc.position else "epoch"
            saves.setdefault(where, run.save())

        with pytest.warns(gradaccum.GradaccumWarning, match=re.escape(SAVED_REFUSED)):
            resumes.train(resumes.Run("persistent, shared"), checkpoint)
        for where in ("step 2", "epoch", "step 4"):
            run = resumes.Run("persistent, shared").load(saves[where])
            epoch = run.acc.epochs_completed
            with pytest.raises(gradaccum.ConfigError) as caught:
                next(iter(run.acc.epoch(run.iterable(epoch))))
            assert str(caught.value) == workers_seed_refusal("its generator"), where
            fresh = torch.Generator().manual_seed(resumes.SEED + epoch)
            assert torch.equal(run.generator.get_state(), fresh.get_state()), where
            assert run.acc.epochs_completed == epoch

    def test_a_state_it_refuses_is_warned_about_when_saved(self) -> None:
        """The same run's state_dict() at every checkpoint (after each window and epoch, and
        at the top of the loop body of each window's first microbatch, the run's first
        included: position 0, handed out) warns once, at the line that called it, that a
        resume from it is refused, with the refusal's cause and fix. A state saved before
        the first epoch resumes no run (the refusal does not apply to it): not warned about
        (a warning fails the test)."""
        said: list[tuple[str, str, bool]] = []

        def save(run: resumes.Run) -> None:
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always", gradaccum.GradaccumWarning)
                line = sys._getframe().f_lineno + 1
                run.acc.state_dict()
            for warning in caught:
                said.append((str(warning.message), warning.filename, warning.lineno == line))

        run = resumes.Run("persistent, shared")
        run.acc.state_dict()
        resumes.train(run, save, top=save)
        expected = SAVED_REFUSED + workers_seed_refusal("its generator")
        saves = len(resumes.CHECKPOINTS) + len(resumes.TOPS)
        assert said == [(expected, __file__, True)] * saves

    @pytest.mark.parametrize("name", list(LOADERS))
    def test_a_state_is_warned_about_exactly_where_its_resume_is_refused(self, name: str) -> None:
        """A state saved after the epoch's first window (which resumes a run) is warned
        about exactly where the resumed run would be refused (the order drawn from the
        generator of the workers' seed), with the same cause and fix; not where it resumes,
        exactly or warned about then (a warning fails the test)."""
        make, outcome = LOADERS[name]
        loader = make(TensorDataset(torch.zeros(16, 1)))
        model, acc = fresh(drop_last=True)
        for _ in acc.epoch(loader):
            with acc.microstep(sum(param.sum() for param in model.parameters())) as step:
                pass
            if step.boundary:
                break
        if outcome in ("exact", "warned"):
            state = acc.state_dict()
        else:
            with pytest.warns(gradaccum.GradaccumWarning) as caught:
                state = acc.state_dict()
            refused = SAVED_REFUSED + workers_seed_refusal(outcome)
            assert [str(warning.message) for warning in caught] == [refused]
            assert caught[0].filename == __file__
        assert (state["position"], state["global_step"]) == (4, 1)
        acc.close()

    @pytest.mark.parametrize(
        ("name", "outcome"), [(name, out) for name, (_, out) in LOADERS.items()]
    )
    def test_what_is_refused(self, name: str, outcome: str) -> None:
        """Refused: the order drawn from the generator of the workers' seed (the sampler's
        or the batch sampler's; both None: torch's global random state). Warned: the
        workers' seed from the global random state (what draws from it later, dropout,
        moves). Accepted: an order of its own or none, workers that are not persistent, a
        loader that restores its own position (its state restores its order). No loader
        here starts a worker."""
        loader = LOADERS[name][0](TensorDataset(torch.zeros(16, 1)))
        if outcome == "warned":
            with pytest.warns(gradaccum.GradaccumWarning, match="no generator"):
                resuming.check_workers_seed(loader)
        elif outcome != "exact":
            with pytest.raises(
                gradaccum.ConfigError, match=re.escape(f"is drawn from ({outcome})")
            ):
                resuming.check_workers_seed(loader)
        else:
            resuming.check_workers_seed(loader)


@pytest.mark.parametrize(
    "kind", [*resumes.KINDS, "no loader generator", "no loader generator, drawn", "augmented"]
)
def test_resume_at_every_window_boundary_is_bit_for_bit(kind: str) -> None:
    """Two epochs with dropout and a shuffled loader, checkpointed after every window
    and every epoch, each resumed in fresh objects by the guide's recipe: every resumed
    run ends with the uninterrupted run's parameters (torch.equal). A DataLoader without
    a generator of its own once resumed mid-epoch otherwise: the iterator it made for the
    resumed epoch drew its workers' seed from torch's global random state, just restored,
    which the uninterrupted run had drawn before the checkpoint, so every dropout mask
    after it moved."""
    outcome = resumes.resumed_everywhere(kind)
    assert list(outcome) == resumes.CHECKPOINTS
    assert all(outcome.values()), outcome


@pytest.mark.parametrize(
    "kind", ["dataloader", "generator", "no loader generator", "no loader generator, drawn"]
)
def test_a_checkpoint_at_the_top_of_the_loop_body_resumes_bit_for_bit(kind: str) -> None:
    """Checkpointed at the top of the loop body of every window's first microbatch (handed
    out, not back-propagated: the resume hands it out again), each resumed in fresh
    objects: bit for bit, an epoch's first microbatch included. The saved run drew that
    microbatch before the random state saved: at an epoch's first, it made the epoch's
    iterator (a DataLoader without a generator draws its workers' seed from torch's), and
    the resumed epoch once made its own from the restored state, so every dropout mask
    after it moved (0.06 off). The state records the microbatch handed out, and the
    resumed epoch draws it (and makes its iterator) without moving the random state."""
    outcome = resumes.resumed_everywhere(kind, top=True)
    assert list(outcome) == resumes.TOPS
    assert all(outcome.values()), outcome


def test_augmentation_in_the_main_process_makes_a_top_of_body_checkpoint_inexact() -> None:
    """What the checkpoint guide says: samples that draw noise from torch's random state as
    they are loaded in the main process resume bit for bit from a checkpoint after a
    block (the test above this one's neighbour), but not from one at the top of the loop
    body, whose handed-out microbatch the saved run drew before the state was saved: the
    resumed run draws it again, with other noise."""
    outcome = resumes.resumed_everywhere("augmented", top=True)
    assert list(outcome) == resumes.TOPS
    assert not any(outcome.values()), outcome


class Unseeded(resumes.Run):
    """The recipe without seeding the loader's generator at each epoch's start."""

    def iterable(self, epoch: int) -> Any:
        return self.loader


class Unrestored(resumes.Run):
    """The recipe without restoring the random state."""

    def load(self, blob: bytes) -> resumes.Run:
        state = torch.get_rng_state()
        super().load(blob)
        torch.set_rng_state(state)
        return self


@pytest.mark.parametrize("run", [Unseeded, Unrestored])
def test_the_recipe_is_needed_whole(run: type[resumes.Run]) -> None:
    """Leaving out the generator's seed or the random state makes the resume differ:
    the bit-for-bit test above depends on both (dropout and shuffling are live)."""
    saves = []

    def checkpoint(run: resumes.Run) -> None:
        if run.acc.global_step == 4 and run.acc.position:  # in the second epoch
            saves.append(run.save())

    whole = resumes.train(run("dataloader"), checkpoint)
    resumed = resumes.train(run("dataloader").load(saves[0]))
    assert not all(
        torch.equal(p, q)
        for p, q in zip(whole.model.parameters(), resumed.model.parameters(), strict=True)
    )


@pytest.mark.parametrize("mid_epoch", [True, False], ids=["mid_epoch", "between_epochs"])
def test_a_resume_over_a_loader_shuffled_by_the_global_state_is_warned_about(
    mid_epoch: bool,
) -> None:
    """``DataLoader(shuffle=True)`` without a generator draws its order from torch's global
    random state: a mid-epoch resume draws another order and skips into it, training on
    other microbatches than the uninterrupted run, which once went unsaid. Between
    epochs the next epoch is a fresh shuffle either way: nothing to say."""
    data = TensorDataset(torch.randn(24, 5), torch.randn(24, 1))
    model = torch.nn.Linear(5, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    acc = gradaccum.Accumulator(model, optimizer, steps=2)
    loader = DataLoader(data, batch_size=4, shuffle=True)
    for x, y in acc.epoch(loader):
        with acc.microstep((model(x) - y).square().mean()):
            pass
        if mid_epoch and acc.global_step == 1:
            break
    state = acc.state_dict()
    resumed = gradaccum.Accumulator(model, torch.optim.SGD(model.parameters(), lr=0.1), steps=2)
    resumed.load_state_dict(state)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        next(iter(resumed.epoch(loader)))
    said = [str(warning.message) for warning in caught]
    if mid_epoch:
        assert len(said) == 1, said
        assert said[0].startswith(
            "resuming mid-epoch over a DataLoader that shuffles with torch's global random "
            "state (its sampler has no generator)"
        ), said
    else:
        assert not said


def test_the_resume_example_resumes_in_another_process(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """examples/resume.py stops a run with dropout and a shuffled DataLoader mid-epoch in
    one process, resumes it in another, and finds the uninterrupted run's parameters (its
    StatefulDataLoader variant is the recipe that `resumes` checks at every boundary)."""
    spec = importlib.util.spec_from_file_location("resume_example", ROOT / "examples" / "resume.py")
    assert spec is not None
    assert spec.loader is not None
    example = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, spec.name, example)  # for its dataclass
    spec.loader.exec_module(example)
    assert example.main([]) == 0
    assert capsys.readouterr().out.splitlines()[-1] == (
        "stopped after 21 of 48 optimizer steps; resumed bit for bit: True"
    )


class TestGlobalOrder:
    """resuming.global_order: what a DataLoader over a DistributedSampler, or an iterable's
    global_order(), tells of the epoch's order over the ranks (no process group needed:
    the sampler is told its ranks)."""

    data = TensorDataset(torch.arange(50.0))

    def loader(self, world: int, *, sampler_drop_last: bool, drop_last: bool, shuffle: bool):
        sampler = DistributedSampler(
            self.data, world, 0, shuffle=shuffle, seed=3, drop_last=sampler_drop_last
        )
        sampler.set_epoch(5)
        return DataLoader(self.data, batch_size=4, sampler=sampler, drop_last=drop_last)

    @pytest.mark.parametrize(
        ("sampler_drop_last", "drop_last", "samples"),
        [(False, False, 52), (True, False, 48), (False, True, 48), (True, True, 48)],
    )
    def test_a_distributed_sampler_is_read(
        self, sampler_drop_last: bool, drop_last: bool, samples: int
    ) -> None:
        """50 samples on 4 ranks: the sampler pads to 52 or cuts to 48 (13 or 12 a rank),
        the loader's drop_last keeps 12 a rank (3 batches of 4); the epoch is the
        sampler's when it shuffles."""
        loader = self.loader(
            4, sampler_drop_last=sampler_drop_last, drop_last=drop_last, shuffle=True
        )
        assert resuming.global_order(loader, len(loader), 4) == gradaccum.GlobalOrder(
            "DistributedSampler(shuffle=True, seed=3) of 50 samples", 5, samples, 4, 4
        )
        plain = self.loader(4, sampler_drop_last=False, drop_last=False, shuffle=False)
        order = resuming.global_order(plain, len(plain), 4)
        assert order is not None
        assert order.epoch is None  # the same order every epoch

    def test_what_does_not_say_is_not_known(self) -> None:
        """Another sampler, another number of ranks than the gradients', a generator: None."""
        loader = self.loader(4, sampler_drop_last=False, drop_last=False, shuffle=True)
        assert resuming.global_order(loader, len(loader), 2) is None
        assert resuming.global_order(DataLoader(self.data, batch_size=4), 13, 1) is None
        assert resuming.global_order(iter(loader), None, 4) is None

    def test_an_iterable_declares_its_order(self) -> None:
        """global_order() is called each epoch; it must return a GlobalOrder."""

        class Declared(list):
            def global_order(self) -> Any:
                return answer

        answer: Any = gradaccum.GlobalOrder("corpus", 0, 8, 2, 2)
        assert resuming.global_order(Declared([1, 2]), 2, 2) == answer
        assert resuming.global_order(Declared([1]), 1, 2) is None  # not its length
        answer = {"data": "corpus"}
        with pytest.raises(gradaccum.ConfigTypeError) as caught:
            resuming.global_order(Declared([1, 2]), 2, 2)
        assert str(caught.value) == (
            "the epoch's iterable's global_order() must return a gradaccum.GlobalOrder, got "
            "{'data': 'corpus'} (dict)"
        )
