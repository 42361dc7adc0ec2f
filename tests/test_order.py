"""The global order (gradaccum/order.py): its windows against an independent simulation of
a DistributedSampler's shards, a DataLoader's batches and the accumulator's windows, and
the refusals of a resume on another number of ranks, with their messages. Integers only."""

from __future__ import annotations

from collections import Counter
from fractions import Fraction

import pytest
from hypothesis import given
from hypothesis import strategies as st

from gradaccum.errors import ConfigError, ConfigTypeError
from gradaccum.order import GlobalOrder, Rescale, Windows, windows
from gradaccum.schedule import divisors

Window = Counter[int]  # sample -> its weight in mean mode


def shard(n: int, world: int, batch: int, sampler_drop_last: bool, loader_drop_last: bool):
    """Each rank's microbatches, as lists of positions of the epoch's order, the way a
    DistributedSampler (padding cyclically, or cutting, to a multiple of the ranks) and a
    DataLoader (dropping a last, shorter batch, or not) hand them out."""
    total = (n // world if sampler_drop_last else -(-n // world)) * world
    ranks = []
    for rank in range(world):
        positions = list(range(rank, total, world))
        batches = [positions[at : at + batch] for at in range(0, len(positions), batch)]
        if loader_drop_last and batches and len(batches[-1]) < batch:
            batches.pop()
        ranks.append(batches)
    return ranks


def simulated(
    n: int,
    world: int,
    batch: int,
    steps: int,
    start: int,
    drops: tuple[bool, bool, bool],
    *,
    samples: bool = True,
) -> list[Window]:
    """The windows the accumulator trains from microbatch ``start`` of every rank: what
    each of the epoch's samples (position mod ``n``; without ``samples``, each position)
    weighs in mean mode, a microbatch's mean loss divided by the window's microbatches and
    averaged over the ranks."""
    ranks = shard(n, world, batch, drops[0], drops[1])
    count = len(ranks[0])
    cut = []
    for first in range(start, count, steps):
        size = min(steps, count - first)
        if size < steps and drops[2]:
            break
        window: Window = Counter()
        for batches in ranks:
            for microbatch in batches[first : first + size]:
                for position in microbatch:
                    weight = Fraction(1, len(microbatch) * size * world)
                    window[position % n if samples else position] += weight  # type: ignore[assignment]
        cut.append(window)
    return cut


def order_of(n: int, world: int, batch: int, drops: tuple[bool, bool, bool]) -> GlobalOrder:
    held = sum(len(microbatch) for microbatch in shard(n, world, batch, *drops[:2])[0])
    return GlobalOrder(f"{n} samples", 0, held * world, batch, world)


def as_windows(cut: Windows) -> list[tuple[int, int, tuple[Fraction, ...]]]:
    """``cut`` as (first position, positions, weights): comparable with a simulation."""
    out = [(cut.start + k * cut.size, cut.size, ()) for k in range(cut.full)]
    if cut.last:
        weights = tuple(weight for count, weight in cut.last for _ in range(count))
        out.append((cut.start + cut.full * cut.size, len(weights), weights))
    return out


geometries = st.tuples(
    st.integers(1, 120),  # samples in the dataset
    st.integers(1, 8),  # ranks
    st.integers(1, 4),  # batch size per rank
    st.integers(1, 6),  # steps
    st.tuples(st.booleans(), st.booleans(), st.booleans()),  # sampler, loader, accumulator
)


class TestWindows:
    @given(geometry=geometries, data=st.data())
    def test_windows_are_what_the_ranks_train(self, geometry, data: st.DataObject) -> None:
        """windows() cuts the rest of an epoch from any microbatch into the windows, of the
        positions and mean-mode weights, that the ranks' microbatches make."""
        n, world, batch, steps, drops = geometry
        order = order_of(n, world, batch, drops)
        start = data.draw(st.integers(0, order.microbatches))
        cut = windows(order, start, steps, drops[2])
        got = []
        for first, size, weights in as_windows(cut):
            weight = weights or (Fraction(1, size),) * size
            got.append(Counter(dict(zip(range(first, first + size), weight, strict=True))))
        assert got == simulated(n, world, batch, steps, start, drops, samples=False)

    @given(geometry=geometries, data=st.data())
    def test_the_trained_positions_are_the_first_microbatches(
        self, geometry, data: st.DataObject
    ) -> None:
        """After k microbatches of every rank, the job has trained the first
        trained_after(k) positions of the order, whatever the number of ranks."""
        n, world, batch, _, drops = geometry
        order = order_of(n, world, batch, drops)
        k = data.draw(st.integers(0, order.microbatches))
        ranks = shard(n, world, batch, *drops[:2])
        trained = {position for batches in ranks for mb in batches[:k] for position in mb}
        assert trained == set(range(order.trained_after(k)))


class TestRescaleProperty:
    @given(geometry=geometries, data=st.data())
    def test_accepted_resumes_train_the_same_samples(self, geometry, data: st.DataObject) -> None:
        """For any dataset size, batch size, world size W, steps and W' dividing W*steps,
        and a checkpoint after any window of an epoch: where Rescale accepts the epoch on
        W' ranks (steps' = W*steps/W'), its windows there are the same samples, each
        weighing the same, as on W, for the rest of that epoch and for a whole epoch; and
        where they are the same positions, it is accepted (no false refusal). With
        num_items, the same samples suffice."""
        n, world, batch, steps, drops = geometry
        here = data.draw(st.sampled_from(divisors(world * steps)))
        here_steps = world * steps // here
        by_items = data.draw(st.booleans())
        saved = order_of(n, world, batch, drops)
        after = data.draw(st.integers(0, saved.microbatches // steps))
        trained = saved.trained_after(after * steps)
        rescale = Rescale(saved, trained, world, steps, by_items)
        order = order_of(n, here, batch, drops)

        def same(samples: bool) -> tuple[bool, bool]:
            """The whole epoch, and its rest, cut alike on both (by samples or positions)."""

            def alike(a: list[Window], b: list[Window]) -> bool:
                return [set(w) for w in a] == [set(w) for w in b] if by_items else a == b

            def cut(ranks: int, steps: int, start: int) -> list[Window]:
                return simulated(n, ranks, batch, steps, start, drops, samples=samples)

            whole = alike(cut(world, steps, 0), cut(here, here_steps, 0))
            rest = skip <= order.microbatches and alike(
                cut(world, steps, after * steps), cut(here, here_steps, skip)
            )
            return whole, rest or not trained

        try:
            skip = rescale.skip(here)
        except ConfigError:
            assert trained % (here * batch)  # a position inside a microbatch there
            return
        try:
            rescale.check(order, here_steps, drops[2], restores_itself=False)
        except ConfigError:
            # Refused only where positions differ (padding may repeat a sample at two
            # positions: refused although the weights add up alike)
            assert same(samples=False) != (True, True)
        else:
            assert same(samples=True) == (True, True)


ORDER = GlobalOrder("corpus", 0, 104, 4, 2)


class TestRescaleRefusals:
    """A state saved on 2 ranks with steps 4, 64 samples into an epoch of 104 (batches of
    4), resumed on 4 ranks with steps 2."""

    rescale = Rescale(ORDER, 64, 2, 4, False)
    where = "the loaded state resumes after sample 64 of corpus, epoch 0"

    def test_the_same_order_from_the_same_sample_is_accepted(self) -> None:
        """104 samples on 4 ranks: 6 whole microbatches and one of 2 samples per rank, the
        same windows of 32 as on 2 ranks; the epoch resumes at microbatch 4."""
        assert self.rescale.skip(4) == 4
        self.rescale.check(GlobalOrder("corpus", 0, 104, 4, 4), 2, True, restores_itself=False)

    def test_an_iterable_that_restores_itself_is_refused(self) -> None:
        """Its own state, saved by each of the 2 ranks, does not carry over to 4."""
        with pytest.raises(ConfigError) as caught:
            self.rescale.check(ORDER, 2, True, restores_itself=True)
        assert str(caught.value) == (
            f"{self.where}, saved on 2 ranks, but this epoch's iterable restores its own "
            "position from a state that each of those ranks saved, which does not carry over "
            "to another number of ranks; pass a DataLoader over a DistributedSampler "
            "(gradaccum skips its trained samples), or resume on 2 ranks with steps=4, as saved"
        )

    def test_an_unknown_order_is_refused(self) -> None:
        with pytest.raises(ConfigError, match="does not declare its global order"):
            self.rescale.check(None, 2, True, restores_itself=False)

    @pytest.mark.parametrize(("data", "epoch"), [("corpus", 1), ("other", 0), ("corpus", None)])
    def test_another_order_is_refused(self, data: str, epoch: int | None) -> None:
        """Another dataset or epoch (a set_epoch forgotten) is not where the state was."""
        order = GlobalOrder(data, epoch, 104, 4, 4)
        with pytest.raises(ConfigError) as caught:
            self.rescale.check(order, 2, True, restores_itself=False)
        assert str(caught.value) == (
            f"{self.where}, but this epoch's order is {order.named()}; pass the data the state "
            "was saved with, in the epoch's order (with a DistributedSampler, call "
            "sampler.set_epoch(0) before the epoch)"
        )

    def test_another_batch_size_is_refused(self) -> None:
        with pytest.raises(ConfigError) as caught:
            self.rescale.check(GlobalOrder("corpus", 0, 104, 2, 4), 4, True, restores_itself=False)
        assert str(caught.value) == (
            "the loaded state was saved with batches of 4 samples per rank, but this epoch's "
            "are of 2; the windows keep the global batch of 32 samples only with the batch "
            "size they were saved with: pass batch_size=4"
        )

    def test_an_epoch_cut_shorter_is_refused(self) -> None:
        """The sampler cuts 66 samples to 64 on 4 ranks: the saved position is its end."""
        rescale = Rescale(GlobalOrder("corpus", 0, 66, 4, 2), 64, 2, 4, False)
        with pytest.raises(ConfigError) as caught:
            rescale.check(GlobalOrder("corpus", 0, 48, 4, 4), 2, True, restores_itself=False)
        assert str(caught.value) == (
            "the loaded state resumes after sample 64 of corpus, epoch 0, but on 4 ranks this "
            "epoch holds only 48 samples (the sampler cuts the order to a multiple of the "
            "ranks); resume on 2 ranks with steps=4, as saved"
        )

    def test_a_position_inside_a_microbatch_is_refused(self) -> None:
        """After 40 samples (steps changed mid-epoch), 4 ranks' microbatches of 16 do not
        start there; 1 and 2 ranks' would."""
        with pytest.raises(ConfigError) as caught:
            Rescale(ORDER, 40, 2, 4, False).skip(4)
        assert str(caught.value) == (
            "the loaded state resumes after sample 40 of its epoch's order, which falls inside "
            "a microbatch of 4 ranks (4 x 4 = 16 samples each): its windows were cut from a "
            "position that 4 ranks do not reach (steps was changed mid-epoch); resume on 1 or "
            "2 ranks, or from a checkpoint between epochs"
        )

    def test_between_epochs_an_epoch_of_other_data_is_not_compared(self) -> None:
        """A state saved between epochs resumes no position: the next epoch may be of other
        data, and is compared only when it is of the same."""
        Rescale(ORDER, 0, 2, 4, False).check(
            GlobalOrder("other", 5, 12, 4, 4), 2, False, restores_itself=False
        )
        Rescale(None, 0, 2, 4, None).check(None, 2, False, restores_itself=False)


class TestGlobalOrder:
    def test_fields_are_validated(self) -> None:
        with pytest.raises(ConfigTypeError, match="data must be a str"):
            GlobalOrder(3, 0, 8, 2, 2)  # type: ignore[arg-type]
        with pytest.raises(ConfigError) as caught:
            GlobalOrder("corpus", 0, 9, 2, 2)
        assert str(caught.value) == (
            "samples must be a multiple of world_size (as many positions on each rank), got "
            "samples=9 and world_size=2"
        )
        with pytest.raises(ConfigError, match="batch_size"):
            GlobalOrder("corpus", 0, 8, 0, 2)

    def test_microbatches_and_names(self) -> None:
        order = GlobalOrder("corpus", None, 1000, 8, 4)
        assert (order.microbatches, order.row, order.trained_after(40)) == (32, 32, 1000)
        assert order.named() == "corpus"
        assert GlobalOrder("corpus", 3, 8, 2, 2).named() == "corpus, epoch 3"
