"""Fixed histogram bins read off a float's bits: exact, mergeable, and cheap.

The histograms of :mod:`.histograms` (and of the native kernel, which computes the same
bin indices from the same bits) use these bins. Fixed edges make windows and ranks merge
exactly: bin counts simply add.
"""

from __future__ import annotations

import torch
from torch import Tensor


class LogBins:
    """Fixed logarithmic bins whose index is read off a float's bits, exactly and fast.

    The edges are ``2**e * (1 + j / steps)`` for ``e = low ... low + octaves - 1`` and
    ``j = 0 ... steps - 1``, then ``2**(low + octaves)``: ``steps`` bins per octave (a
    power of two), all of them exactly representable in float32 and float64. For a
    positive float, the exponent and the leading ``log2(steps)`` mantissa bits ARE the
    bin, so the index is a shift of the bit pattern: several times cheaper than the
    binary search of ``torch.bucketize``, with the same result (``bucketize(x, edges,
    right=True)``).

    Unsigned bins (for values >= 0) are ``(-inf, m_0)``, ``[m_j, m_{j+1})``, ``[m_top,
    inf)`` over the magnitudes ``m``. Signed bins mirror them: ``(-inf, -m_top)``, ...,
    ``[-m_{j+1}, -m_j)``, ..., ``[-m_0, m_0)`` (zero and anything smaller than ``m_0``),
    ..., ``[m_top, inf)``.

    Args:
        low: ``m_0 = 2**low``, the smallest magnitude edge.
        octaves: the number of octaves above it (``m_top = 2**(low + octaves)``).
        signed: mirror the bins to negative values.
        steps: bins per octave, a power of two from 1 to 1024.

    Example:
        >>> import torch
        >>> bins = LogBins(-2, 2, signed=False, steps=2)
        >>> bins.edges
        (0.25, 0.375, 0.5, 0.75, 1.0)
        >>> bins.index(torch.tensor([0.0, 0.3, 0.75, 7.0])).tolist()
        [0, 1, 4, 5]
    """

    def __init__(self, low: int, octaves: int, *, signed: bool, steps: int = 4) -> None:
        if steps < 1 or steps > 1024 or steps & (steps - 1):
            raise ValueError(f"`steps` must be a power of two from 1 to 1024, got {steps!r}.")
        self.low, self.octaves, self.signed, self.steps = low, octaves, signed, steps
        self.bits = steps.bit_length() - 1  # mantissa bits that pick the step
        self.top = steps * octaves  # index of the largest magnitude edge
        magnitudes = [
            2.0 ** (low + j // steps) * (1 + (j % steps) / steps) for j in range(self.top + 1)
        ]
        negative = [-m for m in reversed(magnitudes)] if signed else []
        self.edges: tuple[float, ...] = (*negative, *magnitudes)
        """The sorted edges; ``len(edges) + 1`` bins."""

    def layout(self, dtype: torch.dtype) -> tuple[torch.dtype, int, int]:
        """How :meth:`index` reads a float of ``dtype``: float32 or float64.

        Returns the integer dtype of its bits, the right shift that turns the bits of a
        magnitude into its step (its exponent and leading mantissa bits), and the step of
        the lowest edge ``m_0``. The bin of a value ``x >= 0`` is
        ``clamp(step(x) - step(m_0) + 1, 0, top + 1)``.
        """
        if dtype == torch.float64:
            int_dtype, mantissa, bias = torch.int64, 52, 1023
        elif dtype == torch.float32:
            int_dtype, mantissa, bias = torch.int32, 23, 127
        else:
            raise TypeError(f"{type(self).__name__}: float32 or float64 values, got {dtype}")
        # A product, not a shift: traced with symbolic ints, a shift of two ints is what
        # some torch.compile releases cannot evaluate.
        return int_dtype, mantissa - self.bits, (bias + self.low) * self.steps

    def index(self, values: Tensor) -> Tensor:
        """The bin of each of the (finite, contiguous) float32 or float64 ``values``."""
        int_dtype, shift, offset = self.layout(values.dtype)
        magnitude = torch.iinfo(int_dtype).max
        bits = values.view(int_dtype)
        if not self.signed:
            # A negative value has the sign bit set: a negative int, clamped to bin 0.
            return ((bits >> shift) - offset).clamp_(-1, self.top).add_(1).long()
        negative = bits < 0
        # For x < 0 the bins close on the other side (x in [-m_{j+1}, -m_j) when
        # abs(x) in (m_j, m_{j+1}]): one unit less in the last place turns "<=" into "<".
        steps = ((bits & magnitude) - negative.to(int_dtype)) >> shift
        side = (steps - offset).clamp_(-1, self.top).add_(1)
        return torch.where(negative, -side, side).add_(self.top + 1).long()


class QuarterOctaveBins(LogBins):
    """:class:`LogBins` with four bins per octave: the bins of the TensorBoard histograms.

    About 13 bins per decade, each at most 25 % wide.
    """

    def __init__(self, low: int, octaves: int, *, signed: bool) -> None:
        super().__init__(low, octaves, signed=signed, steps=4)


LOG_RATIO_BINS = QuarterOctaveBins(-20, 25, signed=True)
"""Bins of the log-ratio histogram: symmetric, four per octave from ``2**-20`` (about
1e-6) to ``2**5 = 32`` on each side (``abs(r) <= 20`` after the floor), with a central
bin ``[-2**-20, 2**-20)`` that holds exact zeros (identical log-probs) and differences
below float32 resolution."""

PROBS_DIFF_BINS = QuarterOctaveBins(-27, 27, signed=False)
"""Bins of the ``abs(pa - pb)`` histogram: four per octave from ``2**-27`` (about 7e-9)
to 1; the first bin holds exact zeros and differences below the floor's probability
scale (``e**-20``, about 2e-9)."""

LOG_RATIO_EDGES: tuple[float, ...] = LOG_RATIO_BINS.edges
"""Edges of the log-ratio histogram (202: 203 bins)."""

PROBS_DIFF_EDGES: tuple[float, ...] = PROBS_DIFF_BINS.edges
"""Edges of the ``abs(pa - pb)`` histogram (109: 110 bins)."""

HISTOGRAMS: tuple[tuple[str, QuarterOctaveBins], ...] = (
    ("rollout_log_ratio_hist", LOG_RATIO_BINS),
    ("rollout_probs_diff_hist", PROBS_DIFF_BINS),
)
"""The histograms: un-prefixed TensorBoard tag and bins.

With edges ``e_0 < ... < e_{n-1}`` there are ``n + 1`` bins: ``(-inf, e_0)``,
``[e_{i-1}, e_i)`` and ``[e_{n-1}, inf)``, which is ``numpy.searchsorted(edges, x,
side="right")`` and TensorBoard's own convention (a bucket holds values below its limit).
"""
