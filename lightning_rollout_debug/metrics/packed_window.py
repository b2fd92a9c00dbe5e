"""The base of the packed windows: batches added lazily, merged exactly, under a lock.

:class:`ThreadSafeWindow` is what :class:`~.stats.MismatchStats` and
:class:`~.extras.TokenExtras` share: a packed float64 state on the batches' device, the
added batches waiting beside it (:data:`Part`: packed states, slots to pack, or the sums
of a torch pass) until the state is read or :data:`PENDING` of them have gathered, and a
lock around every change, so that several threads may feed one window. A window may
keep the last block of its state added into in place (:class:`InPlaceBlock`: the
kernel's profile).

An update adds a batch to both windows with one call: :func:`add_states` (each window
its waiting batches), or :func:`add_pass` (a pass that finishes the batch
into both windows' packed states, run under the extras' lock when it adds into their
in-place block). When either window holds :data:`PENDING` waiting batches, both fold
together (:func:`fold`): the pass sums' rows read once for both, every packed state
merged in one call.
"""

from __future__ import annotations

import contextlib
import copy
import threading
from collections.abc import Callable, Mapping, Sequence
from typing import Any, ClassVar

import torch
from torch import Tensor

from lightning_rollout_debug.metrics.finish import finish_rows, finish_segments
from lightning_rollout_debug.metrics.finish_extras import finish_extras
from lightning_rollout_debug.metrics.layout import Layout, merge_all
from lightning_rollout_debug.metrics.torch_pass.sums import TokenSums

Part = Tensor | Mapping[str, Tensor] | TokenSums
"""A batch waiting in a window: a packed state, slots by name to pack, or a pass's sums."""

PENDING = 32
"""Batches a window holds before finishing and merging them: one fold of many costs what
one of two does, so a step's fixed cost stays small."""


class Locked:
    """What holds a lock around its changes: copies and pickles get a lock of their own.

    A subclass sets ``_lock`` (a lock itself cannot be pickled).
    """

    _lock: threading.Lock

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state.pop("_lock", None)
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._lock = threading.Lock()


class ThreadSafeWindow(Locked):
    """A packed window that merges batches lazily and whose changes hold a lock.

    Added batches wait in a list (:data:`Part`: packed states, slots to pack, or the sums
    of a torch pass, :class:`~.torch_pass.sums.TokenSums`), and are finished and merged,
    exactly, in one go when :attr:`state` is read or when :data:`PENDING` of them have
    gathered, so adding a batch costs no merge. Several threads may feed one instance.
    Copies and pickles get a lock of their own (a lock itself cannot be pickled). A
    subclass sets ``size``, ``layout``, ``_state`` (``None``: empty), ``_pending``,
    ``_lock`` and, to keep a block added into in place, ``_in_place``; it says what its
    pass sums finish into (:attr:`statistics`) and defines :meth:`merge_states` and
    :meth:`identity_state`.
    """

    _lock: threading.Lock
    _state: Tensor | None
    _pending: list[Part]
    _in_place: InPlaceBlock | None = None
    size: int
    layout: Layout
    """How the packed state is laid out and merges."""
    statistics: ClassVar[bool] = False
    """Whether pass sums finish into the statistics (counting the sequences outside
    ``seq_ratio_bounds``), else into the extras or the segments."""
    segments_window: ClassVar[bool] = False
    """Whether pass sums finish into the segments (:func:`~.finish.finish_segments`)."""
    seq_ratio_bounds: tuple[float, float]

    def merge_states(self, states: Tensor) -> Tensor:
        """Merge packed states stacked as ``[n, size]`` into one."""
        raise NotImplementedError

    def identity_state(self, device: torch.device | str | None = None) -> Tensor:
        """The packed state of an empty window."""
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
        if self._in_place is not None:
            self._in_place.clear()

    def _add(self, parts: Sequence[Part], device: torch.device | None = None) -> None:
        """Add waiting batches to the window alone, under the lock.

        The window ends on ``device`` (by default where it is, else where ``parts`` are),
        and folds when :data:`PENDING` batches wait.
        """
        with self._lock:
            self._extend(parts, device)
            if self._waiting() >= PENDING:
                fold([self])

    def _extend(self, parts: Sequence[Part], device: torch.device | None) -> None:
        """Keep ``parts`` waiting, on ``device`` (see :meth:`_add`); the caller holds the lock."""
        target = device or self._device() or _device_of(parts[0])
        self._move(target)
        self._pending.extend(_moved(part, target) for part in parts)

    def _waiting(self) -> int:
        """How many batches wait: in the list, and as heads of the in-place block."""
        return len(self._pending) + (0 if self._in_place is None else len(self._in_place.heads))

    def _move(self, device: torch.device) -> None:
        """Keep the window on ``device`` from now on; the caller holds the lock."""
        current = self._device()
        if current is not None and current != device:
            self._fold()
            self._state = self._state.to(device)  # type: ignore[union-attr]

    def _device(self) -> torch.device | None:
        """Where the window is: its state's, its first waiting batch's, its in-place block's."""
        if self._state is not None:
            return self._state.device
        if self._pending:
            return _device_of(self._pending[0])
        return None if self._in_place is None else self._in_place.device()

    def _fold(self) -> None:
        """Finish and merge every waiting batch into the state (the caller holds the lock).

        The batches added into the in-place block join it too.
        """
        fold([self], whole=True)

    def __getstate__(self) -> dict[str, Any]:
        state = super().__getstate__()
        state["_pending"] = list(self._pending)
        if self._in_place is not None:  # added into in place: a copy holds its own
            state["_in_place"] = copy.copy(self._in_place)
        return state


class InPlaceBlock:
    """The last block of a window's state, which each batch of a pass adds into in place.

    A pass that adds its block (from slot ``at`` on, the kernel's profile: thousands of
    slots) into the window's instead of leaving a state of its own to merge: the block's
    :attr:`state`, empty when the window's first such batch comes, holds every batch's
    block added up; the rest of each batch's state (its head, the slots before ``at``,
    laid out by ``head``) waits in :attr:`heads`, merged into one when :data:`PENDING`
    have gathered. Its window holds the lock around every change.
    """

    def __init__(self, layout: Layout, head: Layout) -> None:
        self.layout, self.head = layout, head
        self.at = head.size
        self.state: Tensor | None = None
        """A packed state whose last block holds the batches' added up (the other slots:
        the last batch's); ``None``: no batch yet."""
        self.heads: list[Tensor] = []
        """The batches' states before the block (laid out by :attr:`head`), waiting."""
        self._head: Tensor | None = None  # a view of :attr:`state`'s head, made once

    def into(self, device: torch.device) -> Tensor:
        """The packed state a batch's pass adds its block into (made empty on ``device``)."""
        if self.state is None:
            self.state = self.layout.identity(device)
        return self.state

    def keep(self) -> None:
        """Keep the head a pass has just written into :attr:`state`, to merge later."""
        if self.state is None:
            return
        if self._head is None:  # a view, made once a window
            self._head = self.state[: self.at]
        self.heads.append(self._head.clone())

    def take(self) -> Tensor | None:
        """The batches' packed state, their heads merged (``None``: none); then hold none."""
        if not self.heads or self.state is None:
            self.clear()
            return None
        # One waiting head may be a merge of a fold's worth: always written back.
        heads = self.heads
        self.state[: self.at] = heads[0] if len(heads) == 1 else self.head.merge(torch.stack(heads))
        state = self.state
        self.clear()
        return state

    def clear(self) -> None:
        """Hold no batch."""
        self.state, self._head, self.heads = None, None, []

    def device(self) -> torch.device | None:
        """Where the block is (``None``: it holds nothing)."""
        return None if self.state is None else self.state.device

    def __getstate__(self) -> dict[str, Any]:
        copied = self.__dict__.copy()
        copied["heads"] = list(self.heads)
        if self.state is not None:  # added into in place: a copy holds its own
            copied["state"], copied["_head"] = self.state.clone(), None
        return copied


Finish = Callable[..., tuple[Tensor | None, Tensor | None, Tensor | None] | None]
"""A pass finishing a batch into packed states: ``finish(into=...)`` gives ``(statistics,
extras, segments)`` (``None``: the pass does not apply, and has added nothing into
``into``)."""


def add_states(
    additions: Sequence[tuple[ThreadSafeWindow | None, Sequence[Part]]],
    device: torch.device,
) -> None:
    """Add each window its waiting batches (:data:`Part`; ``None``: no window).

    Each window's under its lock; when either holds :data:`PENDING` waiting batches, all
    of them fold together (:func:`fold`).
    """
    windows = [window for window, _ in additions if window is not None]
    for window, parts in additions:
        if window is not None and parts:
            with window._lock:
                window._extend(parts, device)
    if any(window._waiting() >= PENDING for window in windows):
        with contextlib.ExitStack() as held:
            for window in windows:
                held.enter_context(window._lock)
            fold(windows)


def add_pass(
    finish: Finish,
    windows: tuple[ThreadSafeWindow | None, ThreadSafeWindow | None, ThreadSafeWindow | None],
    device: torch.device,
    more: Sequence[Part] = (),
    series: Any | None = None,
) -> tuple[Tensor | None, Tensor | None, Tensor | None] | None:
    """Add a batch that one pass finishes into packed states; what it finished.

    ``windows``: the statistics, the extras and the segments (each may be ``None``), each
    given its state (``None``: the pass does not apply, and nothing is added). With an
    in-place block, the extras' lock is held through the pass: ``into`` is the block's
    state, which the pass adds its block into and writes the rest of (kept as a head).
    Otherwise ``into`` is ``None`` and the extras' state waits whole. The statistics get
    their state and the states ``more``; ``series`` (a :class:`~.series.MismatchSeries`)
    keeps their state too.
    """
    stats, extras, segments = windows
    if extras is not None and extras._in_place is not None:
        with extras._lock:
            extras._move(device)
            block = extras._in_place
            found = finish(into=block.into(device))
            if found is None:
                return None
            block.keep()
        extras_parts: list[Part] = []
    else:
        found = finish(into=None)
        if found is None:
            return None
        extras_parts = [] if found[1] is None else [found[1]]
    statistics = [] if found[0] is None else [found[0], *more]
    if series is not None and found[0] is not None:
        series.add([found[0]])
    by_segment = [] if found[2] is None else [found[2]]
    add_states(((stats, statistics), (extras, extras_parts), (segments, by_segment)), device)
    return found


def fold(windows: Sequence[ThreadSafeWindow], *, whole: bool = False) -> None:
    """Finish and merge the waiting batches of ``windows`` (statistics, extras or both).

    The caller holds their locks. The rows of the waiting pass sums are read once for
    both windows (:func:`~.finish.finish_rows`), the extras finished from them
    (:func:`~.finish_extras.finish_extras`), and every packed state merged in one call
    (:func:`~.layout.merge_all`): each window's, and the heads of an in-place block.
    ``whole``: the block's batches join the window's state (it is read); else the block
    stays in place, its heads merged into one.
    """
    for window in windows if whole else ():
        added = None if window._in_place is None else window._in_place.take()
        if added is not None:
            window._pending.append(added)
    finished = _finish(windows)
    owners: list[ThreadSafeWindow | InPlaceBlock] = []
    merges: list[tuple[Layout, list[Any], Tensor | None]] = []
    for window, (done, candidates) in zip(windows, finished, strict=True):
        if window._pending:
            parts = [part for part in window._pending if not isinstance(part, TokenSums)]
            kept = [] if window._state is None else [window._state]
            owners.append(window)
            merges.append((window.layout, [*kept, *parts, *done], candidates))
        block = window._in_place
        if not whole and block is not None and len(block.heads) > 1:
            owners.append(block)
            merges.append((block.head, block.heads, None))
    for owner, merged in zip(owners, merge_all(merges) if merges else [], strict=True):
        if isinstance(owner, InPlaceBlock):
            owner.heads = [merged]
        else:
            owner._state, owner._pending = merged, []


def _finish(windows: Sequence[ThreadSafeWindow]) -> list[tuple[list[Any], Tensor | None]]:
    """Each window's waiting pass sums finished, and the extras' worst-token candidates.

    The statistics' as slots by name, the extras' as a packed state (``[]``: no sums).
    """
    stats = next((window for window in windows if window.statistics), None)
    extras = next(
        (window for window in windows if not (window.statistics or window.segments_window)),
        None,
    )
    stats_sums, extras_sums = (
        [] if window is None else [part for part in window._pending if isinstance(part, TokenSums)]
        for window in (stats, extras)
    )
    finished: dict[int, tuple[list[Any], Tensor | None]] = {}
    if stats_sums or extras_sums:
        bounds = (0.99, 1.01) if stats is None else stats.seq_ratio_bounds  # statistics' alone
        slots, rows = finish_rows(stats_sums, extras_sums, bounds)
        if slots is not None:
            finished[id(stats)] = ([slots], None)
        if rows is not None:
            state, candidates = finish_extras(extras_sums, rows)
            finished[id(extras)] = ([state], candidates)
    for window in windows:
        sums = [part for part in window._pending if isinstance(part, TokenSums)]
        if window.segments_window and sums:
            # The passes of one plan together: a batch whose labels the kernel cannot read
            # has its segments in a pass of their own (`backends.add_batch`).
            plans = {id(part.plan): part.plan for part in sums}.values()
            finished[id(window)] = (
                [finish_segments([s for s in sums if s.plan is plan]) for plan in plans],
                None,
            )
    return [finished.get(id(window), ([], None)) for window in windows]


def _device_of(part: Part) -> torch.device:
    """Where a waiting batch is."""
    if isinstance(part, Tensor):
        return part.device
    if isinstance(part, Mapping):
        return next(iter(part.values())).device
    first = part.first
    return first.device if isinstance(first, Tensor) else first[0].device


def _moved(part: Part, device: torch.device) -> Part:
    """A waiting batch on ``device`` (a pass's sums stay where they are)."""
    if isinstance(part, Tensor):
        return part.to(device)
    if isinstance(part, Mapping):
        return {name: value.to(device) for name, value in part.items()}
    return part
