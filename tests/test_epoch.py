"""acc.epoch: the drop-last rule, exact partial windows, iterables without len, the guard."""

from __future__ import annotations

import copy
from collections.abc import Iterator

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import gradaccum
from tests.helpers import (
    Batch,
    make_batches,
    make_model,
    max_param_diff,
    mean_loss,
    reference_sgd,
    sgd,
    windows_of,
)

TOL = 1e-10


def train(acc: gradaccum.Accumulator, model, batches) -> int:
    count = 0
    for batch in acc.epoch(batches):
        count += 1
        with acc.microstep(mean_loss(model, batch)):
            pass
    return count


def generator(batches: list) -> Iterator:
    yield from batches


@pytest.mark.parametrize("sized", [True, False])
@pytest.mark.parametrize(("n", "steps"), [(13, 4), (14, 4), (5, 3), (3, 4), (7, 7)])
def test_partial_window_is_scaled_by_its_own_length(n: int, steps: int, sized: bool) -> None:
    """drop_last=False: the trailing k microbatches step as one window with weight 1/k."""
    batches = make_batches([3] * n)
    model = make_model()
    windows = windows_of(batches, steps, drop_last=False)
    expected = reference_sgd(model, windows, lr=0.1)
    acc = gradaccum.Accumulator(model, sgd(model), steps=steps, drop_last=False)
    assert train(acc, model, batches if sized else generator(batches)) == n
    assert acc.global_step == len(windows) == gradaccum.total_steps(n, steps, drop_last=False)
    assert max_param_diff(model, expected) < TOL


def test_partial_window_boundary_is_armed_before_its_forward() -> None:
    """The last microbatch of a short trailing window is announced as the boundary."""
    for iterable in (make_batches([1] * 6), generator(make_batches([1] * 6))):
        model = make_model()
        acc = gradaccum.Accumulator(model, sgd(model), steps=4, drop_last=False)
        flags = []
        for batch in acc.epoch(iterable):
            flags.append(acc.sync_gradients)
            with acc.microstep(mean_loss(model, batch)):
                pass
        assert flags == [False, False, False, True, False, True]


def test_unsized_iterable_discards_trailing_gradient() -> None:
    """Without len, the trailing partial window is back-propagated but never applied."""
    batches = make_batches([2] * 13)
    model = make_model()
    expected = reference_sgd(model, windows_of(batches, 4), lr=0.1)
    acc = gradaccum.Accumulator(model, sgd(model), steps=4)
    assert train(acc, model, generator(batches)) == 13
    assert acc.global_step == 3
    assert all(p.grad is None for p in model.parameters())
    assert max_param_diff(model, expected) < TOL


def test_windows_never_span_epochs() -> None:
    """Two epochs of 6 with steps=4: 1 step each, never a window of 2 + 2."""
    batches = make_batches([2] * 6)
    model = make_model()
    expected = reference_sgd(model, [batches[0:4], batches[0:4]], lr=0.1)
    acc = gradaccum.Accumulator(model, sgd(model), steps=4)
    for _ in range(2):
        assert train(acc, model, batches) == 4
    assert acc.global_step == 2
    assert max_param_diff(model, expected) < TOL


class Exploding:
    """A sized iterable that fails the test if anything is drawn from it."""

    def __len__(self) -> int:
        return 3

    def __iter__(self) -> Iterator[object]:
        raise AssertionError("the guard must refuse before the first microbatch")


def test_guard_refuses_an_epoch_without_a_step_before_any_work() -> None:
    """len 3 with steps=4 raises at the epoch's first next(), before drawing anything,
    naming steps and the epoch length."""
    model = make_model()
    acc = gradaccum.Accumulator(model, sgd(model), steps=4)
    with pytest.raises(ValueError, match=r"epoch of 3 microbatches.*steps=4") as caught:
        next(acc.epoch(Exploding()))
    assert "drop_last=False" in str(caught.value)
    with pytest.raises(ValueError, match="empty"):
        next(acc.epoch([]))
    assert acc.global_step == 0


def test_guard_for_unsized_epochs_comes_at_their_end() -> None:
    """Without len the shortfall shows only at the end; the gradient is discarded."""
    model = make_model()
    acc = gradaccum.Accumulator(model, sgd(model), steps=4)
    with pytest.raises(ValueError, match=r"epoch of 3 microbatches.*discarded"):
        train(acc, model, generator(make_batches([1] * 3)))
    assert all(p.grad is None for p in model.parameters())
    assert acc.global_step == 0


def test_drop_last_false_accepts_a_short_epoch() -> None:
    """3 microbatches with steps=4 and drop_last=False: one window of 3."""
    model = make_model()
    acc = gradaccum.Accumulator(model, sgd(model), steps=4, drop_last=False)
    assert train(acc, model, make_batches([1] * 3)) == 3
    assert acc.global_step == 1


def test_window_left_open_is_discarded_with_a_warning() -> None:
    """Breaking out mid-window, then starting an epoch: the stale gradient is dropped."""
    batches = make_batches([2] * 8)
    model = make_model()
    acc = gradaccum.Accumulator(model, sgd(model), steps=4)
    for index, batch in enumerate(acc.epoch(batches)):
        with acc.microstep(mean_loss(model, batch)):
            pass
        if index == 5:
            break
    assert acc.global_step == 1
    expected = reference_sgd(model, [batches[0:4], batches[4:8]], lr=0.1)
    with pytest.warns(gradaccum.GradaccumWarning, match="2 microsteps of a window left open"):
        assert train(acc, model, batches) == 8
    assert acc.global_step == 3
    assert max_param_diff(expected, model) < TOL


def test_skipped_microstep_is_reported_at_epoch_end() -> None:
    """A microbatch handed out but never stepped leaves an incomplete window: warned, dropped."""
    batches = make_batches([2] * 8)
    model = make_model()
    acc = gradaccum.Accumulator(model, sgd(model), steps=4)

    def epoch_skipping_the_third() -> None:
        for index, batch in enumerate(acc.epoch(batches)):
            if index != 2:
                with acc.microstep(mean_loss(model, batch)):
                    pass

    with pytest.warns(gradaccum.GradaccumWarning, match="incomplete window at the end"):
        epoch_skipping_the_third()
    assert acc.global_step == 1
    assert all(p.grad is None for p in model.parameters())


def test_len_that_lies_is_reported() -> None:
    """An iterable that yields fewer items than its len() is an error, not a silent stop."""

    class Liar:
        def __len__(self) -> int:
            return 8

        def __iter__(self) -> Iterator[object]:
            return iter(make_batches([1] * 5))

    model = make_model()
    acc = gradaccum.Accumulator(model, sgd(model), steps=4)
    with pytest.raises(gradaccum.ConfigError, match=r"ended after 5 items; its len\(\) promised 8"):
        train(acc, model, Liar())


@pytest.mark.parametrize(("n", "steps"), [(4, 3), (8, 3), (7, 5)])
def test_known_length_partial_window_divides_by_k_from_its_first_microstep(
    n: int, steps: int
) -> None:
    """With len known, the trailing window's gradient is bitwise the hand-written 1/k loop."""
    batches = make_batches([3] * n)
    model = make_model()
    acc = gradaccum.Accumulator(model, sgd(model), steps=steps, drop_last=False)
    k = n % steps
    for index, batch in enumerate(acc.epoch(batches)):
        if index == n - k:  # the trailing window starts: replay it by hand on a twin
            twin = copy.deepcopy(model)
            for tail in batches[n - k :]:
                (mean_loss(twin, tail) / k).backward()
        with acc.microstep(mean_loss(model, batch)) as step:
            if index == n - 1:
                assert step.boundary
                for p, q in zip(model.parameters(), twin.parameters(), strict=True):
                    assert torch.equal(p.grad, q.grad)


@settings(max_examples=150, deadline=None)
@given(
    n=st.integers(min_value=0, max_value=30),
    steps=st.integers(min_value=1, max_value=7),
    drop_last=st.booleans(),
    sized=st.booleans(),
)
def test_boundaries_are_announced_before_each_forward(
    n: int, steps: int, drop_last: bool, sized: bool
) -> None:
    """acc.sync_gradients, read before the forward, marks exactly the windows' last items."""
    per_epoch = gradaccum.total_steps(n, steps, drop_last=drop_last)
    # Without len the trailing partial window is still handed out (then discarded).
    handed = per_epoch * steps if drop_last and sized else n
    expected = [(i + 1) % steps == 0 or (not drop_last and i == n - 1) for i in range(handed)]
    model = make_model()
    optimizer = sgd(model)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda _: 1.0)
    acc = gradaccum.Accumulator(model, optimizer, scheduler, steps=steps, drop_last=drop_last)
    batches = [(torch.ones(1, 5, dtype=torch.float64), torch.zeros(1, 1, dtype=torch.float64))] * n
    flags = []
    try:
        for batch in acc.epoch(batches if sized else generator(batches)):
            flags.append(acc.sync_gradients)
            with acc.microstep(mean_loss(model, batch)) as step:
                assert step.boundary is flags[-1]
    except gradaccum.ConfigError:
        assert per_epoch == 0  # the guard, and only when no step is possible
        return
    assert flags == expected
    assert acc.global_step == scheduler.last_epoch == per_epoch


def test_dataloader_over_an_iterable_dataset_is_treated_as_unsized() -> None:
    """DataLoader(IterableDataset) has __len__ that raises: handled as an unsized epoch."""

    class Stream(torch.utils.data.IterableDataset[torch.Tensor]):
        def __iter__(self) -> Iterator[torch.Tensor]:
            return iter(torch.randn(7, 5, dtype=torch.float64))

    loader = torch.utils.data.DataLoader(Stream(), batch_size=None)
    model = make_model()
    acc = gradaccum.Accumulator(model, sgd(model), steps=3, drop_last=False)
    handed = 0
    for x in acc.epoch(loader):
        handed += 1
        with acc.microstep(model(x).square().mean()):
            pass
    assert (handed, acc.global_step) == (7, 3)


def test_raising_steps_late_in_an_unsized_epoch_is_not_refused_by_the_guard() -> None:
    """The unsized guard refuses an epoch that closed no window, not one whose steps were
    raised after it closed some (the trailing partial window is dropped, as documented)."""
    batches = make_batches([2] * 5)
    model = make_model()
    acc = gradaccum.Accumulator(model, sgd(model), steps=2)
    for index, batch in enumerate(acc.epoch(generator(batches))):
        with acc.microstep(mean_loss(model, batch)):
            pass
        if index == 3:
            acc.steps = 6
    assert acc.global_step == 2
    assert all(p.grad is None for p in model.parameters())


def test_a_failed_window_caught_in_the_loop_restarts_the_windows_after_it() -> None:
    """Sized epoch, the second window's first microstep raises and the loop goes on: the
    next window starts after the failed microbatch, and the epoch ends without an
    incomplete window (so no warning blames the loop for skipping microbatches)."""
    batches = make_batches([2] * 10)
    model = make_model()
    acc = gradaccum.Accumulator(model, sgd(model), steps=4)
    windows = [batches[0:4], batches[5:9]]
    expected = reference_sgd(model, windows, lr=0.1)
    for index, batch in enumerate(acc.epoch(batches)):
        try:
            with acc.microstep(mean_loss(model, batch)):
                if index == 4:
                    raise KeyError("a bad batch")
        except KeyError:
            continue
    assert acc.global_step == 2
    assert max_param_diff(model, expected) < TOL


class EndsItsEpoch:
    """A sized iterable whose iterator runs code after its last item, as Accelerate's
    prepared loader advances its epoch there; ``endless`` yields past its ``len``."""

    def __init__(self, batches: list[Batch], endless: bool = False) -> None:
        self.batches = batches
        self.endless = endless
        self.ended = 0
        self.drawn = 0

    def __len__(self) -> int:
        return len(self.batches)

    def __iter__(self) -> Iterator[Batch]:
        while True:
            for batch in self.batches:
                self.drawn += 1
                yield batch
            if not self.endless:
                break
        self.ended += 1


class CountsLoads(torch.utils.data.Dataset[Batch]):
    def __init__(self, batches: list[Batch]) -> None:
        self.batches = batches
        self.loaded = 0

    def __len__(self) -> int:
        return len(self.batches)

    def __getitem__(self, index: int) -> Batch:
        self.loaded += 1
        return self.batches[index]


@pytest.mark.parametrize("n", [8, 10])
def test_an_iterable_that_runs_code_at_its_end_is_run_to_it(n: int) -> None:
    """An epoch stopped after its last trained microbatch, so an iterable's code after its
    last item never ran (Accelerate's prepared loader kept its epoch, and its shuffle).
    It now runs to its end every epoch, its dropped remainder drawn; one whose ``len``
    is short of what it yields is drawn at most one past it. A plain DataLoader's
    dropped remainder is still never loaded."""
    model = make_model()
    acc = gradaccum.Accumulator(model, torch.optim.SGD(model.parameters(), lr=0.1), steps=4)
    batches = make_batches([2] * n)
    ends = EndsItsEpoch(batches)
    for epoch in range(2):
        for batch in acc.epoch(ends):
            with acc.microstep(mean_loss(model, batch)):
                pass
        assert (ends.ended, ends.drawn) == (epoch + 1, n * (epoch + 1))
    endless = EndsItsEpoch(batches, endless=True)
    for batch in acc.epoch(endless):
        with acc.microstep(mean_loss(model, batch)):
            pass
    assert endless.drawn == n + 1
    dataset = CountsLoads(batches)
    loader = torch.utils.data.DataLoader(dataset, batch_size=None)
    for batch in acc.epoch(loader):
        with acc.microstep(mean_loss(model, batch)):
            pass
    assert dataset.loaded == 8
    assert acc.global_step == 4 * 2
