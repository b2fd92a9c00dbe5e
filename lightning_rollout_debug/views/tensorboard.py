"""TensorBoard writers: the extras' histograms, worst tokens and profile pictures, the layout.

The scalars reach TensorBoard through each Lightning logger's ``log_metrics``
(:func:`log_scalars`); what only a ``SummaryWriter`` can show is written here with its
public methods, from a window's host summary
(:class:`~lightning_rollout_debug.metrics.extras.ExtrasSummary`): histograms with the
fixed bins of :mod:`~lightning_rollout_debug.metrics.extras` (``add_histogram_raw``), a
markdown table of the worst tokens (``add_text``; with a tokenizer their text, from
:mod:`.token_text`), the pictures of the profile
(:mod:`.pictures`, ``add_image``), and the custom-scalars layout of the catalog's
:data:`~lightning_rollout_debug.metrics.catalog.DASHBOARD`.
"""

from __future__ import annotations

import re
import weakref
from collections.abc import Collection, Mapping, Sequence
from typing import Any

import torch

from lightning_rollout_debug.metrics.catalog import DASHBOARD
from lightning_rollout_debug.metrics.extras import ExtrasSummary, TokenExtras
from lightning_rollout_debug.metrics.profile import Profile
from lightning_rollout_debug.metrics.worst_tokens import CONTEXT_TOKENS, WorstToken
from lightning_rollout_debug.views.pictures import PICTURES, profile_pictures
from lightning_rollout_debug.views.token_text import TokenText, markdown_cell

WORST_TOKENS_TAG = "rollout_worst_tokens"
"""Un-prefixed TensorBoard tag of the worst-tokens table."""

WORST_TOKENS_CAPTION = (
    "The window's tokens with the largest |r| = |log(actor prob / rollout prob)|. *batch*: "
    "index of the training batch within the window (0 = first batch after the previous "
    "logged step); *row*, *position*: the token's place in that batch's [B, T] tensors."
)
"""First paragraph of the worst-tokens text, above the table."""

TEXT_CAPTION = (
    f"*context*: the text of up to {CONTEXT_TOKENS} tokens before the token in its row; "
    "*text*: the token's own. ␣ is a space, ↵ a newline, → a tab, ⟨id⟩ a token without "
    "text of its own."
)
"""The worst-tokens text's paragraph on the text columns, when they are shown."""

SEGMENT_CAPTION = (
    "*segment*: the segment (turn, data source, task: the batch's segment labels) the "
    "token counts in."
)
"""The worst-tokens text's sentence on the segment column, when it is shown."""

PROFILE_IMAGE_TAG = "rollout_profile"
"""Un-prefixed TensorBoard tag group of the profile pictures."""

PROFILE_IMAGE_TAGS: tuple[str, ...] = tuple(f"{PROFILE_IMAGE_TAG}/{name}" for name, _ in PICTURES)
"""Un-prefixed TensorBoard tags of the profile pictures: ``rollout_profile/by_position``,
``rollout_profile/by_probability`` and ``rollout_profile/joint``."""

PROFILE_IMAGES_EVERY_N_STEPS = 50
"""Default spacing of the profile pictures: they are drawn at the first logged step of each
span of this many steps (``[0, 50)``, ``[50, 100)``, ...), so at every logged step when
logging every 50 steps or less often. A set costs a few milliseconds (drawing and PNG,
some 20 KB); TensorBoard shows 10 images per tag unless started with
``--samples_per_plugin images=N``."""


def write_extras(
    writer: Any,
    prefix: str,
    summary: ExtrasSummary,
    step: int,
    *,
    show_rank: bool = False,
    token_text: TokenText | None = None,
    segment_names: Sequence[str] = (),
) -> None:
    """Write a window's histograms and worst-tokens table with a ``SummaryWriter``.

    A histogram is written from its first to its last non-empty bin (``bucket_limit`` is
    a contiguous run of the fixed edges, then ``DBL_MAX`` if the overflow bin is
    included). With ``token_text``, the table shows the tokens' text; ``segment_names``
    names the tokens' segments (:func:`worst_tokens_markdown`). Nothing is written for an
    empty window.
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
        tokens = summary.worst_tokens
        table = worst_tokens_markdown(
            tokens, show_rank=show_rank, token_text=token_text, segment_names=segment_names
        )
        caption = [WORST_TOKENS_CAPTION]
        if any(token.segment is not None for token in tokens):
            caption.append(SEGMENT_CAPTION)
        if token_text is not None and any(token.token_id is not None for token in tokens):
            caption.append(TEXT_CAPTION)
        writer.add_text(f"{prefix}{WORST_TOKENS_TAG}", f"{' '.join(caption)}\n\n{table}", step)


def logger_prefix(logger: Any) -> str:
    """What a Lightning logger puts in front of every metric name: its ``prefix`` and join.

    Example:
        >>> from pytorch_lightning.loggers import TensorBoardLogger
        >>> logger_prefix(TensorBoardLogger("logs", prefix="rl")), logger_prefix(object())
        ('rl-', '')
    """
    prefix = getattr(logger, "_prefix", None)
    if not prefix or not isinstance(prefix, str):
        return ""
    return f"{prefix}{getattr(logger, 'LOGGER_JOIN_CHAR', '-')}"


def log_scalars(logger: Any, scalars: Mapping[str, float], step: int) -> None:
    """Log ``scalars`` at ``step`` with ``logger``'s ``log_metrics`` (its prefix its own).

    Example:
        >>> import tempfile
        >>> from pytorch_lightning.loggers import TensorBoardLogger
        >>> from tensorboard.backend.event_processing.event_accumulator import (
        ...     EventAccumulator)
        >>> with tempfile.TemporaryDirectory() as logdir:
        ...     logger = TensorBoardLogger(logdir, name="run", version=0)
        ...     log_scalars(logger, {"training/a": 0.25, "training/b": 2.0}, step=3)
        ...     logger.finalize("success")
        ...     events = EventAccumulator(logger.log_dir)
        ...     _ = events.Reload()
        ...     [(s.step, s.value) for s in events.Scalars("training/a")]
        [(3, 0.25)]
    """
    logger.log_metrics(dict(scalars), step=step)


def write_profile(writer: Any, prefix: str, profile: Profile | None, step: int) -> None:
    """Write a window's profile pictures (:mod:`.pictures`) with a ``SummaryWriter``.

    Each picture goes to ``writer.add_image`` under ``{prefix}rollout_profile/{name}``
    (:data:`PROFILE_IMAGE_TAGS`) as an ``HEIGHT x WIDTH x 3`` RGB array, which the writer
    encodes as a PNG with Pillow. Nothing is written for an empty window (or without a
    profile).

    Example:
        >>> import tempfile
        >>> import torch
        >>> from torch.utils.tensorboard import SummaryWriter
        >>> from lightning_rollout_debug.metrics.extras import TokenExtras
        >>> extras = TokenExtras(histograms=False, worst_tokens_k=0, profile=True,
        ...                      compile=False)
        >>> old = torch.log(torch.rand(4, 64, generator=torch.Generator().manual_seed(0)))
        >>> extras.update(old + 0.01, old, torch.ones(4, 64))
        >>> with tempfile.TemporaryDirectory() as logdir:
        ...     writer = SummaryWriter(logdir)
        ...     write_profile(writer, "training/", extras.summary(extras.state).profile, 3)
        ...     writer.close()
        >>> PROFILE_IMAGE_TAGS
        ('rollout_profile/by_position', 'rollout_profile/by_probability', 'rollout_profile/joint')
    """
    for name, picture in profile_pictures(profile).items():
        writer.add_image(f"{prefix}{PROFILE_IMAGE_TAG}/{name}", picture, step, dataformats="HWC")


def prepare_pictures() -> None:
    """Draw a small made-up window's pictures once, and drop them.

    What every picture holds whatever its data (the font, titles, legends, axis names,
    frames) is drawn then and kept, not at the first logged step: the callback calls it
    at the Trainer's ``setup``, so that the first training step costs what a later one
    does. Tens of milliseconds, once per process.

    Example:
        >>> prepare_pictures()
    """
    extras = TokenExtras(histograms=False, worst_tokens_k=0, profile=True, compile=False)
    old = -torch.linspace(1e-3, 12.0, 256).reshape(4, 64)
    extras.update(old - 0.01, old, torch.ones(4, 64))
    profile_pictures(extras.summary(extras.state).profile)


def worst_tokens_markdown(
    tokens: Sequence[WorstToken],
    *,
    show_rank: bool = False,
    token_text: TokenText | None = None,
    segment_names: Sequence[str] = (),
) -> str:
    """A Markdown table of the worst tokens (TensorBoard's text plugin renders it).

    The token column appears when any token has an id, the rank column with ``show_rank``;
    with ``token_text`` and ids, the text of each token (aligned left) and of its context
    (aligned right, so that the two read on; :meth:`TokenText.cells`). The segment column
    appears when any token has a segment: ``segment_names[i]`` names segment ``i`` (the
    names of every segment by index, ``other`` last), the number where it has no name.

    Example:
        >>> token = WorstToken(-0.223144, 0.2, 0.25, batch=0, row=1, position=7, token_id=42,
        ...                    rank=0)
        >>> print(worst_tokens_markdown([token]))
        | # | batch | row | position | token | rollout prob | actor prob | r = log(actor/rollout) |
        |---:|---:|---:|---:|---:|---:|---:|---:|
        | 1 | 0 | 1 | 7 | 42 | 0.25 | 0.2 | -0.223144 |
        >>> from tokenizers import Tokenizer, models
        >>> vocab = {"[UNK]": 0, "the": 40, "mat": 42}
        >>> words = TokenText(Tokenizer(models.WordLevel(vocab, unk_token="[UNK]")))
        >>> token = WorstToken(-0.223144, 0.2, 0.25, batch=0, row=1, position=7, token_id=42,
        ...                    rank=0, context=(40,))
        >>> print(worst_tokens_markdown([token], token_text=words).splitlines()[2])
        | 1 | 0 | 1 | 7 | 42 | the | ␣mat | 0.25 | 0.2 | -0.223144 |
        >>> token = WorstToken(-0.223144, 0.2, 0.25, batch=0, row=1, position=7, token_id=None,
        ...                    rank=0, segment=2)
        >>> print(worst_tokens_markdown([token], segment_names=("math", "code", "other")))
        | # | batch | row | position | segment | rollout prob | actor prob | r = log(actor/rollout) |
        |---:|---:|---:|---:|---:|---:|---:|---:|
        | 1 | 0 | 1 | 7 | other | 0.25 | 0.2 | -0.223144 |
    """  # noqa: E501
    show_token = any(token.token_id is not None for token in tokens)
    show_text = show_token and token_text is not None
    show_segment = any(token.segment is not None for token in tokens)
    header = ["#", *(["rank"] if show_rank else []), "batch", "row", "position"]
    header += [*(["segment"] if show_segment else []), *(["token"] if show_token else [])]
    header += ["context", "text"] if show_text else []
    header += ["rollout prob", "actor prob", "r = log(actor/rollout)"]
    aligned = "".join(":---|" if name == "text" else "---:|" for name in header)
    lines = ["| " + " | ".join(header) + " |", "|" + aligned]
    for number, token in enumerate(tokens, start=1):
        cells = [str(number), *([str(token.rank)] if show_rank else [])]
        cells += [str(token.batch), str(token.row), str(token.position)]
        if show_segment:
            cells.append(_segment_cell(token.segment, segment_names))
        if show_token:
            cells.append("-" if token.token_id is None else str(token.token_id))
        if show_text and token_text is not None:
            cells += _text_cells(token, token_text)
        cells += [f"{token.rollout_prob:.6g}", f"{token.actor_prob:.6g}", f"{token.log_ratio:.6g}"]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _segment_cell(segment: int | None, names: Sequence[str]) -> str:
    """The name of segment ``segment`` (its number where ``names`` has none; ``-`` if none)."""
    if segment is None:
        return "-"
    return markdown_cell(names[segment]) if 0 <= segment < len(names) else str(segment)


def _text_cells(token: WorstToken, token_text: TokenText) -> tuple[str, str]:
    """The context and text cells of ``token`` (none without its id)."""
    if token.token_id is None:
        return "", "-"
    return token_text.cells(token.context, token.token_id)


DashboardLayout = dict[str, dict[str, list[Any]]]
"""A custom-scalars layout as ``SummaryWriter.add_custom_scalars`` takes it."""


SEGMENTS_CATEGORY = "segments"
"""The dashboard's category of the segments' charts, and the tags' part before a segment's
name (``{prefix}segments/{name}/{metric}``)."""


def dashboard_layout(
    prefix: str, names: Collection[str], segment_metrics: Sequence[str] = ()
) -> DashboardLayout:
    """The custom-scalars layout of :data:`DASHBOARD` for ``SummaryWriter.add_custom_scalars``.

    Only metrics in ``names`` (un-prefixed) appear; empty charts and categories are left
    out. Chart tags are anchored regular expressions of the prefixed names. With
    ``segment_metrics``, a last category, ``segments``, charts each of them with every
    segment as a series (the tags ``{prefix}segments/{name}/{metric}`` of any name).

    Example:
        >>> dashboard_layout("training/", ["rollout_actor_kl_k1", "rollout_actor_kl_k3"])
        {'training/divergence': {'KL(rollout || actor): k1, k3': ['Multiline', ['^training/rollout_actor_kl_k1$', '^training/rollout_actor_kl_k3$']]}}
        >>> dashboard_layout("training/", [], ["rollout_actor_kl_k3"])
        {'training/segments': {'rollout_actor_kl_k3 by segment': ['Multiline', ['^training/segments/[^/]+/rollout_actor_kl_k3$']]}}
    """  # noqa: E501
    layout: DashboardLayout = {}
    for category, charts in DASHBOARD:
        content = {
            title: ["Multiline", [f"^{re.escape(prefix + name)}$" for name in chart]]
            for title, metrics in charts
            if (chart := [name for name in metrics if name in names])
        }
        if content:
            layout[f"{prefix}{category}"] = content
    if segment_metrics:
        segments = f"^{re.escape(f'{prefix}{SEGMENTS_CATEGORY}/')}[^/]+/"
        layout[f"{prefix}{SEGMENTS_CATEGORY}"] = {
            f"{metric} by segment": ["Multiline", [f"{segments}{re.escape(metric)}$"]]
            for metric in segment_metrics
        }
    return layout


_WRITTEN_LAYOUTS: weakref.WeakKeyDictionary[Any, DashboardLayout] = weakref.WeakKeyDictionary()


def write_layout(writer: Any, layout: DashboardLayout) -> None:
    """Write ``layout`` to ``writer``'s run, with what this process wrote there before.

    TensorBoard's custom-scalars page reads one layout per run, the last one written: so
    that callbacks or monitors with different prefixes sharing one run each keep their
    dashboard, every write holds the categories of all of them so far.
    """
    merged = _WRITTEN_LAYOUTS.setdefault(writer, {})
    merged.update(layout)
    writer.add_custom_scalars(merged)
