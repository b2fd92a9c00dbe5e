"""Fixed histogram bins read off a float's bits: exact, mergeable, and cheap.

The histograms of :mod:`.extras` (and of the native kernel, which computes the same bin
indices from the same bits) use these bins. Fixed edges make windows and ranks merge
exactly: bin counts simply add.
"""

from __future__ import annotations

import torch
from torch import Tensor


class QuarterOctaveBins:
    """Fixed logarithmic bins whose index is read off a float's bits, exactly and fast.

    The edges are ``2**e * (1, 1.25, 1.5, 1.75)`` for ``e = low ... low + octaves - 1``,
    then ``2**(low + octaves)``: four bins per octave (about 13 per decade, each at most
    25 % wide), all of them exactly representable in float32 and float64. For a positive
    float, the exponent and the two leading mantissa bits ARE the bin, so the index is a
    shift of the bit pattern: several times cheaper than the binary search of
    ``torch.bucketize``, with the same result (``bucketize(x, edges, right=True)``).

    Unsigned bins (for values >= 0) are ``(-inf, m_0)``, ``[m_j, m_{j+1})``, ``[m_top,
    inf)`` over the magnitudes ``m``. Signed bins mirror them: ``(-inf, -m_top)``, ...,
    ``[-m_{j+1}, -m_j)``, ..., ``[-m_0, m_0)`` (zero and anything smaller than ``m_0``),
    ..., ``[m_top, inf)``.

    Args:
        low: ``m_0 = 2**low``, the smallest magnitude edge.
        octaves: the number of octaves above it (``m_top = 2**(low + octaves)``).
        signed: mirror the bins to negative values.
    """

    def __init__(self, low: int, octaves: int, *, signed: bool) -> None:
        self.low, self.octaves, self.signed = low, octaves, signed
        self.top = 4 * octaves  # index of the largest magnitude edge
        magnitudes = [2.0 ** (low + j // 4) * (1 + (j % 4) / 4) for j in range(self.top + 1)]
        negative = [-m for m in reversed(magnitudes)] if signed else []
        self.edges: tuple[float, ...] = (*negative, *magnitudes)
        """The sorted edges; ``len(edges) + 1`` bins."""

    def index(self, values: Tensor) -> Tensor:
        """The bin of each of the (finite, contiguous) float32 or float64 ``values``."""
        if values.dtype == torch.float64:
            int_dtype, shift, bias, magnitude = torch.int64, 50, 1023, (1 << 63) - 1
        elif values.dtype == torch.float32:
            int_dtype, shift, bias, magnitude = torch.int32, 21, 127, (1 << 31) - 1
        else:
            raise TypeError(f"QuarterOctaveBins: float32 or float64 values, got {values.dtype}")
        bits = values.view(int_dtype)
        offset = (bias + self.low) << 2
        if not self.signed:
            # A negative value has the sign bit set: a negative int, clamped to bin 0.
            return ((bits >> shift) - offset).clamp_(-1, self.top).add_(1).long()
        negative = bits < 0
        # For x < 0 the bins close on the other side (x in [-m_{j+1}, -m_j) when
        # abs(x) in (m_j, m_{j+1}]): one unit less in the last place turns "<=" into "<".
        steps = ((bits & magnitude) - negative.to(int_dtype)) >> shift
        side = (steps - offset).clamp_(-1, self.top).add_(1)
        return torch.where(negative, -side, side).add_(self.top + 1).long()


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
