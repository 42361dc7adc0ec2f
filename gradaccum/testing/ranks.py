"""Run a function on N local ranks inside a test: every rank's result, or every rank's
traceback, and nothing left running."""

from __future__ import annotations

import contextlib
import gc
import io
import multiprocessing
import os
import pickle
import signal
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from gradaccum.checks import check_choice
from gradaccum.errors import ConfigError, ConfigTypeError, GradaccumError, describe
from gradaccum.schedule import check_positive

__all__ = ["LaunchError", "check_timeout", "run_ranks"]

_PRELOAD = ["torch", "torch.distributed.fsdp"]


class LaunchError(GradaccumError, RuntimeError):
    """A rank raised, gave no answer in time (it was killed), or ended without one.

    Its message holds every failed rank's traceback, rank by rank.

    Attributes:
        failures: Each failed rank's traceback, or why it gave no answer.
        results: What the other ranks returned.
    """

    def __init__(self, failures: Mapping[int, str], results: Mapping[int, Any]) -> None:
        lines = [
            f"{len(failures)} of {len(failures) + len(results)} ranks failed; every rank "
            "and every process a rank started have been ended"
        ]
        lines += [f"--- rank {rank} ---\n{text}" for rank, text in sorted(failures.items())]
        super().__init__("\n".join(lines))
        self.failures = dict(failures)
        self.results = dict(results)

    def __reduce__(self) -> tuple[type, tuple[dict[int, str], dict[int, Any]]]:
        return type(self), (self.failures, self.results)


@dataclass
class _Answer:
    """What one rank sent back: its result (``torch.save``'s bytes) or its traceback."""

    rank: int
    value: bytes | None = None
    error: str | None = None


def run_ranks(
    fn: Callable[..., Any],
    world_size: int,
    args: Sequence[Any] = (),
    kwargs: Mapping[str, Any] | None = None,
    *,
    backend: str = "gloo",
    timeout: float = 60.0,
) -> list[Any]:
    """Run ``fn(rank, world_size, *args, **kwargs)`` on ``world_size`` local ranks and
    return what each rank returned, in rank order.

    Each rank is a process forked from a server that imported torch and ``fn``'s module
    once, joined into a process group of ``backend`` through a ``FileStore`` in a fresh
    temporary directory, with ``MASTER_ADDR=127.0.0.1``, ``GLOO_SOCKET_IFNAME=lo``, the
    variables ``torchrun`` sets for a rank (``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE``,
    ``LOCAL_WORLD_SIZE``: Accelerate and Lightning read them to know they run
    distributed) and one intra-op thread; a barrier connects them all before ``fn``
    runs. A collective that waits longer than ``timeout`` seconds raises on its rank; a
    rank that has not answered ``2 * timeout`` seconds after every rank started (a busy
    machine's slow start-up not counted) is killed.
    Each rank leads a process group of its own, so that the processes it starts (a
    ``DataLoader``'s workers, a subprocess) are in it; once the ranks have answered or
    been killed, each group is killed whole. Every process is gone when this returns or
    raises, but one that left its rank's group (``setsid``).

    What crosses the process boundary: ``fn`` is pickled by reference, so it must be a
    module-level function (or a ``functools.partial`` of one) of a module the ranks can
    import, not a lambda or a local function; ``args`` and ``kwargs`` are written with
    ``torch.save`` (so any number of tensors, without a file descriptor each); a
    rank's return value is written with ``torch.save`` and read with ``torch.load``, so
    tensors (move them to the CPU), dataclasses and plain containers come back, and any
    class in them must be importable here.

    Args:
        fn: Called on each rank with its rank and the world size first.
        world_size: How many ranks (processes).
        args: More positional arguments for ``fn``.
        kwargs: Keyword arguments for ``fn``.
        backend: ``"gloo"`` (CPU), or ``"nccl"``, which needs a GPU per rank; rank ``r``
            runs on ``cuda:r``.
        timeout: Seconds a collective may wait (the process group's timeout); twice
            it, what a rank may take in all once every rank started.

    Returns:
        Every rank's return value, rank 0 first.

    Raises:
        LaunchError: A rank raised, was killed, or ended without an answer (or could not
            start); it holds every failed rank's traceback (or what ended it) and the
            others' results.
        ConfigError: ``world_size`` is below 1, ``timeout`` is not positive, NCCL was
            asked for without a GPU per rank, or the program was read from stdin (a
            rank's process could not run it again).
        ConfigTypeError: ``fn``, ``args`` or ``kwargs`` cannot be sent to the ranks:
            not picklable, or defined in a notebook or ``python -c``, whose ``__main__``
            the ranks cannot import.

    Examples:
        >>> run_ranks(pow, 2)  # pow(rank, world_size) on each rank
        [0, 1]
    """
    _check_launch(fn, world_size, args, kwargs, backend, timeout)
    answers = _launch(fn, world_size, tuple(args), dict(kwargs or {}), backend, timeout)
    failures = {a.rank: a.error for a in answers if a.error is not None}
    results = {
        a.rank: torch.load(io.BytesIO(a.value), weights_only=False)  # from our own ranks
        for a in answers
        if a.value is not None
    }
    if failures:
        raise LaunchError(failures, results)
    return [results[rank] for rank in range(world_size)]


def check_timeout(timeout: object) -> float:
    """Return ``timeout`` if it is a positive number of seconds, else raise naming it."""
    if not isinstance(timeout, (int, float)) or isinstance(timeout, bool):
        msg = f"timeout must be a positive number of seconds, got {describe(timeout)}"
        raise ConfigTypeError(msg)
    if not timeout > 0:
        msg = f"timeout must be a positive number of seconds, got {timeout}"
        raise ConfigError(msg)
    return float(timeout)


def _check_launch(
    fn: object,
    world_size: object,
    args: object,
    kwargs: object,
    backend: object,
    timeout: object,
) -> None:
    if not callable(fn):
        msg = f"fn must be callable as fn(rank, world_size, *args), got {describe(fn)}"
        raise ConfigTypeError(msg)
    world = check_positive(world_size, "world_size")
    check_choice(backend, "backend", ("gloo", "nccl"))
    check_timeout(timeout)
    if backend == "nccl" and torch.cuda.device_count() < world:
        msg = (
            f"backend='nccl' needs a GPU per rank, {world} for world_size={world}, and "
            f"this machine has {torch.cuda.device_count()}; use backend='gloo'"
        )
        raise ConfigError(msg)
    if isinstance(args, (str, bytes)) or not isinstance(args, Sequence):
        msg = f"args must be a sequence of fn's positional arguments, got {describe(args)}"
        raise ConfigTypeError(msg)
    if kwargs is not None and not isinstance(kwargs, Mapping):
        msg = f"kwargs must be a mapping of fn's keyword arguments or None, got {describe(kwargs)}"
        raise ConfigTypeError(msg)
    session = _interactive_main()
    for name, value in (("fn", fn), ("args", args), ("kwargs", kwargs)):
        pickler = _MainFinder()
        try:
            pickler.dump(value)
        except Exception as error:
            msg = (
                f"{name} cannot be sent to the ranks ({type(error).__name__}: {error}); "
                "pass a module-level function (not a lambda or a local function) and "
                "picklable arguments"
            )
            raise ConfigTypeError(msg) from None
        if session is not None and pickler.found:
            msg = (
                f"{name} holds {pickler.found[0]}, defined in {session}, which the ranks "
                "cannot import (each is a new process, which imports what it is sent by "
                "module and name); define it in a module file and import it from there"
            )
            raise ConfigTypeError(msg)


class _MainFinder(pickle.Pickler):
    """A pickler that records what of ``__main__`` the object it dumps refers to (by
    reference: functions, classes, their instances)."""

    def __init__(self) -> None:
        super().__init__(io.BytesIO())
        self.found: list[str] = []

    def reducer_override(self, obj: Any) -> Any:
        if getattr(obj, "__module__", None) == "__main__":
            self.found.append(getattr(obj, "__qualname__", None) or describe(obj))
        return NotImplemented


def _interactive_main() -> str | None:
    """What ``__main__`` is when the ranks cannot import it (no file to run again: a
    notebook, ``python -c``), in words; None when they can (a script, ``python -m``).

    Raises:
        ConfigError: ``__main__`` names a file that does not exist (a program read from
            stdin): each rank's process runs that file again before anything else.
    """
    main = sys.modules.get("__main__")
    if getattr(getattr(main, "__spec__", None), "name", None):
        return None
    path = getattr(main, "__file__", None)
    if path is None:
        return "an interactive session's __main__ (a notebook, python -c)"
    if not os.path.isfile(path):
        msg = (
            f"the ranks cannot be started from a program read from {path}: each rank's "
            "process runs the launching program's file again first (multiprocessing's "
            "forkserver), and there is none; save the program to a file and run that"
        )
        raise ConfigError(msg)
    return None


def _launch(
    fn: Callable[..., Any],
    world: int,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    backend: str,
    timeout: float,
) -> list[_Answer]:
    context = multiprocessing.get_context("forkserver")
    # Imported once in the server rather than in every rank: torch.distributed.fsdp alone
    # costs a rank about 0.9 s of CPU, and every launch that shards would pay it again.
    context.set_forkserver_preload([*_PRELOAD, getattr(fn, "__module__", None) or "torch"])
    queue = context.SimpleQueue()
    # Started once every rank has (or ended): a slow start-up on a busy machine is not
    # the rank's time; the start-up itself has the same allowance.
    deadline = time.monotonic() + 2 * timeout
    answers: dict[int, _Answer] = {}
    started: set[int] = set()  # the ranks whose process came as far as _rank_main
    # One buffer rather than the objects: the forkserver sends a tensor in the arguments
    # as a file descriptor, at most 256 of them in all.
    sent = io.BytesIO()
    torch.save((args, kwargs), sent)
    with tempfile.TemporaryDirectory(prefix="gradaccum-") as directory:
        processes = [
            context.Process(
                target=_rank_main,
                args=(fn, rank, world, backend, timeout, directory, sent.getvalue(), queue),
            )
            for rank in range(world)
        ]
        try:
            for process in processes:
                process.start()
            while len(answers) < world and time.monotonic() < deadline:
                if not queue.empty():
                    answer = queue.get()
                    if answer.value is None and answer.error is None:
                        started.add(answer.rank)
                        if len(started) == world:
                            deadline = time.monotonic() + 2 * timeout
                    else:
                        answers[answer.rank] = answer
                elif any(process.is_alive() for process in processes):
                    time.sleep(0.01)
                elif queue.empty():
                    break  # every rank is gone and nothing more will come
            for process in processes:
                process.join(timeout=max(0.0, deadline - time.monotonic()))
        finally:
            hung = [process.is_alive() for process in processes]
            for process in processes:  # a rank still running now hangs
                _end(process)
    for rank, process in enumerate(processes):
        if rank not in answers:
            why = _no_answer(rank, process, hung[rank], rank in started, timeout)
            answers[rank] = _Answer(rank, error=why)
    return [answers[rank] for rank in range(world)]


def _no_answer(
    rank: int,
    process: multiprocessing.process.BaseProcess,
    hung: bool,
    started: bool,
    timeout: float,
) -> str:
    """Why ``rank`` sent nothing back: it hung and was killed, or its process ended
    first: before it ran anything of gradaccum's (it could not start), or while joining
    the group or in ``fn`` (by ``os._exit`` or a signal)."""
    if hung:
        return (
            f"rank {rank} gave no answer within {2 * timeout:g} s of every rank's start "
            "(was killed, with every process it started); where it was only slow (a busy "
            "machine, a large model), pass a larger timeout="
        )
    code = process.exitcode
    how = f"exit code {code}" if code is None or code >= 0 else signal.Signals(-code).name
    if started:
        return (
            f"rank {rank} ended ({how}) in fn or while joining the process group, without "
            "raising (os._exit, or a signal); what it printed is above"
        )
    return (
        f"rank {rank} could not start ({how}); what it printed is above. Most often its "
        "start ran the launching script's top level again, which launched again: call "
        'run_ranks (or check_accumulation) under `if __name__ == "__main__":`; or fn or '
        "its arguments could not be imported there"
    )


def _end(process: multiprocessing.process.BaseProcess) -> None:
    """Kill ``process`` and its process group (what it started), and reap it."""
    if process.pid is None:
        return  # never started
    # The rank leads its group from its first line; before that, or once the group is
    # empty, there is none to kill.
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(process.pid, signal.SIGKILL)
    if process.is_alive():
        process.kill()
    process.join()


def _rank_main(
    fn: Callable[..., Any],
    rank: int,
    world: int,
    backend: str,
    timeout: float,
    directory: str,
    sent: bytes,
    queue: Any,
) -> None:
    os.setpgid(0, 0)  # what this rank starts joins its group, which the launcher kills
    # The objects forked from the server (all of torch) never become garbage here; a
    # collection that walked them would write to every page they share with the server,
    # copying it: about half a second of CPU per rank (most of a small launch's cost).
    gc.freeze()
    queue.put(_Answer(rank))  # it started: what ends it from now on is not its start
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        GLOO_SOCKET_IFNAME="lo",
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(world),
        LOCAL_WORLD_SIZE=str(world),
    )
    torch.set_num_threads(1)
    try:
        args, kwargs = torch.load(io.BytesIO(sent), weights_only=False)  # (from the launcher)
        if backend == "nccl":
            torch.cuda.set_device(rank)
        dist.init_process_group(
            backend,
            store=dist.FileStore(os.path.join(directory, "store"), world),  # type: ignore[attr-defined]
            rank=rank,
            world_size=world,
            timeout=timedelta(seconds=timeout),
        )
        # Every rank is connected before fn runs, so that one failing at once cannot
        # break the others' connections while they are being made.
        dist.barrier()
        buffer = io.BytesIO()
        torch.save(fn(rank, world, *args, **kwargs), buffer)
        queue.put(_Answer(rank, value=buffer.getvalue()))
    except BaseException:
        queue.put(_Answer(rank, error=traceback.format_exc()))
        os._exit(1)  # leave at once: a broken group may hang in its teardown
    gc.collect()  # models hold the group in reference cycles; free them before destroying it
    dist.destroy_process_group()
