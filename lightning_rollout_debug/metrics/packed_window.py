"""The base of the packed windows: batches added lazily, merged exactly, under a lock.

:class:`ThreadSafeWindow` is what :class:`~.stats.MismatchStats` and
:class:`~.extras.TokenExtras` share: a packed float64 state on the batches' device, the
added batches waiting beside it (packed states, or the sums of a torch pass) until the
state is read or :data:`PENDING` of them have gathered, and a lock around every change,
so that several threads may feed one window.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor

from lightning_rollout_debug.metrics.token_pass import TokenSums

PENDING = 32
"""Batches a window holds before finishing and merging them: one fold of many costs what
one of two does, so a step's fixed cost stays small."""


class ThreadSafeWindow:
    """A packed window that merges batches lazily and whose changes hold a lock.

    Added batches wait in a list, as packed states or as the sums of a torch pass
    (:class:`~.token_pass.TokenSums`), and are finished and merged, exactly, in one go
    when :attr:`state` is read or when :data:`PENDING` of them have gathered, so adding a
    batch costs no merge. Several threads may feed one instance. Copies and pickles get a
    lock of their own (a lock itself cannot be pickled). A subclass sets ``size``,
    ``_state`` (``None``: empty), ``_pending`` and ``_lock``, and defines
    :meth:`merge_states`, :meth:`identity_state` and :meth:`finish`.
    """

    _lock: threading.Lock
    _state: Tensor | None
    _pending: list[Tensor]
    size: int

    def merge_states(self, states: Tensor) -> Tensor:
        """Merge packed states stacked as ``[n, size]`` into one."""
        raise NotImplementedError

    def identity_state(self, device: torch.device | str | None = None) -> Tensor:
        """The packed state of an empty window."""
        raise NotImplementedError

    def finish(self, sums: Sequence[TokenSums]) -> Tensor:
        """The packed state of the tokens of the passes ``sums``."""
        raise NotImplementedError

    @property
    def state(self) -> Tensor:
        """The packed float64 state vector (the identity when nothing was added)."""
        with self._lock:
            self._fold()
            state = self._state
        return self.identity_state() if state is None else state

    @property
    def device(self) -> torch.device | None:
        """Where the window lives: the device of the first update, ``None`` before it."""
        with self._lock:
            return self._device()

    def load_state(self, state: Tensor) -> None:
        """Replace the window with a packed state vector of length :attr:`size`."""
        if state.shape != (self.size,):
            raise ValueError(f"A packed state has shape ({self.size},); got {tuple(state.shape)}.")
        copied = state.detach().to(torch.float64).clone()
        with self._lock:
            self._replace(copied)

    def reset(self) -> None:
        """Start a new, empty window."""
        with self._lock:
            self._replace(None)

    def _replace(self, state: Tensor | None) -> None:
        """Make ``state`` the whole window (``None``: empty); the caller holds the lock."""
        self._state, self._pending = state, []

    def _add(self, parts: Sequence[Tensor | TokenSums], device: torch.device | None = None) -> None:
        """Add packed states or pass sums to the window, under the lock.

        The window ends on ``device`` (by default where it is, else where ``parts`` are).
        """
        with self._lock:
            target = device or self._device() or _device_of(parts[0])
            self._move(target)
            moved = (part.to(target) if isinstance(part, Tensor) else part for part in parts)
            self._pending.extend(moved)
            if len(self._pending) >= PENDING:
                self._fold()

    def _move(self, device: torch.device) -> None:
        """Keep the window on ``device`` from now on; the caller holds the lock."""
        current = self._device()
        if current is not None and current != device:
            self._fold()
            self._state = self._state.to(device)  # type: ignore[union-attr]

    def _device(self) -> torch.device | None:
        if self._state is not None:
            return self._state.device
        return _device_of(self._pending[0]) if self._pending else None

    def _fold(self) -> None:
        """Finish and merge the waiting batches into the window (the caller holds the lock)."""
        if not self._pending:
            return
        target = self._device()
        sums = [part for part in self._pending if isinstance(part, TokenSums)]
        parts = [part for part in self._pending if isinstance(part, Tensor)]
        if sums:
            parts.append(self.finish(sums).to(target))
        if self._state is not None:
            parts.insert(0, self._state)
        self._state = parts[0] if len(parts) == 1 else self.merge_states(torch.stack(parts))
        self._pending = []

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state.pop("_lock", None)
        state["_pending"] = list(self._pending)
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._lock = threading.Lock()


def _device_of(part: Tensor | TokenSums) -> torch.device:
    """Where a packed state or the sums of a pass are."""
    if isinstance(part, Tensor):
        return part.device
    first = part.first
    return first.device if isinstance(first, Tensor) else first[0].device
