"""Shifts of the log-probs by more than one position, searched on a sample of each window.

The window's sums pair each token with its neighbours (lags -1, 0 and +1) exactly, over
every token. A shift by more positions (the trainer's log-probs sliced from the start of
the whole sequence, ``lp[:, :T]``, are late by the prompt's width) needs the pairs at
every lag up to half the response's width: far too many sums to keep for every token.
:class:`ShiftSample` keeps instead the first :data:`SAMPLE_ROWS` rows of a window's first
batch (at most :data:`SAMPLE_COLUMNS` columns): one copy of a few thousand values, at the
window's first update only. At the logged step it gives, for every lag ``L`` in
``[-LAGS, LAGS]``, the sums over the sample's pairs ``(a_t, b_(t+L))`` of one row that both
count (their number, ``a``, ``b``, ``a^2``, ``b^2``, ``a b``), from five FFTs of length
twice the sample's width: a fixed vector of float64 sums, which merges over the ranks by
adding, in the logged step's one collective and one host copy.

Example:
    >>> import torch
    >>> from lightning_rollout_debug.metrics.inputs import check_inputs
    >>> log_p = -torch.rand(4, 40, generator=torch.Generator().manual_seed(0)) * 5
    >>> late = torch.cat([torch.zeros(4, 6), log_p[:, :-6]], dim=1)  # six columns late
    >>> sample = ShiftSample()
    >>> sample.add(check_inputs(log_p, late, torch.ones(4, 40)))
    >>> sums = lag_sums(sample.window_values(torch.device("cpu")).tolist())
    >>> sums[-6][0], round(sums[-6][5], 4) == round(sums[-6][4], 4)  # 34 pairs a row, a = b
    (136.0, True)
"""

from __future__ import annotations

import threading
from collections.abc import Sequence

import torch
from torch import Tensor

from lightning_rollout_debug.metrics.inputs import MismatchInputs
from lightning_rollout_debug.metrics.packed_window import Locked
from lightning_rollout_debug.metrics.tokens import LOG_PROB_FLOOR

SAMPLE_ROWS = 8
"""The rows of a window's first batch that the sample keeps."""
SAMPLE_COLUMNS = 1024
"""The most columns of each: shifts up to half of them are searched."""
LAGS = SAMPLE_COLUMNS // 2
"""The largest shift searched, each way."""
SUMS = ("pairs", "actor", "rollout", "actor_sq", "rollout_sq", "actor_x_rollout")
"""The sums of each lag, over its pairs ``(a_t, b_(t+L))``."""


class ShiftSample(Locked):
    """The first rows of a window's first batch, and their pairs' sums at every lag.

    :meth:`add` copies them from the window's first batch (later batches add nothing);
    :meth:`window_values` reads the sums at every lag on the device, :meth:`merge_states` adds the
    ranks' up, and :func:`lag_sums` reads them on the host.
    """

    size = len(SUMS) * (2 * LAGS + 1)
    """Length of a window's vector."""

    def __init__(self) -> None:
        self._sample: Tensor | None = None
        self._lock = threading.Lock()

    def add(self, inputs: MismatchInputs) -> None:
        """Keep the first rows of ``inputs`` when the window has no sample yet (one copy).

        A batch without tokens' places (an empty mask) leaves none.
        """
        if self._sample is not None or inputs.mask.numel() == 0:
            return
        rows = (slice(0, SAMPLE_ROWS), slice(0, SAMPLE_COLUMNS))
        parts = (inputs.old_log_probs, inputs.rollout_log_probs, inputs.mask)
        # A copy without the inputs' autograd graph: they are not kept past the update.
        sample = torch.stack([part[rows].detach().to(torch.float64) for part in parts])
        with self._lock:
            if self._sample is None:
                self._sample = sample

    def clear(self) -> None:
        """A new window: no sample."""
        with self._lock:
            self._sample = None

    def window_values(self, device: torch.device) -> Tensor:
        """The sums of every lag (:data:`SUMS`, lag ``-LAGS`` first), on ``device``.

        Float64, :attr:`size` long whatever the sample (zeros without one, and at lags
        beyond half its width).
        """
        with self._lock:
            sample = self._sample
        if sample is None:
            return torch.zeros(self.size, dtype=torch.float64, device=device)
        a, b, mask = sample.to(device).clamp(min=LOG_PROB_FLOOR).unbind()  # -inf: -20
        counts = (mask != 0) & a.isfinite() & b.isfinite()  # NaN and +inf do not count
        a, b = torch.where(counts, a, 0.0), torch.where(counts, b, 0.0)
        one = counts.to(torch.float64)
        width = one.shape[-1]
        spectra = torch.fft.rfft(torch.stack([one, a, a * a, b, b * b]), n=2 * width)
        # (left, right) of each sum: sum_t left_t right_(t+L), a cross-correlation.
        left = torch.stack([spectra[i] for i in (0, 1, 0, 2, 0, 1)]).conj()
        right = torch.stack([spectra[i] for i in (0, 0, 3, 0, 4, 3)])
        by_lag = torch.fft.irfft(left * right, n=2 * width).sum(1)  # [6, 2 width], lag mod 2w
        reach = min(LAGS, width // 2)
        sums = torch.cat([by_lag[:, 2 * width - reach :], by_lag[:, : reach + 1]], dim=1)
        sums = torch.nn.functional.pad(sums, (LAGS - reach, LAGS - reach))
        sums[0] = sums[0].round()  # pair counts, whole after the FFT's rounding
        return sums.flatten()

    @staticmethod
    def merge_states(gathered: Tensor) -> Tensor:
        """Merge the ranks' vectors stacked as ``[ranks, size]``: their sums."""
        return gathered.sum(0)


def lag_sums(values: Sequence[float]) -> dict[int, tuple[float, ...]]:
    """The sums (:data:`SUMS`) of each lag from a window's vector on the host, by lag."""
    lags = 2 * LAGS + 1
    columns = [values[i * lags : (i + 1) * lags] for i in range(len(SUMS))]
    return {lag: tuple(column[lag + LAGS] for column in columns) for lag in range(-LAGS, LAGS + 1)}
