"""Train with gradient accumulation on several processes: DDP, FSDP1, fully_shard or HSDP.

    torchrun --nproc_per_node 2 examples/distributed.py --wrap ddp
    torchrun --nproc_per_node 2 examples/distributed.py --wrap fully_shard --sync boundary
    torchrun --nproc_per_node 2 examples/distributed.py --wrap fsdp1
    torchrun --nproc_per_node 4 examples/distributed.py --wrap hsdp

Runs on CPU with gloo, or on GPUs with NCCL (one per process). It accumulates 4
microbatches per optimizer step unless told otherwise (--gradient-accumulation-steps).
The loop is the same as on one process, and the same under every wrapping: the
accumulator detects the wrapping, skips DDP's all-reduce on non-boundary microsteps,
normalizes the summed losses by the items of the whole global window, clips by the full
gradient norm and steps once per window. The logged loss is the whole job's window loss,
equal to the loss of one big batch of every rank's microbatches.
"""

from __future__ import annotations

import argparse
import gc
import os

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import FullyShardedDataParallel, fully_shard
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

import gradaccum


def dataset(rows: int) -> TensorDataset:
    """A noisy nonlinear regression target; the same on every rank (the sampler splits it)."""
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(rows, 16, generator=generator)
    y = torch.tanh(x @ torch.randn(16, 1, generator=generator))
    return TensorDataset(x, y + 0.01 * torch.randn(rows, 1, generator=generator))


def wrap(model: nn.Module, kind: str, device: torch.device) -> nn.Module:
    """``model`` wrapped for data parallelism: the only part that differs between wrappings."""
    if kind == "ddp":
        return DistributedDataParallel(model)
    if kind == "fsdp1":
        return FullyShardedDataParallel(model, device_id=device)
    world = dist.get_world_size()
    if kind == "fully_shard":
        mesh = init_device_mesh(device.type, (world,))
    else:  # HSDP: shard within pairs of ranks, replicate across the pairs
        mesh = init_device_mesh(device.type, (world // 2, 2), mesh_dim_names=("rep", "shard"))
    for layer in model:
        if isinstance(layer, nn.Linear):
            fully_shard(layer, mesh=mesh)
    return fully_shard(model, mesh=mesh)


def train(args: argparse.Namespace, device: torch.device) -> None:
    """Build the wrapped model and train it; everything that holds the group lives here."""
    rank = dist.get_rank()
    torch.manual_seed(0)  # the same initial weights on every rank
    model = nn.Sequential(nn.Linear(16, 64), nn.GELU(), nn.Linear(64, 1)).to(device)
    model = wrap(model, args.wrap, device)

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
            sampler.set_epoch(epoch)  # a new order each epoch, the same on every rank
            for x, y in acc.epoch(loader):
                x, y = x.to(device), y.to(device)
                loss_sum = (model(x) - y).square().sum()
                with acc.microstep(loss_sum, num_items=len(x)) as step:
                    # global_loss and grad_norm are the whole job's, the same on every rank,
                    # and reading them launches no collective: logging on rank 0 is safe.
                    if rank == 0 and step.boundary and step.global_step % 4 == 0:
                        print(
                            f"epoch {epoch} step {step.global_step}/{horizon} "
                            f"loss {step.global_loss.item():.5f} "
                            f"grad norm {step.grad_norm.item():.5f}"
                        )
    if rank == 0:
        print(f"{acc.global_step} optimizer steps on {dist.get_world_size()} ranks ({args.wrap})")


def main() -> None:
    parser = gradaccum.add_arguments(argparse.ArgumentParser(description=__doc__), default=4)
    parser.add_argument("--wrap", choices=["ddp", "fsdp1", "fully_shard", "hsdp"], default="ddp")
    parser.add_argument("--sync", choices=["auto", "boundary", "every"], default="auto")
    parser.add_argument("--epochs", type=int, default=2)
    args = parser.parse_args()

    if args.wrap == "hsdp" and int(os.environ["WORLD_SIZE"]) % 2:
        parser.error(f"--wrap hsdp shards over pairs of ranks; got {os.environ['WORLD_SIZE']}")
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
