"""The boundary's parameters (boundary.Params): worked out once, again whenever a group's
parameter list changes, and whatever users change between windows is normalized, clipped and
checked at the next boundary."""

from __future__ import annotations

import math

import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st

import gradaccum
from gradaccum.boundary import Params
from tests import strategies
from tests.helpers import make_batches, make_model, sum_loss


def test_the_parameters_are_worked_out_again_whenever_a_parameter_list_changes() -> None:
    """The list is the same object while every group's parameters are the same objects
    (no work per boundary beyond the compare), and a new one after ``add_param_group``, a
    group swapped by ``pop`` and ``add_param_group``, ``group["params"]`` replaced, or a
    parameter put into a group's list in place; a ``load_state_dict`` that keeps the
    parameters keeps the list. The model's order comes first, one outside it last."""
    model = make_model()
    optimizer = torch.optim.SGD(list(model.parameters())[::-1], lr=0.1)
    params = Params((optimizer,), model)
    first = params.now()
    assert params.now() is first
    assert params.ordered() == list(model.parameters())
    extra = torch.nn.Parameter(torch.zeros(()))
    optimizer.add_param_group({"params": [extra]})
    grown = params.now()
    assert grown is not first
    assert grown[-1] is extra
    assert params.ordered() == [*model.parameters(), extra]
    optimizer.load_state_dict(optimizer.state_dict())  # a new list of the same groups
    assert params.now() is grown
    swapped = torch.nn.Parameter(torch.zeros(()))
    optimizer.param_groups.pop()  # (the list keeps its identity and its length)
    optimizer.add_param_group({"params": [swapped]})
    assert params.now()[-1] is swapped
    replaced = torch.nn.Parameter(torch.zeros(()))
    optimizer.param_groups[-1]["params"] = [replaced]
    assert params.now()[-1] is replaced
    edited = torch.nn.Parameter(torch.zeros(()))
    optimizer.param_groups[-1]["params"][0] = edited
    assert params.now()[-1] is edited
    assert params.ordered()[-1] is edited


def test_a_group_added_between_windows_is_normalized_clipped_and_checked() -> None:
    """A learnable scale added with ``add_param_group`` after the first window: its
    gradient in the next window is divided by the window's items and clipped with the
    others by one total norm; a NaN in it alone skips the window."""
    model = make_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.0)  # lr 0: only the gradients matter
    acc = gradaccum.Accumulator(model, optimizer, steps=2, max_grad_norm=1e-3, on_nonfinite="skip")
    batches = make_batches([3, 5, 2, 4, 1, 6])
    for batch in batches[:2]:
        with acc.microstep(sum_loss(model, batch), num_items=len(batch[0])):
            pass
    scale = torch.nn.Parameter(torch.tensor(1.5, dtype=torch.float64))
    optimizer.add_param_group({"params": [scale], "lr": 0.0})
    window = batches[2:4]
    losses = [scale * sum_loss(model, batch) for batch in window]
    total = sum(losses) / sum(len(batch[0]) for batch in window)
    grads = torch.autograd.grad(total, [*model.parameters(), scale], retain_graph=True)
    norm = torch.linalg.vector_norm(torch.stack([g.norm() for g in grads]))
    for loss, batch in zip(losses, window, strict=True):
        with acc.microstep(loss, num_items=len(batch[0])) as step:
            if step.boundary:
                assert step.grad_norm is not None
                assert math.isclose(step.grad_norm.item(), norm.item(), rel_tol=1e-12)
                assert scale.grad is not None
                clipped = grads[-1] * (1e-3 / (norm + 1e-6))
                assert math.isclose(scale.grad.item(), clipped.item(), rel_tol=1e-9)
    poisoned = [scale * sum_loss(model, batch) for batch in batches[4:]]
    poisoned[0] = poisoned[0] + (scale - scale.detach()) * math.nan  # NaN in scale's only
    for loss, batch in zip(poisoned, batches[4:], strict=True):
        with acc.microstep(loss, num_items=len(batch[0])) as step:
            pass
    assert step.skipped
    assert acc.skipped_steps == 1


def test_a_model_converted_between_windows_is_normalized_in_its_new_dtype() -> None:
    """``model.double()`` between windows converts the parameters in place (the same
    objects in the same groups): the next window's item total is divided in float64, so
    the float32 model turned float64 matches its float64 big-batch reference to rounding,
    as an accumulator built after the conversion does, bit for bit."""

    def train(rebuild: bool) -> torch.nn.Module:
        model = make_model(dtype=torch.float32)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        acc = gradaccum.Accumulator(model, optimizer, steps=2)
        for index, batch in enumerate(make_batches([3, 5, 7, 2], dtype=torch.float32)):
            if index == 2:
                model.double()
                if rebuild:
                    acc.close()
                    acc = gradaccum.Accumulator(model, optimizer, steps=2)
            inputs, targets = (tensor.to(next(model.parameters()).dtype) for tensor in batch)
            loss = sum_loss(model, (inputs, targets))
            with acc.microstep(loss, num_items=torch.tensor(len(inputs))):
                pass
        acc.close()
        return model

    kept, rebuilt = train(rebuild=False), train(rebuild=True)
    pairs = zip(kept.parameters(), rebuilt.parameters(), strict=True)
    assert all(torch.equal(a, b) for a, b in pairs)
    # The reference: the first window as trained, then one float64 big batch.
    model = make_model(dtype=torch.float32)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    acc = gradaccum.Accumulator(model, optimizer, steps=2)
    batches = make_batches([3, 5, 7, 2], dtype=torch.float32)
    for batch in batches[:2]:
        with acc.microstep(sum_loss(model, batch), num_items=len(batch[0])):
            pass
    acc.close()
    model.double()
    inputs, targets = (torch.cat([b[i] for b in batches[2:]]).double() for i in (0, 1))
    mean = sum_loss(model, (inputs, targets)) / len(inputs)
    grads = torch.autograd.grad(mean, [*model.parameters()])
    with torch.no_grad():
        for param, grad in zip(model.parameters(), grads, strict=True):
            param -= 0.1 * grad
    pairs = zip(kept.parameters(), model.parameters(), strict=True)
    gap = max((a - b).abs().max().item() for a, b in pairs)
    assert gap < 1e-15


# What users mutate between windows, against the float64 reference --------------------

_MUTATIONS = ("head", "swap", "replace", "append", "remove", "toggle", "convert")


class _Parts(torch.nn.Module):
    """Branches that each fit the targets on their own (so that each parameter's gradient
    depends on its own branch's dtype only): a body, a head whose dtype can change, and
    heads added later (``extra``); every branch's loss is computed in float64."""

    def __init__(self, dtype: torch.dtype) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.body = torch.nn.Linear(5, 1).to(dtype)
        self.head = torch.nn.Linear(5, 1).to(dtype)
        self.extra = torch.nn.ParameterList()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        outs = [layer(x.to(layer.weight.dtype)).double() for layer in (self.body, self.head)]
        outs += [(x * scale).sum(1, keepdim=True) for scale in self.extra]
        return torch.cat(outs, 1)


def _mutate(what: str, model: _Parts, optimizers: list[torch.optim.Optimizer], seed: int) -> None:
    """Change, between windows, what a user's loop changes: a head added with
    ``add_param_group``, a group swapped by ``pop`` and ``add_param_group`` (a fresh head),
    ``group["params"]`` replaced, a head appended to or removed from a group's list in
    place, a parameter's ``requires_grad`` toggled, or the head converted to the other
    dtype."""
    last = optimizers[-1]

    def fresh() -> torch.nn.Parameter:
        scale = torch.nn.Parameter(
            torch.randn(5, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
        )
        model.extra.append(scale)
        return scale

    added = len(last.param_groups) > 1 and last.param_groups[-1]["params"]
    if what == "head" or (what in ("swap", "remove") and not added):
        last.add_param_group({"params": [fresh()]})
    elif what == "swap":
        dropped = last.param_groups.pop()["params"]
        model.extra = torch.nn.ParameterList(
            p for p in model.extra if not any(p is q for q in dropped)
        )
        last.add_param_group({"params": [fresh()]})
    elif what == "remove":
        group = last.param_groups[-1]["params"]
        gone = group.pop()
        model.extra = torch.nn.ParameterList(p for p in model.extra if p is not gone)
    elif what == "replace":
        group = optimizers[0].param_groups[0]
        group["params"] = [*group["params"], fresh()]
    elif what == "append":
        last.param_groups[0]["params"].append(fresh())
    elif what == "toggle":
        model.head.bias.requires_grad_(not model.head.bias.requires_grad)
    else:
        model.head.to(torch.float64 if model.head.weight.dtype == torch.float32 else torch.float32)


def _reference_step(
    model: _Parts,
    optimizers: list[torch.optim.Optimizer],
    window: list[tuple[torch.Tensor, torch.Tensor]],
    items: bool,
    max_norm: float | None,
) -> dict[int, torch.Tensor]:
    """The window's update from the parameters as they are, in float64: the mean of the
    microbatches' mean losses (or the summed losses over their items), one big batch,
    clipped over the optimizers' parameters, one SGD step of 0.1."""
    stepped = [
        p for o in optimizers for g in o.param_groups for p in g["params"] if p.requires_grad
    ]
    wide = {name: p.detach().double() for name, p in model.named_parameters()}
    for name, p in model.named_parameters():
        if any(p is q for q in stepped):
            wide[name].requires_grad_(True)
    losses = []
    for x, y in window:
        squared = (torch.func.functional_call(model, wide, (x,)) - y).square()
        losses.append(squared.sum() if items else squared.mean())
    total = sum(losses) / (sum(len(x) for x, _ in window) if items else len(window))
    names = {id(p): name for name, p in model.named_parameters()}
    grads = torch.autograd.grad(total, [wide[names[id(p)]] for p in stepped])
    if max_norm is not None:
        norm = torch.linalg.vector_norm(torch.stack([g.norm() for g in grads]))
        grads = tuple(g * min(1.0, max_norm / (norm.item() + 1e-6)) for g in grads)
    return {
        id(p): wide[names[id(p)]].detach() - 0.1 * g for p, g in zip(stepped, grads, strict=True)
    }


@settings(max_examples=60, deadline=None)
@given(
    mutations=st.lists(st.sampled_from(_MUTATIONS), min_size=1, max_size=4),
    items=st.sampled_from([None, "int", "tensor"]),
    clip=st.booleans(),
    scaler=st.booleans(),
    two=st.booleans(),
    half=st.booleans(),
    seed=strategies.seeds,
)
@example(  # the two found: a group swapped (num_items; clipping), a head turned float64
    mutations=["head", "swap"],
    items=True,
    clip=False,
    scaler=False,
    two=False,
    half=False,
    seed=0,
)
@example(
    mutations=["head", "swap"],
    items=False,
    clip=True,
    scaler=False,
    two=False,
    half=False,
    seed=0,
)
@example(mutations=["convert"], items=True, clip=False, scaler=False, two=False, half=True, seed=0)
def test_what_users_mutate_between_windows_is_seen_at_the_next_boundary(
    mutations: list[str],
    items: str | None,
    clip: bool,
    scaler: bool,
    two: bool,
    half: bool,
    seed: int,
) -> None:
    """Between windows the loop changes what users change (`_mutate`), on one optimizer or
    on the second of two (a body and a head optimizer), with and without ``num_items`` (an
    int or a tensor), clipping and a GradScaler, from a float64 or a float32 model: every
    window's update equals the float64 big batch computed from the parameters as they
    were, to 1e-12 for a float64 parameter (float32's rounding for a float32 one, or for
    all where clipping mixes their norms)."""
    model = _Parts(torch.float32 if half else torch.float64)
    body, head = list(model.body.parameters()), list(model.head.parameters())
    optimizers = (
        [torch.optim.SGD(body, lr=0.1), torch.optim.SGD(head, lr=0.1)]
        if two
        else [torch.optim.SGD(body + head, lr=0.1)]
    )
    acc = gradaccum.Accumulator(
        model,
        optimizers if two else optimizers[0],
        steps=3,
        max_grad_norm=0.05 if clip else None,
        scaler=torch.amp.GradScaler("cpu", init_scale=2.0**4) if scaler else None,
    )
    generator = torch.Generator().manual_seed(seed)
    for index, what in enumerate(["none", *mutations]):
        if what != "none":
            _mutate(what, model, optimizers, seed + index)
        sizes = torch.randint(1, 5, (3,), generator=generator).tolist() if items else [3] * 3
        window = [
            (
                torch.randn(n, 5, generator=generator, dtype=torch.float64),
                torch.randn(n, 1, generator=generator, dtype=torch.float64),
            )
            for n in sizes
        ]
        expected = _reference_step(model, optimizers, window, bool(items), 0.05 if clip else None)
        for x, y in window:
            squared = (model(x) - y).square()
            count = torch.tensor(len(x)) if items == "tensor" else len(x)
            loss = squared.sum() if items else squared.mean()
            with acc.microstep(loss, count if items else None):
                pass
        narrow = clip and any(p.dtype != torch.float64 for p in model.parameters())
        for p in (p for o in optimizers for g in o.param_groups for p in g["params"]):
            if id(p) in expected:
                tolerance = 1e-5 if narrow or p.dtype != torch.float64 else 1e-12
                gap = (p.detach().double() - expected[id(p)]).abs().max().item()
                assert gap <= tolerance, (what, p.dtype, gap)
    acc.close()
