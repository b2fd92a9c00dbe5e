"""The joint picture of a profile: a heatmap of tokens by rollout and trainer probability.

:func:`joint_picture` draws ``log(1 + count)`` of the profile's joint histogram over
(rollout probability, trainer probability) bins, ``p = 1`` at the top right, with the
diagonal where the two agree, a viridis colour bar and the shares of tokens on, above and
below the diagonal. The cells are laid out by :func:`joint_shown_bins` and
:func:`joint_cell_box`; it is drawn on the canvas of :mod:`.canvas`. An empty profile (no
token counted) has no picture: ``None``.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence

import numpy as np
from PIL import Image, ImageDraw

from lightning_rollout_debug.metrics.profile import JOINT_EDGES, Profile
from lightning_rollout_debug.metrics.tokens import LOG_PROB_FLOOR
from lightning_rollout_debug.views.canvas import (
    DIAGONAL_COLOUR,
    FRAME_COLOUR,
    HEAT_INKS,
    HEAT_SHADES,
    INK,
    LABEL_SIZE,
    MUTED_COLOUR,
    TITLE_SIZE,
    VIRIDIS_START,
    WIDTH,
    blank_image,
    count_label,
    index_image,
    probability_label,
    put_text,
    rgb_array,
)

# Heatmap: one square cell of JOINT_CELL_PX per bin, from the bin of the log-prob floor up.
JOINT_CELL_PX = 4
"""Side of a heatmap cell, in pixels."""

_JOINT_LEFT, _JOINT_TOP = 62, 32

_SHARE_NAMES = ("tokens", "same bin", "pa > pb", "pa < pb")
"""The names of the rows of shares beside the heatmap, on its frame (:func:`_joint_frame`)."""

_JOINT_TICKS = (1e-8, 1e-4, 0.01, 0.1, 0.5, 0.9, 0.99, 0.999)
_JOINT_X_TICKS = (1e-8, 0.01, 0.5, 0.9, 0.99, 0.999)


def joint_shown_bins(edges: Sequence[float]) -> range:
    """The joint bins a heatmap shows: from the one holding the log-prob floor to the top.

    Example:
        >>> joint_shown_bins((-32.0, -28.0, -24.0, -20.0, -16.0, -1.0))
        range(3, 7)
    """
    first = next((i for i, edge in enumerate(edges) if edge >= LOG_PROB_FLOOR), len(edges))
    return range(first, len(edges) + 1)


def joint_cell_box(
    edges: Sequence[float], trainer_bin: int, rollout_bin: int
) -> tuple[int, int, int, int]:
    """The pixels ``(left, top, right, bottom)`` (right and bottom excluded) of a heatmap cell.

    Rows are trainer bins, highest probability at the top; columns are rollout bins,
    highest probability at the right.

    Example:
        >>> edges = (-32.0, -28.0, -24.0, -20.0, -16.0, -1.0)
        >>> joint_cell_box(edges, 6, 3)  # the top left cell
        (62, 32, 66, 36)
    """
    shown = joint_shown_bins(edges)
    column, row = rollout_bin - shown.start, shown.stop - 1 - trainer_bin
    left, top = _JOINT_LEFT + column * JOINT_CELL_PX, _JOINT_TOP + row * JOINT_CELL_PX
    return left, top, left + JOINT_CELL_PX, top + JOINT_CELL_PX


def _joint_coordinate(edges: Sequence[float], p: float) -> float:
    """Where probability ``p`` lies on a heatmap axis, in cells from the bottom (left) edge.

    Bins are of ``-log p``; between two edges the position is linear in ``log2(-log p)``.
    """
    shown = joint_shown_bins(edges)
    # Edge k ends bin k, at k + 1 cells from the bottom; log2(-edge) descends with k.
    magnitudes = np.log2(-np.asarray(edges, dtype=np.float64))
    ends = np.arange(1, len(edges) + 1, dtype=np.float64)
    where = float(np.interp(math.log2(-math.log(p)), magnitudes[::-1], ends[::-1]))
    return where - shown.start


def _colour_bar(image: Image.Image, draw: ImageDraw.ImageDraw, left: int, side: int) -> None:
    """A vertical viridis bar (the fullest cell at the top), framed.

    It ends level with the bottom of the heatmap (of ``side`` pixels), below its label;
    :func:`_colour_bar_marks` puts the counts beside it.
    """
    top, bottom = _JOINT_TOP + 20, _JOINT_TOP + side
    ramp = VIRIDIS_START + np.linspace(HEAT_SHADES - 1, 0, bottom - top).round().astype(np.uint8)
    image.paste(index_image(np.repeat(ramp[:, None], 10, 1)), (left, top))
    draw.rectangle([(left - 1, top - 1), (left + 10, bottom)], outline=INK[FRAME_COLOUR])


def _colour_bar_marks(
    image: Image.Image, draw: ImageDraw.ImageDraw, left: int, side: int, most: float
) -> None:
    """The counts on the colour bar from 0 to ``most``, on the ``log(1 + count)`` scale."""
    top, bottom = _JOINT_TOP + 20, _JOINT_TOP + side
    height = bottom - top
    scale = math.log1p(most)
    marks = [1.0]
    while marks[-1] * 10 <= most:
        marks.append(marks[-1] * 10)
    if most / marks[-1] >= 2:
        marks.append(most)
    free_above = bottom + 10.0
    for count in marks:
        y = bottom - math.log1p(count) / scale * height
        if y + 6 > free_above:
            continue
        draw.line([(left + 10, round(y)), (left + 13, round(y))], fill=INK[FRAME_COLOUR])
        put_text(image, count_label(count), left + 16, y, anchor="lm")
        free_above = y - 6


def joint_picture(profile: Profile) -> np.ndarray | None:
    """A heatmap of ``log(1 + count)`` over (rollout, trainer) probability bins.

    x is the rollout probability ``pb``, y the trainer probability ``pa``, ``p = 1`` at the
    top right, four bins per octave of ``-log p`` (fine near 1, coarse near 0); the cells
    on the diagonal hold the tokens whose probabilities agree to the bin. Empty cells are
    white, the others viridis from dark (one token) to yellow (the fullest cell). On the
    right: the share of tokens on the diagonal, above it and below it. ``None`` for an
    empty profile.

    Example:
        >>> import torch
        >>> from lightning_rollout_debug.metrics.extras import TokenExtras
        >>> extras = TokenExtras(histograms=False, worst_tokens_k=0, profile=True,
        ...                      compile=False)
        >>> old = torch.log(torch.rand(4, 64, generator=torch.Generator().manual_seed(0)))
        >>> extras.update(old, old, torch.ones(4, 64))
        >>> joint_picture(extras.summary(extras.state).profile).shape
        (320, 480, 3)
    """
    return rgb_array(joint_image(profile))


def joint_image(profile: Profile) -> Image.Image | None:
    """The joint picture as a "P" image with the whole palette; ``None`` for an empty profile."""
    if profile.tokens < 1:
        return None
    counts = profile.joint_counts
    shown = joint_shown_bins(JOINT_EDGES)
    cells = counts[shown.start :, shown.start :][::-1]  # top row: the highest trainer bin
    side = len(shown) * JOINT_CELL_PX

    most = max(float(counts.max()), 1.0)
    # Index into HEAT_INKS: 0 for an empty cell, 1 (one token) to HEAT_SHADES (the fullest).
    shade = np.rint(np.log1p(cells) * ((HEAT_SHADES - 1) / math.log1p(most))).astype(np.intp) + 1
    shade[cells <= 0] = 0
    heat = index_image(HEAT_INKS[shade]).resize((side, side), Image.Resampling.NEAREST)
    # The diagonal, faint, through the empty cells on it.
    on_diagonal = ImageDraw.Draw(heat)
    for k in np.flatnonzero(np.diagonal(counts[shown.start :, shown.start :]) <= 0).tolist():
        x, y = k * JOINT_CELL_PX, side - 1 - k * JOINT_CELL_PX
        on_diagonal.line(
            [(x, y), (x + JOINT_CELL_PX - 1, y - JOINT_CELL_PX + 1)], INK[DIAGONAL_COLOUR]
        )

    image = _joint_frame(JOINT_EDGES).copy()
    draw = ImageDraw.Draw(image)
    image.paste(heat, (_JOINT_LEFT, _JOINT_TOP))
    right = _JOINT_LEFT + side
    top = _JOINT_TOP
    _colour_bar_marks(image, draw, right + 16, side, most)

    total = float(counts.sum())
    shares = (
        count_label(total),
        f"{np.trace(counts) / total:.1%}",
        f"{np.tril(counts, -1).sum() / total:.1%}",
        f"{np.triu(counts, 1).sum() / total:.1%}",
    )
    for k, value in enumerate(shares):
        put_text(image, value, WIDTH - 10, top + 8 + 18 * k, anchor="rm")
    return image


@functools.lru_cache(maxsize=4)
def _joint_frame(edges: tuple[float, ...]) -> Image.Image:
    """What a heatmap over these bins holds whatever its counts, drawn once.

    The frame, the title, the ticks, the axis labels, the colour bar and the names of the
    shares. Not to be drawn on: :func:`joint_image` draws on a copy.
    """
    side = len(joint_shown_bins(edges)) * JOINT_CELL_PX
    image = blank_image()
    draw = ImageDraw.Draw(image)
    left, top = _JOINT_LEFT, _JOINT_TOP
    right, bottom = left + side, top + side
    draw.rectangle([(left - 1, top - 1), (right, bottom)], outline=INK[FRAME_COLOUR])
    _colour_bar(image, draw, right + 16, side)
    put_text(
        image,
        "Tokens by trainer and rollout probability: log(1 + count)",
        8,
        15,
        size=TITLE_SIZE,
        anchor="lm",
    )
    for p in _JOINT_TICKS:
        at = _joint_coordinate(edges, p) * JOINT_CELL_PX
        y = round(bottom - at)
        draw.line([(left - 4, y), (left - 1, y)], fill=INK[FRAME_COLOUR])
        put_text(image, probability_label(p), left - 6, y, anchor="rm")
        if p in _JOINT_X_TICKS:
            x = round(left + at)
            draw.line([(x, bottom), (x, bottom + 3)], fill=INK[FRAME_COLOUR])
            put_text(image, probability_label(p), x, bottom + 4, anchor="mt")
    put_text(
        image,
        "rollout probability pb",
        (left + right) / 2,
        bottom + 21,
        size=LABEL_SIZE,
        anchor="mt",
    )
    put_text(
        image,
        "trainer probability pa",
        6,
        (top + bottom) / 2,
        size=LABEL_SIZE,
        anchor="lm",
        rotate=True,
    )
    put_text(image, "tokens", right + 15, top, anchor="lt", colour=MUTED_COLOUR)
    x = right + 72
    for k, name in enumerate(_SHARE_NAMES):
        put_text(image, name, x, top + 8 + 18 * k, anchor="lm", colour=MUTED_COLOUR)
    put_text(image, "pa > pb: above the", x, top + 86, anchor="lm", colour=MUTED_COLOUR)
    put_text(image, "diagonal (trainer", x, top + 100, anchor="lm", colour=MUTED_COLOUR)
    put_text(image, "more confident)", x, top + 114, anchor="lm", colour=MUTED_COLOUR)
    return image
