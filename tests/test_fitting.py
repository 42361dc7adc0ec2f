"""`gradaccum.fitting`: acc.step's microbatch (whole, fixed, found) and the agreement
over the ranks, integers only."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from gradaccum.fitting import NO_RANK, Fit, agreed, proposal


def test_the_whole_batch_and_a_fixed_size() -> None:
    """None cuts nothing; an int caps each microbatch; neither changes, nor loads."""
    whole, fixed = Fit(None), Fit(4)
    assert (whole.size_for(10), fixed.size_for(10), fixed.size_for(3)) == (10, 4, 3)
    for fit in (whole, fixed):
        fit.fitted(2)
        fit.load(2)
    assert (whole.microbatch, fixed.microbatch) == (None, 4)


def test_auto_is_found_by_the_first_window_and_only_shrinks() -> None:
    """ "auto" starts from the batch's rows; the first completed window fixes it, a later
    smaller batch does not, and running out of memory shrinks it; a loaded one is taken."""
    fit = Fit("auto")
    assert (fit.auto, fit.microbatch, fit.size_for(32)) == (True, None, 32)
    fit.shrink(16)
    fit.fitted(16)
    fit.fitted(3)  # a short batch's window
    assert (fit.microbatch, fit.size_for(8), fit.state()) == (16, 8, 16)
    fit.load(4)
    assert fit.microbatch == 4


@given(
    sizes=st.lists(st.integers(1, 64), min_size=1, max_size=5),
    ran_out=st.lists(st.booleans(), min_size=5, max_size=5),
)
def test_the_agreement_is_the_least_size_and_the_first_rank_that_ran_out(
    sizes: list[int], ran_out: list[bool]
) -> None:
    """The element-wise least of the ranks' proposals is the next size every rank takes
    (half the size of a rank that ran out, 0 below a row) and the least rank that ran out."""
    proposals = [proposal(size, ran_out[rank], rank) for rank, size in enumerate(sizes)]
    size, rank = agreed([min(column) for column in zip(*proposals, strict=True)])
    failed = [r for r in range(len(sizes)) if ran_out[r]]
    assert rank == (failed[0] if failed else None)
    assert size == min(s // 2 if ran_out[r] else s for r, s in enumerate(sizes))
    assert NO_RANK > 10**9
