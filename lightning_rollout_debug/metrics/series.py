"""The per-batch series of a run's mismatch: what shows stale weights.

A window's statistics average every batch since the last log; the mean ``|r|`` of each
batch shows what changes from one to the next: with stale weights, a rise at every step
since the engine's weight sync and a drop at each (:mod:`.sawtooth`).
:class:`MismatchSeries` keeps that series: on the device, each batch of the open window as
the pass left it (the packed state of the native kernel, the row sums of a torch pass),
read at the logged step as the batch's sums of ``|r|`` and ``r^2`` and its tokens, merged
over the ranks with the window (:meth:`~MismatchSeries.window_values`); on the host, the
last :data:`SERIES_LENGTH` batches of the run, merged, across windows and checkpoints
(:meth:`~MismatchSeries.extend`). An update adds no operation and no copy; a logged step
about ten small ones per batch of the window.

Example:
    >>> import torch
    >>> from lightning_rollout_debug.metrics.layout import STATE
    >>> series = MismatchSeries()
    >>> for mean in (0.01, 0.02, 0.03, 0.04) * 3:  # synced every 4 batches
    ...     series.add([STATE.pack({"count": torch.tensor(500.0), "log_diff": torch.tensor(mean)})])
    >>> read = series.extend(series.window_values(torch.device("cpu")).tolist())
    >>> [round(mean, 2) for mean in read.means[:4]], sawtooth(read).period
    ([0.01, 0.02, 0.03, 0.04], 4)
"""

from __future__ import annotations

import math
import threading
from collections import deque
from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor

from lightning_rollout_debug.metrics.finish import moment_rows
from lightning_rollout_debug.metrics.layout import STATE, tensor_problems
from lightning_rollout_debug.metrics.packed_window import Locked
from lightning_rollout_debug.metrics.sawtooth import Series, sawtooth
from lightning_rollout_debug.metrics.torch_pass.sums import TokenSums

__all__ = ["SERIES_LENGTH", "MismatchSeries", "Series", "sawtooth", "series_problems"]

SERIES_LENGTH = 64
"""The batches the series holds: the last ones of the run."""

_COLUMNS = 4  # per batch: the sums of |r| and of r^2, the tokens, the ranks that fed it
_COUNT, _MEAN = STATE.at["count"], STATE.at["log_diff"]
_SPREAD = STATE.at["log_diff*log_diff"]


class MismatchSeries(Locked):
    """The sums of ``|r|``, ``r^2`` and tokens of each of the run's last batches.

    :meth:`add` keeps a batch of the open window as its pass left it, on its device;
    :meth:`window_values` reads the window's batches into one vector for the logged step's
    collective and host copy, :meth:`merge_states` merges the ranks' (sums), and
    :meth:`extend` adds the merged window to the run's series on the host, which holds
    the last :data:`SERIES_LENGTH` batches. The series of
    the log-space group's ``|r|``: the native kernel writes its moments with that group.
    """

    size = SERIES_LENGTH * _COLUMNS
    """Length of a window's vector."""

    def __init__(self) -> None:
        self._window: deque[tuple[Tensor | TokenSums, ...]] = deque(maxlen=SERIES_LENGTH)
        self._lock = threading.Lock()
        self.history: list[tuple[float, float, float]] = []
        """The run's last batches, oldest first: ``(sum |r|, tokens, sum r^2)``, merged."""

    def add(self, parts: Sequence[Tensor | TokenSums]) -> None:
        """Keep a batch: its packed statistics state, or the sums of its torch passes."""
        with self._lock:
            self._window.append(tuple(parts))

    def window_values(self, device: torch.device) -> Tensor:
        """The open window's last batches as ``[sum |r|, tokens, sum r^2, 1]`` rows, on ``device``.

        Float64, :attr:`size` long whatever the window holds (its first rows 0), so that
        every rank's vector has the same length.
        """
        with self._lock:
            batches = list(self._window)
        options: dict[str, Any] = {"dtype": torch.float64, "device": device}
        if not batches:
            return torch.zeros(self.size, **options)
        if all(len(parts) == 1 and isinstance(parts[0], Tensor) for parts in batches):
            # The native kernel's states, one a batch: read together, in a few operations.
            sums = _state_sums(torch.stack([parts[0] for parts in batches]).to(device))
        else:
            sums = torch.stack([_batch_sums(parts, device) for parts in batches])
        rows = torch.cat([sums, torch.ones(len(batches), 1, **options)], dim=1)
        return torch.nn.functional.pad(rows, (0, 0, SERIES_LENGTH - len(batches), 0)).flatten()

    @staticmethod
    def merge_states(gathered: Tensor) -> Tensor:
        """Merge the ranks' window vectors stacked as ``[ranks, size]``: their sums."""
        return gathered.sum(0)

    def extend(self, values: Sequence[float]) -> Series:
        """Add a merged window's vector (on the host) to the run's series; read the series.

        The open window is emptied.
        """
        rows = [values[i : i + _COLUMNS] for i in range(0, len(values), _COLUMNS)]
        with self._lock:
            self._window.clear()
            self.history.extend((row[0], row[1], row[2]) for row in rows if row[3] > 0)
            del self.history[:-SERIES_LENGTH]
        return self.read()

    def read(self) -> Series:
        """The series' per-batch mean ``|r|`` and its standard error (NaN: no token)."""
        means, errors = [], []
        for total, tokens, squares in self.history:
            mean = total / tokens if tokens > 0 else math.nan
            variance = max(squares / tokens - mean * mean, 0.0) if tokens > 0 else math.nan
            means.append(mean)
            errors.append(math.sqrt(variance / tokens) if tokens > 0 else math.nan)
        return Series(means, errors)

    def clear_window(self) -> None:
        """Forget the open window's batches (the run's series stays)."""
        with self._lock:
            self._window.clear()

    def reset(self) -> None:
        """Start over: no batch in the window or the series."""
        with self._lock:
            self._window.clear()
            self.history = []

    def state(self, window: Sequence[float] = ()) -> Tensor:
        """The series and a merged window's ``values`` after it, as a checkpoint holds them."""
        rows = [[total, tokens, squares, 1.0] for total, tokens, squares in self.history]
        rows += [list(window[i : i + _COLUMNS]) for i in range(0, len(window), _COLUMNS)]
        rows = [row for row in rows if row[3] > 0][-SERIES_LENGTH:]
        rows = [[0.0] * _COLUMNS] * (SERIES_LENGTH - len(rows)) + rows
        return torch.tensor(rows, dtype=torch.float64).flatten()

    def load_state(self, state: Tensor) -> None:
        """Continue the series of :meth:`state` (checked with :func:`series_problems`)."""
        with self._lock:
            self._window.clear()
            self.history = []
        self.extend(state.tolist())


def series_problems(state: Any) -> list[str]:
    """Why ``state`` cannot be a saved series (nothing wrong: ``[]``)."""
    found = tensor_problems(state, (MismatchSeries.size,), "the stale-weights series")
    if found:
        return found
    if not all(math.isfinite(v) and v >= 0 for v in state.tolist()):
        return ["the stale-weights series holds a negative or non-finite value"]
    return []


def _batch_sums(parts: Sequence[Tensor | TokenSums], device: torch.device) -> Tensor:
    """A batch's sums of ``|r|``, tokens and ``r^2`` from the states or pass sums it left."""
    total: Tensor | None = None
    for part in parts:
        if isinstance(part, Tensor):  # a packed statistics state (the native kernel's)
            sums = _state_sums(part.unsqueeze(0))[0]
        else:  # the row sums of a torch pass: |r|'s, and its centred squares
            part = moment_rows(part)
            at, centred = part.plan.at, part.plan.centred.start
            rows = torch.stack(
                [
                    _row(part.first, at["l"]),
                    _row(part.first, at["one"]),
                    _row(part.second, at["l"] - centred),
                ]
            ).to(torch.float64)
            if part.shift is not None:  # squares about each row's mean: add the mean's
                rows[2] += rows[0] * rows[0] / rows[1].clamp(min=1.0)
            sums = rows.sum(1)
        sums = sums.to(device)
        total = sums if total is None else total + sums
    assert total is not None
    return total


def _state_sums(states: Tensor) -> Tensor:
    """``[n, 3]``: the sums of ``|r|``, tokens and ``r^2`` of ``n`` packed statistics states."""
    tokens, mean = states[:, _COUNT], states[:, _MEAN]
    return torch.stack([mean * tokens, tokens, states[:, _SPREAD] + tokens * mean * mean], dim=1)


def _row(field: Tensor | Sequence[Tensor], index: int) -> Tensor:
    """Plane ``index`` of a pass's per-row field, ``[B]`` (a compiled pass leaves a list)."""
    return field[index].reshape(-1)
