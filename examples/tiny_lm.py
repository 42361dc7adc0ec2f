"""Variable-length sequences: token-weighted accumulation matches the big batch exactly.

    python examples/tiny_lm.py --out tiny_lm.png

Trains a 2-layer causal transformer (d_model 64) on sequences it generates itself, of
4 to 64 target tokens, three times from the same initial weights and in the same data
order:

(a) one batch of B*N sequences per optimizer step, no accumulation: the reference;
(b) N microbatches of B sequences with ``acc.microstep(loss_sum, num_items=tokens)``;
(c) N microbatches of B sequences with ``acc.microstep(loss_mean)``: the mean of the
    per-microbatch token means, which weights a token by 1 / (N x its microbatch's
    tokens) instead of 1 / the window's tokens.

It prints the largest gaps of (b) and (c) from (a), in the loss and in the parameters,
and writes a PNG of the three loss curves (the token-mean training loss of each
optimizer step) and of their gaps from (a).

The sequences are arithmetic progressions modulo the vocabulary: a start token, then
``start + k * stride`` for a stride in 1..4. The first target of each is a guess among 60
tokens and the second among 4 strides; the rest follow. Lengths are log-uniform, so half
the sequences have under 16 tokens, and a microbatch of 4 holds 36 to 152 tokens.

Everything runs in float64, which takes 1.5 to 2 times as long as float32 here: the gap
between (a) and (b) is then float64 rounding, about 1e-15 in the loss. In float32 the
loss gap is about 1e-5, and the parameter gap 2e-3: the attention key bias has a
gradient that is zero in exact arithmetic (softmax ignores a shift), so its computed
gradient is rounding noise, which AdamW divides by its own size and turns into steps of
the size of the learning rate (they change no output, as the loss gap shows). In float64
that noise is far smaller than AdamW's eps, and the parameter gap is about 1e-12.
"""

from __future__ import annotations

import argparse
import importlib.util

import torch
from torch import nn
from torch.nn import functional as F  # noqa: N812  # the usual PyTorch alias

import gradaccum

VOCAB = 60  # tokens 0..59; the padding below is not a token the model predicts
PAD = -100  # F.cross_entropy's default ignore_index
BOS = VOCAB  # the input embedding has one more row, for the start of a sequence
MAX_LEN = 64

Microbatch = list[torch.Tensor]  # sequences of target tokens, of different lengths


def sequences(count: int, generator: torch.Generator) -> list[torch.Tensor]:
    """``count`` arithmetic progressions mod VOCAB with log-uniform lengths in 4..64."""
    out = []
    for _ in range(count):
        length = round(4 * 16 ** float(torch.rand((), generator=generator)))
        start = int(torch.randint(VOCAB, (), generator=generator))
        stride = int(torch.randint(1, 5, (), generator=generator))
        out.append((start + stride * torch.arange(length)) % VOCAB)
    return out


def pad(batch: Microbatch) -> tuple[torch.Tensor, torch.Tensor]:
    """Inputs (BOS, then the tokens but the last) and targets, padded on the right.

    Under a causal mask a real position attends only to positions before it, all real:
    the padding cannot change a real token's output, so no key-padding mask is needed.
    The targets' padding is PAD, which the loss ignores: that is the mask.
    """
    length = max(len(s) for s in batch)
    targets = torch.full((len(batch), length), PAD)
    inputs = torch.full((len(batch), length), BOS)
    for row, seq in enumerate(batch):
        targets[row, : len(seq)] = seq
        inputs[row, 1 : len(seq)] = seq[:-1]
    return inputs, targets


class TinyLM(nn.Module):
    """Token and position embeddings, 2 pre-norm causal transformer layers, a linear head."""

    def __init__(self, d_model: int = 64, layers: int = 2, heads: int = 4) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB + 1, d_model)
        self.position = nn.Embedding(MAX_LEN, d_model)
        layer = nn.TransformerEncoderLayer(
            d_model, heads, 4 * d_model, dropout=0.0, batch_first=True, norm_first=True
        )
        self.body = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.head = nn.Linear(d_model, VOCAB)

    def forward(self, inputs: torch.Tensor) -> torch.Tensor:
        length = inputs.shape[1]
        x = self.embed(inputs) + self.position(torch.arange(length))
        mask = nn.Transformer.generate_square_subsequent_mask(length, dtype=x.dtype)
        return self.head(self.body(x, mask=mask, is_causal=True))


def loss_sum_and_tokens(model: nn.Module, batch: Microbatch) -> tuple[torch.Tensor, torch.Tensor]:
    """The summed cross-entropy over the batch's real tokens, and their count."""
    inputs, targets = pad(batch)
    logits = model(inputs)
    loss_sum = F.cross_entropy(logits.flatten(0, 1), targets.flatten(), reduction="sum")
    return loss_sum, (targets != PAD).sum()


def shuffled(data: list[Microbatch], epoch: int) -> list[Microbatch]:
    """The microbatches in the order of ``epoch``: the same order in the three runs."""
    order = torch.randperm(len(data), generator=torch.Generator().manual_seed(epoch))
    return [data[i] for i in order]


def train(
    mode: str, data: list[Microbatch], steps: int, epochs: int, lr: float
) -> tuple[list[float], nn.Module]:
    """Train a fresh model (seed 0) in ``mode`` "a", "b" or "c"; return the token-mean
    loss of each optimizer step's window and the model."""
    torch.manual_seed(0)
    model = TinyLM().double()
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.01)
    # The horizon in optimizer steps, the same for the three runs.
    horizon = gradaccum.total_steps(len(data), steps, epochs)
    scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=horizon)
    losses: list[float] = []

    if mode == "a":  # the reference: each window's microbatches as one batch
        windows = gradaccum.steps_per_epoch(len(data), steps)
        for epoch in range(epochs):
            order = shuffled(data, epoch)
            for w in range(windows):
                batch = [s for mb in order[w * steps : (w + 1) * steps] for s in mb]
                loss_sum, tokens = loss_sum_and_tokens(model, batch)
                loss = loss_sum / tokens  # the token mean of the whole batch
                loss.backward()
                optimizer.step()
                scheduler.step()
                optimizer.zero_grad(set_to_none=True)
                losses.append(loss.item())
        return losses, model

    acc = gradaccum.Accumulator(model, optimizer, scheduler, steps=steps)
    # On the device, read once per window, as step.loss would be.
    window_sum, window_tokens = (
        torch.zeros((), dtype=torch.float64),
        torch.zeros((), dtype=torch.long),
    )
    for epoch in range(epochs):
        for batch in acc.epoch(shuffled(data, epoch)):
            loss_sum, tokens = loss_sum_and_tokens(model, batch)
            if mode == "b":  # the summed loss; the window is divided by its tokens
                microstep = acc.microstep(loss_sum, num_items=tokens)
            else:  # "c": the usual per-microbatch token mean, divided by steps
                microstep = acc.microstep(loss_sum / tokens)
            with microstep as step:
                # The curve is the token mean for all three runs; in (b) it is also
                # step.loss, in (c) step.loss is the mean of the microbatch means.
                window_sum += loss_sum.detach()
                window_tokens += tokens
                if step.boundary:
                    losses.append((window_sum / window_tokens).item())
                    window_sum.zero_()
                    window_tokens.zero_()
    acc.close()
    return losses, model


def max_param_gap(one: nn.Module, other: nn.Module) -> float:
    """The largest absolute difference between the two models' parameters."""
    return max(
        (p - q).abs().max().item()
        for p, q in zip(one.parameters(), other.parameters(), strict=True)
    )


def plot(curves: dict[str, list[float]], labels: dict[str, str], out: str, title: str) -> None:
    """Loss curves on the left, each run's distance from (a) on a log scale on the right."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(7, 4), dpi=100)
    styles = {"a": ("black", "-", 3.0), "b": ("tab:orange", "--", 1.5), "c": ("tab:red", "-", 1.2)}
    x = range(1, len(curves["a"]) + 1)
    for mode, losses in curves.items():
        color, line, width = styles[mode]
        left.plot(x, losses, color=color, linestyle=line, linewidth=width, label=labels[mode])
    # A log scale shows the late steps, where the losses are small, as well as the early.
    left.set(xlabel="optimizer step", ylabel="token-mean training loss", title="loss")
    left.set_yscale("log")
    left.set_yticks([0.5, 1, 2, 4], ["0.5", "1", "2", "4"])
    left.minorticks_off()
    left.legend(fontsize=8)
    for mode in ("b", "c"):
        color, line, width = styles[mode]
        # An exact 0 (it happens in float64) is drawn at 1e-17, the floor of the axis.
        gap = [max(abs(u - v), 1e-17) for u, v in zip(curves[mode], curves["a"], strict=True)]
        label = labels[mode][:3] + labels[mode].split(",")[1]
        right.semilogy(x, gap, color=color, linestyle=line, linewidth=width, label=label)
    right.set(xlabel="optimizer step", ylabel="|loss - loss of (a)|", title="gap from (a)")
    right.legend(fontsize=8)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(out)
    plt.close(fig)


def main(argv: list[str] | None = None) -> dict[str, float]:
    """Run (a), (b) and (c), print and return their gaps, write the picture."""
    parser = gradaccum.add_arguments(argparse.ArgumentParser(description=__doc__), default=4)
    parser.add_argument("--batch-size", type=int, default=4, help="sequences per microbatch")
    parser.add_argument("--microbatches", type=int, default=48, help="microbatches per epoch")
    parser.add_argument("--epochs", type=int, default=6)
    parser.add_argument("--lr", type=float, default=6e-3)
    parser.add_argument("--out", default="tiny_lm.png", help="where to write the PNG")
    args = parser.parse_args(argv)
    steps = args.gradient_accumulation_steps
    if importlib.util.find_spec("matplotlib") is None:  # say so before training, not after
        parser.error("the picture needs matplotlib: pip install -e '.[examples]'")

    # One thread: a model this small gains nothing from more, and on a busy machine
    # threads waiting for each other made it 10x slower.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        generator = torch.Generator().manual_seed(1)
        flat = sequences(args.microbatches * args.batch_size, generator)
        data = [flat[i : i + args.batch_size] for i in range(0, len(flat), args.batch_size)]
        curves, models = {}, {}
        for mode in ("a", "b", "c"):
            curves[mode], models[mode] = train(mode, data, steps, args.epochs, args.lr)
    finally:
        torch.set_num_threads(threads)

    gaps = {
        "loss_b": max(abs(u - v) for u, v in zip(curves["b"], curves["a"], strict=True)),
        "param_b": max_param_gap(models["b"], models["a"]),
        "loss_c": max(abs(u - v) for u, v in zip(curves["c"], curves["a"], strict=True)),
        "param_c": max_param_gap(models["c"], models["a"]),
    }
    b, n = args.batch_size, steps
    microbatches = f"{n} microbatch{'es' if n > 1 else ''} of {b}"
    print(f"{len(curves['a'])} optimizer steps of {b * n} sequences ({microbatches})")
    print("final loss: " + "  ".join(f"({m}) {curves[m][-1]:.4f}" for m in "abc"))
    for mode, name in (("b", "num_items:    "), ("c", "mean of means:")):
        loss_gap, param_gap = gaps[f"loss_{mode}"], gaps[f"param_{mode}"]
        print(f"(a) vs ({mode}) {name} max loss gap {loss_gap:.1e}, max param gap {param_gap:.1e}")
    labels = {
        "a": f"(a) batch {b * n}, no accumulation",
        "b": f"(b) {n} x {b}, num_items=tokens",
        "c": f"(c) {n} x {b}, mean of means",
    }
    plot(curves, labels, args.out, "2-layer causal LM, sequences of 4-64 tokens, float64")
    print(f"wrote {args.out}")
    return gaps


if __name__ == "__main__":
    main()
