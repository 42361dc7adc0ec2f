"""Where the accumulator's scalar collectives run (`gradaccum.ranks.collective_device`).

An NCCL group, which takes no CPU tensor, needs a GPU to build: these pin the decision on
the device types torch records for a group; the gloo groups of the distributed tests run
it for real.
"""

from __future__ import annotations

import torch

from gradaccum.ranks import Ranks, collective_device

CPU, CUDA = torch.device("cpu"), torch.device("cuda")


def test_parameters_offloaded_to_the_cpu_under_nccl_alone_use_the_groups_device() -> None:
    # FSDP's CPU offloading keeps the sharded parameters on the CPU: NCCL refuses a CPU
    # tensor, so the length agreement and the item total run on the current CUDA device.
    assert collective_device(CPU, [CUDA]) == CUDA


def test_a_group_that_takes_the_parameters_device_keeps_it() -> None:
    assert collective_device(CPU, [CPU]) == CPU  # gloo
    assert collective_device(CPU, [CPU, CUDA]) == CPU  # init_process_group() with no backend
    assert collective_device(torch.device("cuda", 1), [CUDA]) == torch.device("cuda", 1)
    # Gloo all-reduces CUDA tensors too: no copy to the host is added.
    assert collective_device(torch.device("cuda", 1), [CPU]) == torch.device("cuda", 1)


def test_a_group_with_no_backend_recorded_keeps_the_parameters_device() -> None:
    assert collective_device(CPU, []) == CPU


def test_one_process_runs_no_collective_and_keeps_the_parameters_device() -> None:
    assert Ranks(None, CPU).device == CPU
