"""The processes of a logged step: who they are, how a window is gathered over them.

A logged step merges the window of every rank with one collective. :class:`Ranks` says
how for one step: the ``all_gather`` to call (``None``: this process alone), where it
runs, how many processes there are and whether this one writes the logs. The monitor
builds it from a Fabric or from ``torch.distributed`` (:func:`loop_ranks`); the callback
from its Trainer's strategy.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import Any

import torch
from torch import Tensor


@dataclass(frozen=True)
class Ranks:
    """The processes of a logged step: how a vector is gathered over them, and who writes.

    ``gather`` maps this process's vector to the ``[n, size]`` stack of every process's
    (``None``: this process alone); ``device`` is where the collective runs (``None``:
    where the window is).

    Example:
        >>> Ranks().gather is None  # one process: nothing to gather
        True
    """

    world_size: int = 1
    is_global_zero: bool = True
    gather: Callable[[Tensor], Tensor] | None = None
    device: torch.device | None = None


def loop_ranks(fabric: Any | None, group: Any | None) -> Ranks:
    """The processes of a loop: the Fabric's, those of ``torch.distributed``, or this one.

    With a Fabric the window is gathered by ``fabric.all_gather``; without one, over
    ``group`` (``None``: all ranks) when ``torch.distributed`` is initialised. A rank
    outside ``group`` (given the marker ``new_group`` returns there) gathers nothing and
    asks nothing of the group.
    """
    if fabric is not None:
        world, rank = fabric.world_size, fabric.global_rank
    elif distributed():
        world, rank = torch.distributed.get_world_size(), torch.distributed.get_rank()
    else:
        return Ranks()
    if world == 1 or rank_in(group, rank) < 0:  # alone, or outside the group: its own window
        return Ranks(world, rank == 0)
    if fabric is not None:
        return Ranks(world, rank == 0, partial(fabric.all_gather, group=group), fabric.device)
    return Ranks(world, rank == 0, partial(_all_gather, group=group), _collective_device(group))


def distributed() -> bool:
    """Whether ``torch.distributed`` is initialised."""
    return torch.distributed.is_available() and torch.distributed.is_initialized()


def global_rank() -> int:
    """This process's rank in ``torch.distributed`` (0 when it is not initialised)."""
    return torch.distributed.get_rank() if distributed() else 0


def rank_in(group: Any, rank: int) -> int:
    """This process's rank in ``group`` (``None``: all ranks, ``rank``); -1 outside it."""
    if group is None or not distributed():
        return rank
    return torch.distributed.get_rank(group)


def _all_gather(tensor: Tensor, group: Any = None) -> Tensor:
    """The ``[n, size]`` stack of ``tensor`` of every rank of ``group``."""
    parts = [torch.empty_like(tensor) for _ in range(torch.distributed.get_world_size(group))]
    torch.distributed.all_gather(parts, tensor, group=group)
    return torch.stack(parts)


def _collective_device(group: Any) -> torch.device | None:
    """Where the group's collectives take tensors: NCCL's GPU, gloo's CPU, else the window's."""
    backend = str(torch.distributed.get_backend(group))
    if "nccl" in backend and torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu") if backend == "gloo" else None
