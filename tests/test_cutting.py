"""`gradaccum.cutting`: a batch's rows, and its cut into microbatches along dim 0."""

from __future__ import annotations

from collections import namedtuple
from dataclasses import dataclass, field

import pytest
import torch

from gradaccum.cutting import cut, rows
from gradaccum.errors import ConfigError

Pair = namedtuple("Pair", ["x", "y"])


@dataclass
class Batch:
    x: torch.Tensor
    mask: torch.Tensor
    name: str = "wiki"
    total: int = field(init=False, default=0)

    def __post_init__(self) -> None:
        self.total = int(self.mask.sum())


class TestRows:
    def test_every_container_s_tensors_give_the_rows(self) -> None:
        """Tensors inside dicts, lists, tuples, named tuples and dataclasses, at any depth,
        agree on dim 0: that is the batch's rows; 0-dim tensors and other leaves are not
        counted."""
        x = torch.zeros(6, 3)
        batch = {"a": [x, (x[:, 0], torch.tensor(2.0))], "b": Pair(x, "s"), "c": None}
        assert rows(batch) == 6
        assert rows(Batch(x, torch.ones(6))) == 6

    def test_disagreeing_tensors_are_named(self) -> None:
        """The first tensor and the first that disagrees are named by their paths."""
        with pytest.raises(
            ConfigError, match=r"batch\['x'\] has 4 rows but batch\['y'\]\[1\] has 3"
        ):
            rows({"x": torch.zeros(4), "y": [torch.zeros(4), torch.zeros(3)]})
        with pytest.raises(ConfigError, match=r"batch.x has 2 rows but batch.mask has 3"):
            rows(Batch(torch.zeros(2), torch.ones(3)))

    def test_a_batch_without_rows_is_refused(self) -> None:
        """No tensor with a dim 0, or none of its rows, cannot be cut."""
        with pytest.raises(ConfigError, match="no tensor with a dim 0"):
            rows({"a": torch.tensor(1.0), "b": "text"})
        with pytest.raises(ConfigError, match="0 rows"):
            rows(torch.zeros(0, 3))


class TestCut:
    def test_pieces_are_views_in_the_batch_s_containers(self) -> None:
        """Each microbatch keeps the batch's container types (a named tuple, a dataclass
        rebuilt through its __init__), slices every tensor with a dim 0 as a view, and
        passes other leaves as they are; the last microbatch is shorter."""
        x = torch.arange(10.0).reshape(5, 2)
        scale = torch.tensor(3.0)
        batch = {"pair": Pair(x, "tag"), "data": Batch(x[:, 0], torch.ones(5)), "s": scale}
        pieces = cut(batch, 5, 2)
        assert [taken for _, taken in pieces] == [2, 2, 1]
        last, _ = pieces[-1]
        assert isinstance(last["pair"], Pair)
        assert last["pair"].y == "tag"
        assert torch.equal(last["pair"].x, x[4:])
        assert last["pair"].x.untyped_storage().data_ptr() == x.untyped_storage().data_ptr()
        assert isinstance(last["data"], Batch)
        assert last["data"].total == 1
        assert last["s"] is scale
        lists = cut([x, (x,)], 5, 4)
        assert isinstance(lists[0][0], list)
        assert isinstance(lists[0][0][1], tuple)

    @pytest.mark.parametrize(("total", "size"), [(1, 1), (7, 3), (8, 8), (8, 20), (9, 2)])
    def test_the_pieces_cover_the_rows_in_order(self, total: int, size: int) -> None:
        """Concatenated, the microbatches are the batch, in order."""
        x = torch.arange(total)
        pieces = cut(x, total, min(size, total))
        assert torch.equal(torch.cat([piece for piece, _ in pieces]), x)
        assert all(len(piece) == taken for piece, taken in pieces)
