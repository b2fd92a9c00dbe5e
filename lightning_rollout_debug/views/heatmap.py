"""The joint picture of a profile: a heatmap of tokens by rollout and trainer probability.

:func:`joint_picture` draws ``log(1 + count)`` of the profile's joint histogram over
(rollout probability, trainer probability) bins, ``p = 1`` at the top right, with the
diagonal where the two agree, a viridis colour bar and the shares of tokens on, above and
below the diagonal. Both axes show the same bins: the occupied ones and one more on
either side (:func:`joint_shown_bins`), in square cells as large as fit
(:func:`joint_cell_box`). It is drawn on the canvas of :mod:`.canvas`. An empty profile
(no token counted) has no picture: ``None``.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Sequence

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
    RULE_PX,
    TICK_SIZE,
    TITLE_SIZE,
    VIRIDIS_START,
    WIDTH,
    blank_image,
    count_label,
    index_image,
    probability_label,
    put_caption,
    put_text,
    rgb_array,
    text_size,
)

_JOINT_LEFT, _JOINT_TOP, _JOINT_SIDE = 110, 54, 312
"""The heatmap's top left corner and the most pixels a side of it takes."""

_BAR_TOP = _JOINT_TOP + 36
_SHARES_LEFT, _SHARES_STEP = 560, 32

JOINT_CAPTION = ("pa, pb: trainer and rollout probability; cells: 4 per doubling of -log p",)
"""The caption of :func:`joint_picture`."""

_SHARE_NAMES = ("tokens", "same cell", "pa > pb", "pa < pb")
"""The names of the rows of shares beside the heatmap, on its frame (:func:`_joint_frame`)."""

_SHARE_NOTE = ("pa > pb: above the", "diagonal, the trainer", "more confident")

# Tick probabilities, those earlier in the list first where two would run into each other.
_JOINT_TICKS = (1e-8, 1e-4, 0.01, 0.1, 0.5, 0.9, 0.99, 0.999)
_MORE_TICKS = (1e-6, 1e-3, 0.05, 0.2, 0.3, 0.7, 0.8, 0.95, 0.995)


def joint_shown_bins(counts: np.ndarray, edges: Sequence[float] = JOINT_EDGES) -> range:
    """The joint bins a heatmap shows on both axes: the occupied ones and one either side.

    From one below the lowest occupied bin to one above the highest, none below the bin of
    the log-prob floor; without a token, every bin from the floor's up. ``counts`` is
    ``[trainer bin, rollout bin]`` over ``len(edges) + 1`` bins a side.

    Example:
        >>> edges = (-32.0, -28.0, -24.0, -20.0, -16.0, -8.0, -4.0)  # 8 bins, the floor's 3
        >>> counts = np.zeros((8, 8))
        >>> counts[5, 5] = 1
        >>> joint_shown_bins(counts, edges)
        range(4, 7)
        >>> counts[4, 3] = 1
        >>> joint_shown_bins(counts, edges)
        range(3, 7)
    """
    floor = next((i for i, edge in enumerate(edges) if edge >= LOG_PROB_FLOOR), len(edges))
    occupied = np.flatnonzero((counts > 0).any(axis=0) | (counts > 0).any(axis=1))
    if occupied.size == 0:
        return range(floor, len(edges) + 1)
    first, last = int(occupied[0]), int(occupied[-1])
    return range(max(first - 1, floor), min(last + 2, len(edges) + 1))


def joint_cell_px(shown: range) -> int:
    """Side of a heatmap cell, in pixels, with the bins ``shown`` on each axis."""
    return _JOINT_SIDE // len(shown)


def joint_cell_box(shown: range, trainer_bin: int, rollout_bin: int) -> tuple[int, int, int, int]:
    """The pixels ``(left, top, right, bottom)`` (right and bottom excluded) of a heatmap cell.

    Rows are trainer bins, highest probability at the top; columns are rollout bins,
    highest probability at the right.

    Example:
        >>> joint_cell_box(range(3, 7), 6, 3)  # the top left cell
        (110, 54, 188, 132)
    """
    cell = joint_cell_px(shown)
    column, row = rollout_bin - shown.start, shown.stop - 1 - trainer_bin
    left, top = _JOINT_LEFT + column * cell, _JOINT_TOP + row * cell
    return left, top, left + cell, top + cell


def _joint_coordinate(edges: Sequence[float], shown: range, p: float) -> float:
    """Where probability ``p`` lies on a heatmap axis, in cells from the bottom (left) edge.

    Bins are of ``-log p``; between two edges the position is linear in ``log2(-log p)``.
    """
    # Edge k ends bin k, at k + 1 cells from the bottom; log2(-edge) descends with k.
    magnitudes = np.log2(-np.asarray(edges, dtype=np.float64))
    ends = np.arange(1, len(edges) + 1, dtype=np.float64)
    where = float(np.interp(math.log2(-math.log(p)), magnitudes[::-1], ends[::-1]))
    return where - shown.start


def _ticks(
    edges: Sequence[float], shown: range, gap: Callable[[str, str], float]
) -> list[tuple[float, str]]:
    """``(pixels from the bottom or left edge, label)`` of the ticks inside the shown bins.

    The probabilities of :data:`_JOINT_TICKS` first, then of :data:`_MORE_TICKS`, each at
    least ``gap(label, other)`` pixels from every other one kept.
    """
    cell, chosen = joint_cell_px(shown), []
    for p in _JOINT_TICKS + _MORE_TICKS:
        at = _joint_coordinate(edges, shown, p) * cell
        label = probability_label(p)
        if 0 < at < len(shown) * cell and all(
            abs(at - other) >= gap(label, name) for other, name in chosen
        ):
            chosen.append((at, label))
    return chosen


def _label_gap(label: str, other: str) -> float:
    """How far apart two x tick labels' centres must be, in pixels."""
    return (text_size(label, TICK_SIZE)[0] + text_size(other, TICK_SIZE)[0]) / 2 + 12


def _colour_bar(image: Image.Image, draw: ImageDraw.ImageDraw, left: int, side: int) -> None:
    """A vertical viridis bar (the fullest cell at the top), framed.

    It ends level with the bottom of the heatmap (of ``side`` pixels), below its label;
    :func:`_colour_bar_marks` puts the counts beside it.
    """
    bottom = _JOINT_TOP + side
    ramp = VIRIDIS_START + np.linspace(HEAT_SHADES - 1, 0, bottom - _BAR_TOP).round()
    image.paste(index_image(np.repeat(ramp.astype(np.uint8)[:, None], 16, 1)), (left, _BAR_TOP))
    draw.rectangle([(left - 1, _BAR_TOP - 1), (left + 16, bottom)], outline=INK[FRAME_COLOUR])


def _colour_bar_marks(
    image: Image.Image, draw: ImageDraw.ImageDraw, left: int, side: int, most: float
) -> None:
    """The counts on the colour bar from 1 to ``most``, on the ``log(1 + count)`` scale."""
    bottom = _JOINT_TOP + side
    height = bottom - _BAR_TOP
    scale = math.log1p(most)
    marks = [1.0]
    while marks[-1] * 10 <= most:
        marks.append(marks[-1] * 10)
    if most / marks[-1] >= 2:
        marks.append(most)
    free_above = bottom + 16.0
    for count in marks:
        y = bottom - math.log1p(count) / scale * height
        if y + 15 > free_above:
            continue
        draw.line(
            [(left + 16, round(y)), (left + 21, round(y))], fill=INK[FRAME_COLOUR], width=RULE_PX
        )
        put_text(image, count_label(count), left + 25, y, anchor="lm")
        free_above = y - 15


def joint_picture(profile: Profile) -> np.ndarray | None:
    """A heatmap of ``log(1 + count)`` over (rollout, trainer) probability bins.

    x is the rollout probability ``pb``, y the trainer probability ``pa``, ``p = 1`` at the
    top right, four bins per octave of ``-log p`` (fine near 1, coarse near 0), the
    occupied bins and one more on either side on both axes; the cells on the diagonal hold
    the tokens whose probabilities agree to the bin. Empty cells are white, the others
    viridis from dark (one token) to yellow (the fullest cell). On the right: the share
    of tokens on the diagonal, above it and below it. ``None`` for an empty profile.

    Example:
        >>> import torch
        >>> from lightning_rollout_debug.metrics.extras import TokenExtras
        >>> extras = TokenExtras(histograms=False, worst_tokens_k=0, profile=True,
        ...                      compile=False)
        >>> old = torch.log(torch.rand(4, 64, generator=torch.Generator().manual_seed(0)))
        >>> extras.update(old, old, torch.ones(4, 64))
        >>> joint_picture(extras.summary(extras.state).profile).shape
        (480, 800, 3)
    """
    return rgb_array(joint_image(profile))


def joint_image(profile: Profile) -> Image.Image | None:
    """The joint picture as a "P" image with the whole palette; ``None`` for an empty profile."""
    if profile.tokens < 1:
        return None
    counts = profile.joint_counts
    shown = joint_shown_bins(counts)
    cells = counts[shown.start : shown.stop, shown.start : shown.stop][::-1]  # top: highest pa
    cell = joint_cell_px(shown)
    side = len(shown) * cell

    most = max(float(counts.max()), 1.0)
    # Index into HEAT_INKS: 0 for an empty cell, 1 (one token) to HEAT_SHADES (the fullest).
    shade = np.rint(np.log1p(cells) * ((HEAT_SHADES - 1) / math.log1p(most))).astype(np.intp) + 1
    shade[cells <= 0] = 0
    heat = index_image(HEAT_INKS[shade]).resize((side, side), Image.Resampling.NEAREST)
    # The diagonal, faint, through the empty cells on it (inside each cell).
    on_diagonal = ImageDraw.Draw(heat)
    for k in np.flatnonzero(np.diagonal(cells[::-1]) <= 0).tolist():
        x, y = k * cell + 1, side - 2 - k * cell
        line = [(x, y), (x + cell - 3, y - cell + 3)]
        on_diagonal.line(line, INK[DIAGONAL_COLOUR], width=min(RULE_PX, cell - 2))

    image = _joint_frame(JOINT_EDGES, shown).copy()
    draw = ImageDraw.Draw(image)
    image.paste(heat, (_JOINT_LEFT, _JOINT_TOP))
    _colour_bar_marks(image, draw, _JOINT_LEFT + side + 24, side, most)

    total = float(counts.sum())
    shares = (
        count_label(total),
        f"{np.trace(counts) / total:.1%}",
        f"{np.tril(counts, -1).sum() / total:.1%}",
        f"{np.triu(counts, 1).sum() / total:.1%}",
    )
    for k, value in enumerate(shares):
        put_text(image, value, WIDTH - 16, _BAR_TOP + _SHARES_STEP * k, anchor="rm")
    return image


@functools.lru_cache(maxsize=8)
def _joint_frame(edges: tuple[float, ...], shown: range) -> Image.Image:
    """What a heatmap over these bins holds whatever its counts, drawn once.

    The frame, the title, the ticks, the axis names, the caption, the colour bar and the
    names of the shares. Not to be drawn on: :func:`joint_image` draws on a copy.
    """
    side = len(shown) * joint_cell_px(shown)
    image = blank_image()
    draw = ImageDraw.Draw(image)
    left, top = _JOINT_LEFT, _JOINT_TOP
    right, bottom = left + side, top + side
    draw.rectangle(
        [(left - 3, top - 3), (right + 2, bottom + 2)], outline=INK[FRAME_COLOUR], width=RULE_PX
    )
    _colour_bar(image, draw, right + 24, side)
    title = "Tokens by trainer and rollout probability"
    put_text(image, title, 12, 22, size=TITLE_SIZE, anchor="lm")
    for at, label in _ticks(edges, shown, lambda a, b: TICK_SIZE + 8):
        y = round(bottom - at)
        draw.line([(left - 9, y), (left - 3, y)], fill=INK[FRAME_COLOUR], width=RULE_PX)
        put_text(image, label, left - 11, y, anchor="rm")
    for at, label in _ticks(edges, shown, _label_gap):
        x = round(left + at)
        draw.line([(x, bottom + 2), (x, bottom + 8)], fill=INK[FRAME_COLOUR], width=RULE_PX)
        put_text(image, label, x, bottom + 8, anchor="mt")
    put_text(
        image,
        "rollout probability pb",
        (left + right) / 2,
        bottom + 40,
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
    put_text(image, "tokens", right + 16, top, anchor="lt", colour=MUTED_COLOUR)
    for k, name in enumerate(_SHARE_NAMES):
        y = _BAR_TOP + _SHARES_STEP * k
        put_text(image, name, _SHARES_LEFT, y, anchor="lm", colour=MUTED_COLOUR)
    for k, line in enumerate(_SHARE_NOTE):
        y = _BAR_TOP + _SHARES_STEP * (len(_SHARE_NAMES) + 0.5 + k)
        put_text(image, line, _SHARES_LEFT, y, anchor="lm", colour=MUTED_COLOUR)
    put_caption(image, JOINT_CAPTION)
    return image
