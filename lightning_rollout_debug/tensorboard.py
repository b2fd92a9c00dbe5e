"""TensorBoard extras: mismatch histograms, the worst tokens, and a dashboard layout.

:class:`TokenExtras` keeps, next to the statistics of ``stats.py``, one packed float64
vector on the batch's device:

* two histograms with FIXED bins, of the log ratio ``r = a - b`` and of
  ``abs(exp(a) - exp(b))`` over the counting tokens, each with its count, minimum,
  maximum, sum and sum of squares (what ``SummaryWriter.add_histogram_raw`` takes);
* the ``k`` counting tokens with the largest ``abs(r)``, with where they came from.

An update is masked arithmetic (a bin index from each value's bits, ``scatter_add_``
into a fixed-size tensor, ``topk``) with no host synchronisation. Because the bins are
fixed, windows and ranks merge exactly: bin counts, counts and sums add, extremes fold,
and the best ``k`` of all candidates are kept. The writers at the bottom turn a merged
vector, copied to the host once, into ``SummaryWriter`` calls; :func:`dashboard_layout`
builds the custom-scalars layout that groups the metric charts.

Tokens count exactly as in ``stats.py``: log-probs are floored at
:data:`~lightning_rollout_debug.stats.LOG_PROB_FLOOR` first, and a token counts where
the mask is non-zero and both log-probs are finite.
"""

from __future__ import annotations

import math
import re
import sys
import threading
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from lightning_rollout_debug.batch import TOKEN_ID_DTYPES, check_inputs, check_token_ids
from lightning_rollout_debug.stats import (
    ThreadSafeWindow,
    compile_problems,
    counting_tokens,
    exp,
    prob_diff,
    run_fused,
    tensor_problems,
)


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

WORST_TOKENS_TAG = "rollout_worst_tokens"
"""Un-prefixed TensorBoard tag of the worst-tokens table."""

WORST_FIELDS: tuple[str, ...] = (
    "abs_log_ratio",
    "log_ratio",
    "actor_prob",
    "rollout_prob",
    "batch",
    "row",
    "position",
    "token_id",
    "rank",
)
"""Columns of a worst-token candidate in the packed state (``token_id`` is -1 if unknown)."""

WORST_TOKENS_CAPTION = (
    "The window's tokens with the largest |r| = |log(actor prob / rollout prob)|. *batch*: "
    "index of the training batch within the window (0 = first batch after the previous "
    "logged step); *row*, *position*: the token's place in that batch's [B, T] tensors."
)
"""First paragraph of the worst-tokens text, above the table."""

_F = len(WORST_FIELDS)
_MOMENTS = ("num", "min", "max", "sum", "sum_squares")

DASHBOARD: tuple[tuple[str, tuple[tuple[str, tuple[str, ...]], ...]], ...] = (
    (
        "agreement",
        (
            (
                "probability diff |pa - pb|: max, mean, std",
                ("rollout_probs_diff_max", "rollout_probs_diff_mean", "rollout_probs_diff_std"),
            ),
            ("Pearson correlation of pa and pb", ("rollout_actor_probs_pearson_corr",)),
            (
                "log-prob diff |a - b|: max, mean, std",
                (
                    "rollout_log_probs_diff_max",
                    "rollout_log_probs_diff_mean",
                    "rollout_log_probs_diff_std",
                ),
            ),
        ),
    ),
    (
        "divergence",
        (
            ("KL(rollout || actor): k1, k3", ("rollout_actor_kl_k1", "rollout_actor_kl_k3")),
            ("multiplicative probability error", ("rollout_actor_mult_prob_error",)),
            (
                "importance ratio: mean, min, max",
                ("rollout_is_ratio_mean", "rollout_is_ratio_min", "rollout_is_ratio_max"),
            ),
            (
                "importance ratio: fraction above C, below 1/C",
                ("rollout_is_ratio_frac_high", "rollout_is_ratio_frac_low"),
            ),
            ("importance ratio: chi-square", ("rollout_is_chi2",)),
            ("importance ratio: effective sample size (fraction)", ("rollout_is_ess",)),
        ),
    ),
    (
        "sequences",
        (
            ("perplexity: actor, rollout", ("actor_ppl", "rollout_ppl")),
            (
                "log-perplexity diff: mean, max abs",
                ("rollout_actor_log_ppl_diff", "rollout_actor_log_ppl_abs_diff_max"),
            ),
            (
                "geometric-mean ratio: min, max",
                ("rollout_seq_geo_ratio_min", "rollout_seq_geo_ratio_max"),
            ),
            ("fraction of sequences outside the ratio band", ("rollout_seq_frac_outside",)),
        ),
    ),
    (
        "health",
        (
            ("window has tokens (1) or not (0)", ("rollout_probs_diff_valid",)),
            ("tokens", ("rollout_tokens",)),
            ("sequences", ("rollout_sequences",)),
            ("non-finite tokens dropped", ("rollout_nonfinite_tokens",)),
            ("token-id diffs: count", ("rollout_token_diff_count",)),
            ("token-id diffs: fraction of sequences", ("rollout_token_diff_seq_frac",)),
        ),
    ),
)
"""The custom-scalars dashboard: ``(category, ((chart title, metric names), ...))``."""


def extras_problems(*, histograms: Any, worst_tokens_k: Any, dashboard_layout: Any) -> list[str]:
    """Return what is wrong with the TensorBoard-extras arguments (empty if nothing)."""
    problems = []
    for name, value in (("histograms", histograms), ("dashboard_layout", dashboard_layout)):
        if not isinstance(value, bool):
            problems.append(f"`{name}` must be True or False, got {value!r}.")
    if (
        isinstance(worst_tokens_k, bool)
        or not isinstance(worst_tokens_k, int)
        or worst_tokens_k < 0
    ):
        problems.append(
            f"`worst_tokens_k` must be an int >= 0 (0 turns the table off), got {worst_tokens_k!r}."
        )
    return problems


# ------------------------------------------------------------------------ summaries
@dataclass(frozen=True)
class Histogram:
    """A merged fixed-bin histogram, on the host.

    ``counts[i]`` is the number of values in bin ``i`` of ``edges`` (see
    :data:`HISTOGRAMS` for the convention); ``num`` is their total.
    """

    edges: tuple[float, ...]
    counts: tuple[float, ...]
    num: float
    min: float
    max: float
    sum: float
    sum_squares: float

    def bucket_limits(self) -> list[float]:
        """Upper limit of every bin, as TensorBoard wants it (the last is ``DBL_MAX``)."""
        return [*self.edges, sys.float_info.max]

    def support(self) -> slice:
        """The bins from the first to the last non-empty one (empty if there is none)."""
        filled = [i for i, count in enumerate(self.counts) if count > 0]
        return slice(filled[0], filled[-1] + 1) if filled else slice(0, 0)


@dataclass(frozen=True)
class WorstToken:
    """One of the tokens with the largest ``abs(r)`` of a window.

    ``batch`` is the index of the training batch within the window (0 for the first
    batch after the previous logged step), ``row`` and ``position`` locate the token in
    that batch's ``[B, T]`` tensors, ``token_id`` is ``None`` when the batch had no ids.
    """

    log_ratio: float
    actor_prob: float
    rollout_prob: float
    batch: int
    row: int
    position: int
    token_id: int | None
    rank: int


@dataclass(frozen=True)
class ExtrasSummary:
    """What a window's extras show: its histograms (by tag) and worst tokens, worst first."""

    histograms: dict[str, Histogram]
    worst_tokens: list[WorstToken]


# ------------------------------------------------------------------------ the state
class TokenExtras(ThreadSafeWindow):
    """Histograms and worst tokens of a window of tokens, kept on the batch's device.

    Feed it the same ``[B, T]`` tensors as :class:`~lightning_rollout_debug.MismatchStats`
    with :meth:`update` (from several threads if need be: adding a batch to the window
    holds a lock); :attr:`state` is one packed float64 vector of fixed length
    :attr:`size`, and :meth:`merge_states` merges several (windows, or every rank's) into
    one. :meth:`summary` reads a merged state on the host.

    Args:
        histograms: keep the two fixed-bin histograms of :data:`HISTOGRAMS`.
        worst_tokens_k: keep the ``k`` tokens with the largest ``abs(r)``; 0 keeps none.
        chunk_tokens: rows are processed in chunks of about this many tokens, which
            bounds the temporary memory of an update.
        compile: fuse each chunk's arithmetic with ``torch.compile``, as
            :class:`~lightning_rollout_debug.MismatchStats` does (``None``: for batches of
            at least 65,536 tokens, falling back to eager arithmetic where compilation
            is unavailable).

    Example:
        >>> import torch
        >>> extras = TokenExtras(worst_tokens_k=1)
        >>> rollout = torch.log(torch.tensor([[0.5, 0.25, 0.9]]))
        >>> actor = torch.log(torch.tensor([[0.5, 0.20, 0.9]]))
        >>> extras.update(rollout, actor, torch.tensor([[1, 1, 0]]), batch_index=3)
        >>> summary = extras.summary(extras.state)
        >>> summary.histograms["rollout_log_ratio_hist"].num
        2.0
        >>> worst = summary.worst_tokens[0]
        >>> worst.batch, worst.row, worst.position, round(worst.actor_prob, 6)
        (3, 0, 1, 0.2)
    """

    def __init__(
        self,
        *,
        histograms: bool = True,
        worst_tokens_k: int = 10,
        chunk_tokens: int = 1 << 18,
        compile: bool | None = None,
    ) -> None:
        problems = extras_problems(
            histograms=histograms, worst_tokens_k=worst_tokens_k, dashboard_layout=True
        )
        if not isinstance(chunk_tokens, int) or chunk_tokens < 1:
            problems.append(f"`chunk_tokens` must be a positive int, got {chunk_tokens!r}.")
        problems += compile_problems(compile)
        if problems:
            raise ValueError("Invalid TokenExtras arguments:\n- " + "\n- ".join(problems))
        self.histograms = histograms
        self.worst_tokens_k = worst_tokens_k
        self.chunk_tokens = chunk_tokens
        self.compile = compile
        self._histograms = HISTOGRAMS if histograms else ()
        # Segments of the packed state and how each merges. A histogram is laid out as
        # [bin counts..., num, min, max, sum, sum_squares].
        self._segments: list[tuple[str, int, int]] = []
        offset = 0
        for _, spec in self._histograms:
            bins = len(spec.edges) + 1
            self._segments += [
                ("sum", offset, offset + bins + 1),
                ("min", offset + bins + 1, offset + bins + 2),
                ("max", offset + bins + 2, offset + bins + 3),
                ("sum", offset + bins + 3, offset + bins + 5),
            ]
            offset += bins + len(_MOMENTS)
        self._worst_at = offset
        self.size = offset + worst_tokens_k * _F
        self._state: Tensor | None = None
        self._lock = threading.Lock()

    # ------------------------------------------------------------------ state
    @property
    def state(self) -> Tensor:
        """The packed float64 state vector (the identity when nothing was added)."""
        return self.identity_state() if self._state is None else self._state

    def identity_state(self, device: torch.device | str | None = None) -> Tensor:
        """The packed state of an empty window, built with fill kernels on ``device``."""
        options: dict[str, Any] = {"dtype": torch.float64, "device": device}
        parts = []
        for _, spec in self._histograms:
            parts += [
                torch.zeros(len(spec.edges) + 2, **options),
                torch.full((1,), math.inf, **options),
                torch.full((1,), -math.inf, **options),
                torch.zeros(2, **options),
            ]
        parts.append(self._empty_candidates(self.worst_tokens_k, options).flatten())
        return torch.cat(parts)

    def load_state(self, state: Tensor) -> None:
        """Replace the window with a packed state vector of length :attr:`size`."""
        if state.shape != (self.size,):
            raise ValueError(
                f"A packed extras state has shape ({self.size},); got {tuple(state.shape)}."
            )
        copied = state.detach().to(torch.float64).clone()
        with self._lock:
            self._state = copied

    def reset(self) -> None:
        """Start a new, empty window."""
        with self._lock:
            self._state = None

    def state_problems(self, state: Any, what: str = "the extras window") -> list[str]:
        """Why ``state`` cannot be a packed extras window of real tokens (or ``[]``).

        Bin counts are whole numbers that add up to the histogram's count, extremes and
        sums are no NaN, and every worst-token candidate is a real token or a
        placeholder.
        """
        problems = tensor_problems(state, (self.size,), what)
        if problems:
            return problems
        values = state.tolist()
        offset = 0
        for name, spec in self._histograms:
            bins = len(spec.edges) + 1
            counts = values[offset : offset + bins + 1]  # the bins, then their total
            moments = values[offset + bins + 1 : offset + bins + len(_MOMENTS)]
            offset += bins + len(_MOMENTS)
            if not all(math.isfinite(c) and c >= 0 and c == int(c) for c in counts):
                problems.append(f"the bins of `{name}` in {what} are not whole numbers >= 0")
            elif sum(counts[:-1]) != counts[-1]:
                problems.append(f"the bins of `{name}` in {what} do not add up to its count")
            if any(math.isnan(m) for m in moments) or moments[-1] < 0:
                problems.append(f"the extremes or sums of `{name}` in {what} are not real")
        for start in range(self._worst_at, self.size, _F):
            row = dict(zip(WORST_FIELDS, values[start : start + _F], strict=True))
            if row["abs_log_ratio"] == -math.inf:
                continue  # a placeholder
            labels = [row[name] for name in ("batch", "row", "position", "rank", "token_id")]
            if (
                not all(math.isfinite(v) for v in row.values())
                or row["abs_log_ratio"] < 0
                or not all(v == int(v) for v in labels)
                or min(row["row"], row["position"], row["rank"]) < 0
                or row["token_id"] < -1
            ):
                problems.append(f"a worst-token candidate in {what} is no real token: {row}")
                break
        return problems

    def merge_states(self, states: Tensor) -> Tensor:
        """Merge packed states stacked as ``[n, size]`` into one, on their device.

        Bin counts, counts and sums add, minima and maxima fold, and the ``k`` candidates
        with the largest ``abs(r)`` among all ``n * k`` are kept.
        """
        reduce = {"sum": torch.sum, "min": torch.amin, "max": torch.amax}
        parts = [reduce[kind](states[:, start:stop], 0) for kind, start, stop in self._segments]
        if self.worst_tokens_k:
            candidates = states[:, self._worst_at :].reshape(-1, _F)
            parts.append(_best(candidates, self.worst_tokens_k).flatten())
        return torch.cat(parts) if parts else states.new_zeros(0)

    # ----------------------------------------------------------------- update
    @torch.no_grad()
    def update(
        self,
        rollout_log_probs: Tensor,
        old_log_probs: Tensor,
        mask: Tensor,
        token_ids: Tensor | None = None,
        *,
        batch_index: int = 0,
        rank: int = 0,
    ) -> None:
        """Add one batch to the window.

        Args:
            rollout_log_probs: ``[B, T]`` log-probs the rollout engine recorded (``b``).
            old_log_probs: ``[B, T]`` log-probs the trainer recomputed (``a``).
            mask: ``[B, T]``; a position counts where it is non-zero.
            token_ids: optional ``[B, T]`` integer ids of the sampled tokens, shown in the
                worst-tokens table.
            batch_index: the batch's index within the window, shown in the table.
            rank: the process's rank, shown in the table.

        Raises:
            ValueError: the tensors have the wrong type, rank, shape, dtype or devices.
        """
        inputs = check_inputs(rollout_log_probs, old_log_probs, mask)
        if token_ids is not None:
            check_token_ids(token_ids, token_ids, mask, names=("token_ids", "token_ids", "mask"))
        batch, width = mask.shape
        device = mask.device
        parts = []
        if batch * width > 0:
            rows = max(1, self.chunk_tokens // width)
            # As tensors made by fill kernels (no copy from the host): a compiler would
            # otherwise specialise on every new batch index.
            labels = [
                torch.full((), float(value), dtype=torch.float64, device=device)
                for value in (batch_index, rank)
            ]

            def chunks(state_of: Callable[..., Tensor], fused: bool) -> list[Tensor]:
                return [
                    state_of(
                        self,
                        inputs.rollout_log_probs[start : start + rows],
                        inputs.old_log_probs[start : start + rows],
                        inputs.mask[start : start + rows],
                        None if token_ids is None else token_ids[start : start + rows],
                        start,
                        labels[0],
                        labels[1],
                    )
                    for start in range(0, batch, rows)
                ]

            parts += run_fused(TokenExtras._chunk_state, self.compile, batch * width, chunks)
        with self._lock:
            if self._state is not None:
                parts.insert(0, self._state.to(device))
            if not parts:
                parts.append(self.identity_state(device))
            self._state = parts[0] if len(parts) == 1 else self.merge_states(torch.stack(parts))

    def _chunk_state(
        self,
        rollout_log_probs: Tensor,
        old_log_probs: Tensor,
        mask: Tensor,
        token_ids: Tensor | None,
        first_row: int,
        batch_index: Tensor,
        rank: Tensor,
    ) -> Tensor:
        f64 = torch.float64
        a, b, r, masked, finite = counting_tokens(rollout_log_probs, old_log_probs, mask)
        counting = masked & finite
        parts = []
        if self._histograms:
            keep = counting.flatten()
            weight = keep.to(f64)
            # The same abs(pa - pb) as the statistics; r and the diff are zero where a
            # token does not count.
            values = {
                "rollout_log_ratio_hist": r,
                "rollout_probs_diff_hist": prob_diff(exp(a), exp(b), r),
            }
            for name, spec in self._histograms:
                parts.append(_histogram_state(values[name].flatten(), keep, weight, spec))
        if self.worst_tokens_k:
            parts.append(
                self._candidates(a, b, r, counting, token_ids, first_row, batch_index, rank)
            )
        return torch.cat(parts)

    def _candidates(
        self,
        a: Tensor,
        b: Tensor,
        r: Tensor,
        counting: Tensor,
        token_ids: Tensor | None,
        first_row: int,
        batch_index: Tensor,
        rank: Tensor,
    ) -> Tensor:
        """The chunk's ``k`` tokens with the largest ``abs(r)``, as ``[k * F]`` (no sync)."""
        f64 = torch.float64
        width = r.shape[1]
        key = torch.where(counting, r.abs(), -math.inf).flatten()
        k = min(self.worst_tokens_k, key.numel())
        top = torch.topk(key, k)
        index = top.indices

        def pick(values: Tensor) -> Tensor:
            # A picked token that does not count (fewer counting tokens than k) may hold
            # NaN or inf in `a`: zero it, its key of -inf drops it anyway.
            picked = values.flatten().index_select(0, index).to(f64)
            return torch.where(torch.isfinite(top.values), picked, 0.0)

        options: dict[str, Any] = {"dtype": f64, "device": r.device}
        columns = [
            top.values.to(f64),
            pick(r),
            torch.exp(pick(a)),
            torch.exp(pick(b)),
            batch_index.expand(k),
            (index // width + first_row).to(f64),
            (index % width).to(f64),
            torch.full((k,), -1.0, **options) if token_ids is None else pick(token_ids),
            rank.expand(k),
        ]
        found = torch.stack(columns, dim=1)
        missing = self.worst_tokens_k - k
        if missing:
            found = torch.cat([found, self._empty_candidates(missing, options)])
        return found.flatten()

    @staticmethod
    def _empty_candidates(count: int, options: dict[str, Any]) -> Tensor:
        """``count`` placeholder candidates that lose against any token."""
        return torch.cat(
            [
                torch.full((count, 1), -math.inf, **options),
                torch.zeros((count, _F - 3), **options),
                torch.full((count, 1), -1.0, **options),
                torch.zeros((count, 1), **options),
            ],
            dim=1,
        )

    # --------------------------------------------------------------- summary
    def summary(self, state: Tensor | Sequence[float]) -> ExtrasSummary:
        """Read a (merged) packed state: histograms by tag and worst tokens, worst first.

        Give it a host tensor or a list: reading a device tensor copies it to the host.
        """
        values = state.tolist() if isinstance(state, Tensor) else list(state)
        if len(values) != self.size:
            raise ValueError(f"A packed extras state has {self.size} values; got {len(values)}.")
        histograms = {}
        offset = 0
        for name, spec in self._histograms:
            edges = spec.edges
            bins = len(edges) + 1
            moments = values[offset + bins : offset + bins + len(_MOMENTS)]
            histograms[name] = Histogram(edges, tuple(values[offset : offset + bins]), *moments)
            offset += bins + len(_MOMENTS)
        worst = []
        for start in range(self._worst_at, self.size, _F):
            row = dict(zip(WORST_FIELDS, values[start : start + _F], strict=True))
            if row["abs_log_ratio"] == -math.inf:
                continue
            worst.append(
                WorstToken(
                    log_ratio=row["log_ratio"],
                    actor_prob=row["actor_prob"],
                    rollout_prob=row["rollout_prob"],
                    batch=int(row["batch"]),
                    row=int(row["row"]),
                    position=int(row["position"]),
                    token_id=None if row["token_id"] < 0 else int(row["token_id"]),
                    rank=int(row["rank"]),
                )
            )
        return ExtrasSummary(histograms, worst)


def _histogram_state(
    values: Tensor, keep: Tensor, weight: Tensor, bins: QuarterOctaveBins
) -> Tensor:
    """``[bin counts..., num, min, max, sum, sum_squares]`` of ``values`` where ``keep``.

    ``values`` (float32 or float64) must be zero where ``keep`` is false, so plain sums
    skip those tokens; ``weight`` is ``keep`` as float64.
    """
    counts = torch.zeros(len(bins.edges) + 1, dtype=torch.float64, device=values.device)
    counts.scatter_add_(0, bins.index(values), weight)
    exact = values.to(torch.float64)
    moments = [
        weight.sum(),
        torch.where(keep, values, math.inf).amin().to(torch.float64),
        torch.where(keep, values, -math.inf).amax().to(torch.float64),
        exact.sum(),
        torch.dot(exact, exact),
    ]
    return torch.cat([counts, torch.stack(moments)])


def _best(candidates: Tensor, k: int) -> Tensor:
    """The ``k`` rows of ``[n, F]`` candidates with the largest key, largest first."""
    return candidates.index_select(0, torch.topk(candidates[:, 0], k).indices)


def token_ids_for(ids: Any, mask: Tensor) -> Tensor | None:
    """``ids`` if it is an integer ``[B, T]`` tensor matching ``mask``, else ``None``."""
    if (
        isinstance(ids, Tensor)
        and ids.dtype in TOKEN_ID_DTYPES
        and ids.shape == mask.shape
        and ids.device == mask.device
    ):
        return ids
    return None


# ------------------------------------------------------------------------ writers
def write_extras(
    writer: Any, prefix: str, summary: ExtrasSummary, step: int, *, show_rank: bool = False
) -> None:
    """Write a window's histograms and worst-tokens table with a ``SummaryWriter``.

    A histogram is written from its first to its last non-empty bin (``bucket_limit`` is
    a contiguous run of the fixed edges, then ``DBL_MAX`` if the overflow bin is
    included). Nothing is written for an empty window.
    """
    for name, histogram in summary.histograms.items():
        if histogram.num < 1:
            continue
        # Only the bins from the first to the last non-empty one, as TensorFlow's own
        # histograms do: TensorBoard draws the x axis over the buckets it is given.
        support = histogram.support()
        writer.add_histogram_raw(
            tag=f"{prefix}{name}",
            min=histogram.min,
            max=histogram.max,
            num=int(histogram.num),
            sum=histogram.sum,
            sum_squares=histogram.sum_squares,
            bucket_limits=histogram.bucket_limits()[support],
            bucket_counts=list(histogram.counts[support]),
            global_step=step,
        )
    if summary.worst_tokens:
        table = worst_tokens_markdown(summary.worst_tokens, show_rank=show_rank)
        writer.add_text(f"{prefix}{WORST_TOKENS_TAG}", f"{WORST_TOKENS_CAPTION}\n\n{table}", step)


def worst_tokens_markdown(tokens: Sequence[WorstToken], *, show_rank: bool = False) -> str:
    """A Markdown table of the worst tokens (TensorBoard's text plugin renders it).

    The token column appears when any token has an id, the rank column with ``show_rank``.

    Example:
        >>> token = WorstToken(-0.223144, 0.2, 0.25, batch=0, row=1, position=7, token_id=42,
        ...                    rank=0)
        >>> print(worst_tokens_markdown([token]))
        | # | batch | row | position | token | rollout prob | actor prob | r = log(actor/rollout) |
        |---:|---:|---:|---:|---:|---:|---:|---:|
        | 1 | 0 | 1 | 7 | 42 | 0.25 | 0.2 | -0.223144 |
    """
    show_token = any(token.token_id is not None for token in tokens)
    header = ["#", *(["rank"] if show_rank else []), "batch", "row", "position"]
    header += [*(["token"] if show_token else []), "rollout prob", "actor prob"]
    header.append("r = log(actor/rollout)")
    lines = ["| " + " | ".join(header) + " |", "|" + "---:|" * len(header)]
    for number, token in enumerate(tokens, start=1):
        cells = [str(number), *([str(token.rank)] if show_rank else [])]
        cells += [str(token.batch), str(token.row), str(token.position)]
        if show_token:
            cells.append("-" if token.token_id is None else str(token.token_id))
        cells += [f"{token.rollout_prob:.6g}", f"{token.actor_prob:.6g}", f"{token.log_ratio:.6g}"]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def dashboard_layout(prefix: str, names: Collection[str]) -> dict[str, dict[str, list[Any]]]:
    """The custom-scalars layout of :data:`DASHBOARD` for ``SummaryWriter.add_custom_scalars``.

    Only metrics in ``names`` (un-prefixed) appear; empty charts and categories are left
    out. Chart tags are anchored regular expressions of the prefixed names.

    Example:
        >>> dashboard_layout("training/", ["rollout_actor_kl_k1", "rollout_actor_kl_k3"])
        {'training/divergence': {'KL(rollout || actor): k1, k3': ['Multiline', ['^training/rollout_actor_kl_k1$', '^training/rollout_actor_kl_k3$']]}}
    """  # noqa: E501
    layout: dict[str, dict[str, list[Any]]] = {}
    for category, charts in DASHBOARD:
        content = {
            title: ["Multiline", [f"^{re.escape(prefix + name)}$" for name in chart]]
            for title, metrics in charts
            if (chart := [name for name in metrics if name in names])
        }
        if content:
            layout[f"{prefix}{category}"] = content
    return layout
