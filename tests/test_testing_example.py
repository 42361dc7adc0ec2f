"""examples/testing_your_trainer: its test fails on the trainer as written (AdamW, the
learning rate set by hand, no scheduler, the forward outside ``no_sync()``) with the
count that shows the bug and says why, and passes once the forward moves inside, a
one-line fix. Both on 2 gloo ranks."""

from __future__ import annotations

import importlib
import sys
from pathlib import Path
from types import ModuleType

import pytest

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "testing_your_trainer"
MESSAGE = "4 all-reduces per window at steps=4: DDP all-reduced on every microbatch."
FORWARD = "            loss = loss_fn(model, batches[step * steps + micro]) / steps\n"
BLOCK = "            with contextlib.nullcontext() if boundary else no_sync():\n"


def example_module(name: str, folder: Path, monkeypatch: pytest.MonkeyPatch) -> ModuleType:
    """Import ``name`` from ``folder`` as the ranks will (by name, from ``sys.path``)."""
    monkeypatch.syspath_prepend(str(folder))
    monkeypatch.delitem(sys.modules, name, raising=False)
    return importlib.import_module(name)


def fixed_trainer(folder: Path) -> str:
    """trainer.py with its forward moved into the ``with`` block: the one-line fix."""
    source = (EXAMPLE / "trainer.py").read_text(encoding="utf-8")
    assert source.count(FORWARD + BLOCK) == 1  # the bug as the example shows it
    fixed = source.replace(FORWARD + BLOCK, BLOCK + "    " + FORWARD)
    (folder / "trainer_fixed.py").write_text(fixed, encoding="utf-8")
    return fixed


@pytest.mark.xfail(strict=True, raises=AssertionError, reason="the example trainer's bug")
def test_the_example_test_fails_on_the_trainer_as_written(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The trainer's gradients are exact, so only the count fails it, with the message."""
    example = example_module("test_trainer", EXAMPLE, monkeypatch)
    try:
        example.test_accumulation_is_exact_and_all_reduces_once_per_window()
    except AssertionError as error:
        lines = [line.strip() for line in str(error).splitlines()]  # pytest indents them
        # The count is the one problem: the steps, the gradients and the parameters held.
        if (
            lines[0] != "accumulation at steps=4 on 2 ranks (mean mode): FAILED"
            or not lines[1].startswith(MESSAGE)
            or not lines[2].startswith("optimizer steps 3 of 3; max |grad - reference| ")
        ):
            pytest.fail(f"the example failed, but not as it should: {error}")
        raise


def test_the_example_test_passes_on_the_fixed_trainer(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The same test, on the trainer with its forward inside the block, passes."""
    fixed_trainer(tmp_path)
    example = example_module("test_trainer", EXAMPLE, monkeypatch)
    fixed = example_module("trainer_fixed", tmp_path, monkeypatch)
    example.check(fixed.train_epoch)


def test_the_hugging_face_trainer_is_judged_as_its_users_run_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """examples/testing_your_trainer/test_hf_trainer.py: transformers' Trainer, unmodified
    (its RandomSampler, ``num_items_in_batch``, linear schedule and clipping), is judged
    exact in the order its forwards consumed the microbatches, and the report says the
    order differed; it read as a gradient off the reference before, unless the Trainer's
    ``_get_train_sampler`` was overridden to keep the order."""
    pytest.importorskip(
        "transformers", reason="the trainers extra: pip install gradaccum[trainers]"
    )
    example = example_module("test_hf_trainer", EXAMPLE, monkeypatch)
    report = example.check()
    assert report.ok, str(report)
    assert report.reordered
    assert report.max_grad_diff <= 1e-10
