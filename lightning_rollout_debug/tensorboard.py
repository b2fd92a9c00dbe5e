"""TensorBoard writers: the extras' histograms and worst tokens, and the dashboard layout.

The scalars reach TensorBoard through the Lightning loggers; what only a
``SummaryWriter`` can show is written here, from a window's host summary
(:class:`~lightning_rollout_debug.extras.ExtrasSummary`): histograms with the fixed bins
of :mod:`.extras`, a markdown table of the worst tokens, and the custom-scalars layout
of the catalog's :data:`~lightning_rollout_debug.catalog.DASHBOARD`.
"""

from __future__ import annotations

import re
from collections.abc import Collection, Sequence
from typing import Any

from lightning_rollout_debug.catalog import DASHBOARD
from lightning_rollout_debug.extras import ExtrasSummary, WorstToken

WORST_TOKENS_TAG = "rollout_worst_tokens"
"""Un-prefixed TensorBoard tag of the worst-tokens table."""

WORST_TOKENS_CAPTION = (
    "The window's tokens with the largest |r| = |log(actor prob / rollout prob)|. *batch*: "
    "index of the training batch within the window (0 = first batch after the previous "
    "logged step); *row*, *position*: the token's place in that batch's [B, T] tensors."
)
"""First paragraph of the worst-tokens text, above the table."""


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
