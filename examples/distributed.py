"""Train with gradient accumulation on several processes, under DDP or fully_shard.

    torchrun --nproc_per_node 2 examples/distributed.py --wrap ddp
    torchrun --nproc_per_node 2 examples/distributed.py --wrap fully_shard --sync boundary

Runs on CPU with gloo, or on GPUs with NCCL (one per process). The loop is the same
as on one process: the accumulator detects the wrapping, skips DDP's all-reduce on
non-boundary microsteps, normalizes the summed losses by the items of the whole
global window, clips by the full gradient norm and steps once per window.
"""

from __future__ import annotations

import argparse
import gc
import os

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

import gradaccum


def dataset(rows: int) -> TensorDataset:
    """A noisy nonlinear regression target; the same on every rank (the sampler splits it)."""
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(rows, 16, generator=generator)
    y = torch.tanh(x @ torch.randn(16, 1, generator=generator))
    return TensorDataset(x, y + 0.01 * torch.randn(rows, 1, generator=generator))


def train(args: argparse.Namespace, device: torch.device) -> None:
    """Build the wrapped model and train it; everything that holds the group lives here."""
    rank = dist.get_rank()
    torch.manual_seed(0)  # the same initial weights on every rank
    model = nn.Sequential(nn.Linear(16, 64), nn.GELU(), nn.Linear(64, 1)).to(device)
    if args.wrap == "ddp":
        model = DistributedDataParallel(model)
    else:
        mesh = init_device_mesh(device.type, (dist.get_world_size(),))
        for layer in model:
            if isinstance(layer, nn.Linear):
                fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)

    data = dataset(512)
    sampler = DistributedSampler(data, shuffle=True, seed=0)
    loader = DataLoader(data, batch_size=8, sampler=sampler)
    steps = args.gradient_accumulation_steps
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    horizon = gradaccum.total_steps(len(loader), steps, args.epochs)
    scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=horizon)

    with gradaccum.Accumulator(
        model, optimizer, scheduler, steps=steps, max_grad_norm=1.0, sync=args.sync
    ) as acc:
        for epoch in range(args.epochs):
            sampler.set_epoch(epoch)
            for x, y in acc.epoch(loader):
                x, y = x.to(device), y.to(device)
                loss_sum = (model(x) - y).square().sum()
                with acc.microstep(loss_sum, num_items=len(x)) as step:
                    if step.boundary and step.global_step % 8 == 0 and rank == 0:
                        # step.loss is this rank's; grad_norm is the full norm, on every rank.
                        print(
                            f"epoch {epoch} step {step.global_step}/{horizon} "
                            f"loss {step.loss.item():.4f} grad norm {step.grad_norm.item():.3f}"
                        )
    if rank == 0:
        print(f"{acc.global_step} optimizer steps on {dist.get_world_size()} ranks ({args.wrap})")


def main() -> None:
    parser = gradaccum.add_arguments(argparse.ArgumentParser(description=__doc__))
    parser.add_argument("--wrap", choices=["ddp", "fully_shard"], default="ddp")
    parser.add_argument("--sync", choices=["auto", "boundary", "every"], default="auto")
    parser.add_argument("--epochs", type=int, default=2)
    args = parser.parse_args()

    device = (
        torch.device("cuda", int(os.environ["LOCAL_RANK"])) if torch.cuda.is_available() else None
    )
    dist.init_process_group("nccl" if device is not None else "gloo")
    train(args, device or torch.device("cpu"))
    # destroy_process_group() drops only torch's own references to the group. The model
    # holds it too, in reference cycles that outlive train(): collect them first, or the
    # group's threads are torn down during interpreter exit, which aborts the process in
    # about 1 run of 8 under load ("terminate called without an active exception").
    gc.collect()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
