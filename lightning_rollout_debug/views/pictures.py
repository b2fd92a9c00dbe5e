"""Pictures of a window's mismatch profile, for TensorBoard's Images page.

Three small pictures of a :class:`~lightning_rollout_debug.metrics.profile.Profile`, as
``HEIGHT x WIDTH x 3`` uint8 RGB arrays (read-only), or as PNGs (:func:`profile_pngs`):

* :func:`by_position_picture`: mean ``|pa - pb|`` and mean k3 of each position bucket
  ``[0, 1), [1, 2), [2, 4), ...`` (log y axis), above a strip of the token counts;
* :func:`by_probability_picture`: mean ``|pa - pb|`` and mean ``|a - b|`` of each bucket
  ``(p, 2p]`` of the trainer's probability ``pa``, above the token counts;
* :func:`joint_picture` (:mod:`.heatmap`): a heatmap of ``log(1 + count)`` over (rollout
  probability, trainer probability) bins, ``p = 1`` at the top right, with the diagonal
  where the two agree.

This module draws the two line plots and holds the entry points (:data:`PICTURES`,
:func:`profile_images`, :func:`profile_pictures`, :func:`profile_pngs`); the palette, the
text, the tick labels and the PNG encoding are those of :mod:`.canvas`, and the names of
both that the pictures' users need are importable from here too. A bucket without tokens
leaves a gap; a mean of 0 (or below the y axis) is a small triangle on the bottom of the
axis. An empty profile (no token counted) has no picture: each function returns ``None``.

Example:
    >>> import io
    >>> import torch
    >>> from lightning_rollout_debug.metrics.extras import TokenExtras
    >>> extras = TokenExtras(histograms=False, worst_tokens_k=0, profile=True, compile=False)
    >>> generator = torch.Generator().manual_seed(0)
    >>> old = -torch.rand(4, 32, generator=generator) * 5
    >>> rollout = old + 0.01 * torch.randn(4, 32, generator=generator)
    >>> extras.update(rollout, old, torch.ones(4, 32))
    >>> pictures = profile_pictures(extras.summary(extras.state).profile)
    >>> {name: (picture.shape, picture.dtype.name) for name, picture in pictures.items()}
    {'by_position': ((320, 480, 3), 'uint8'), 'by_probability': ((320, 480, 3), 'uint8'), 'joint': ((320, 480, 3), 'uint8')}
    >>> pngs = profile_pngs(extras.summary(extras.state).profile)
    >>> {name: Image.open(io.BytesIO(png)).mode for name, png in pngs.items()}
    {'by_position': 'P', 'by_probability': 'P', 'joint': 'P'}
"""  # noqa: E501

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Sequence

import numpy as np
from PIL import Image, ImageDraw

from lightning_rollout_debug.metrics.profile import PROBABILITY_BUCKETS, Profile
from lightning_rollout_debug.views.canvas import (
    BACKGROUND,
    DIAGONAL_COLOUR,
    FRAME_COLOUR,
    GRID_COLOUR,
    HEAT_SHADES,
    HEIGHT,
    INK,
    LABEL_SIZE,
    MUTED_COLOUR,
    PALETTE,
    PNG_COMPRESS_LEVEL,
    SERIES_COLOURS,
    TEXT_LEVELS,
    TICK_SIZE,
    TITLE_SIZE,
    TOKEN_BAR_COLOUR,
    VIRIDIS,
    VIRIDIS_START,
    WIDTH,
    blank_image,
    count_label,
    encode_png,
    position_label,
    probability_label,
    put_text,
    rgb_array,
    text_size,
)
from lightning_rollout_debug.views.heatmap import (
    JOINT_CELL_PX,
    joint_cell_box,
    joint_image,
    joint_picture,
    joint_shown_bins,
)

__all__ = [
    "BACKGROUND",
    "DIAGONAL_COLOUR",
    "HEAT_SHADES",
    "HEIGHT",
    "JOINT_CELL_PX",
    "PALETTE",
    "PICTURES",
    "PLOT_BOX",
    "PNG_COMPRESS_LEVEL",
    "SERIES_COLOURS",
    "TEXT_LEVELS",
    "TOKEN_BAR_COLOUR",
    "TOKEN_STRIP_BOX",
    "VIRIDIS",
    "WIDTH",
    "by_position_picture",
    "by_probability_picture",
    "count_label",
    "encode_png",
    "joint_cell_box",
    "joint_picture",
    "joint_shown_bins",
    "position_label",
    "probability_label",
    "profile_images",
    "profile_pictures",
    "profile_pngs",
]


# ---------------------------------------------------------------------- line plots
# Line plots: the main axes above, the token strip below, sharing the x axis.
_LEFT, _RIGHT = 58, WIDTH - 14
_TOP, _MAIN_BOTTOM = 32, 230
_STRIP_TOP, _STRIP_BOTTOM = 238, 276
_MAX_DECADES = 12

PLOT_BOX = (_LEFT, _TOP, _RIGHT, _MAIN_BOTTOM)
"""The axes of the means in the two profile plots: ``(left, top, right, bottom)`` pixels.

Bucket ``i`` of ``n`` is centred at ``left + (i + 0.5) * (right - left) / n``."""

TOKEN_STRIP_BOX = (_LEFT, _STRIP_TOP, _RIGHT, _STRIP_BOTTOM)
"""The strip of token counts below them, on the same x axis: ``(left, top, right, bottom)``."""


def _y_ticks(low: int, high: int) -> list[tuple[float, str]]:
    """Ticks of a log axis over decades ``[low, high]``: ``(log10 value, label)``."""
    decades = high - low
    if decades <= 2:
        marks = [k + math.log10(m) for k in range(low, high) for m in (1, 2, 5)] + [high]
    else:
        step = 1 if decades <= 8 else 2
        marks = [float(k) for k in range(high, low - 1, -step)]
    return [(mark, probability_label(10.0**mark)) for mark in sorted(marks)]


def _decade_range(series: Sequence[Sequence[float]]) -> tuple[int, int]:
    """The decades ``[low, high]`` the positive values span (at most ``_MAX_DECADES``)."""
    positive = [v for values in series for v in values if v > 0 and math.isfinite(v)]
    if not positive:
        return -6, -5
    high = math.ceil(math.log10(max(positive)) - 1e-9)
    low = math.floor(math.log10(min(positive)) + 1e-9)
    if high <= low:
        high = low + 1
    return max(low, high - _MAX_DECADES), high


def _legend(image: Image.Image, draw: ImageDraw.ImageDraw, names: Sequence[str]) -> None:
    """The series' names with a line of their colour, right-aligned on the title row."""
    x = _RIGHT
    for name, colour in reversed(list(zip(names, SERIES_COLOURS, strict=False))):
        width, _ = text_size(name, LABEL_SIZE)
        put_text(image, name, x, 15, size=LABEL_SIZE, anchor="rm")
        x -= width + 5
        draw.line([(x - 16, 15), (x, 15)], fill=INK[colour], width=2)
        draw.ellipse([(x - 10, 13), (x - 6, 17)], fill=INK[colour])
        x -= 16 + 14


def _series_picture(
    title: str,
    names: Sequence[str],
    series: Sequence[Sequence[float]],
    tokens: Sequence[float],
    x_ticks: Sequence[tuple[float, str]],
    x_label: str,
) -> Image.Image:
    """Series on a log y axis over equal slots, one per bucket, with the token counts below.

    ``x_ticks`` are ``(slot coordinate, label)``: slot ``i`` spans ``[i, i + 1)``.
    """
    slots = len(tokens)
    low, high = _decade_range(series)
    image = _series_frame(title, tuple(names), slots, low, high, tuple(x_ticks), x_label).copy()
    draw = ImageDraw.Draw(image)
    x_of, y_of = _slot_x(slots), _log_y(low, high)
    if not any(value > 0 for values in series for value in values):
        put_text(
            image,
            "every mean is 0 (triangles on the bottom edge)",
            (_LEFT + _RIGHT) / 2,
            (_TOP + _MAIN_BOTTOM) / 2,
            size=LABEL_SIZE,
            anchor="mm",
            colour=MUTED_COLOUR,
        )

    # Token counts: log-scaled bars, at least 2 px for a single token.
    most = max(tokens)
    strip = _STRIP_BOTTOM - _STRIP_TOP - 2
    half_bar = max(1.0, 0.35 * (_RIGHT - _LEFT) / slots)
    for i, count in enumerate(tokens):
        if count < 1:
            continue
        share = math.log(count) / math.log(most) if most > 1 else 1.0
        top = _STRIP_BOTTOM - 2 - share * (strip - 2)
        middle = x_of(i + 0.5)
        draw.rectangle(
            [(round(middle - half_bar), round(top)), (round(middle + half_bar) - 1, _STRIP_BOTTOM)],
            fill=INK[TOKEN_BAR_COLOUR],
        )
    put_text(image, count_label(most), _LEFT - 5, _STRIP_TOP, anchor="rt", colour=MUTED_COLOUR)
    if most >= 2:
        put_text(image, "1", _LEFT - 5, _STRIP_BOTTOM, anchor="rb", colour=MUTED_COLOUR)

    # The series: lines through consecutive buckets with a mean, dots at each mean, a
    # triangle on the bottom edge for a mean of 0 or below the axis.
    for number, (values, colour) in enumerate(zip(series, SERIES_COLOURS, strict=False)):
        run: list[tuple[float, float]] = []
        dots: list[tuple[float, float]] = []
        for i, value in enumerate(values):
            x = x_of(i + 0.5)
            if math.isfinite(value) and value > 0 and math.log10(value) >= low:
                run.append((x, y_of(math.log10(value))))
                dots.append(run[-1])
                continue
            if len(run) > 1:
                draw.line(run, fill=INK[colour], width=2, joint="curve")
            run = []
            if math.isfinite(value):
                x, y = x + 4 * number - 2, _MAIN_BOTTOM - 1
                draw.polygon([(x - 3, y - 5), (x + 3, y - 5), (x, y)], fill=INK[colour])
        if len(run) > 1:
            draw.line(run, fill=INK[colour], width=2, joint="curve")
        for x, y in dots:
            draw.ellipse([(x - 2.5, y - 2.5), (x + 2.5, y + 2.5)], fill=INK[colour])
    _frame_lines(draw, x_of, x_ticks)  # over the series and the bars
    return image


def _slot_x(slots: int) -> Callable[[float], float]:
    """The x pixel of a coordinate in slots (slot ``i`` spans ``[i, i + 1)``)."""
    slot_px = (_RIGHT - _LEFT) / slots
    return lambda coordinate: _LEFT + coordinate * slot_px


def _log_y(low: int, high: int) -> Callable[[float], float]:
    """The y pixel of a ``log10`` value on the main axes over decades ``[low, high]``."""
    return lambda log_value: _MAIN_BOTTOM - (log_value - low) / (high - low) * (_MAIN_BOTTOM - _TOP)


@functools.lru_cache(maxsize=8)
def _series_frame(
    title: str,
    names: tuple[str, ...],
    slots: int,
    low: int,
    high: int,
    x_ticks: tuple[tuple[float, str], ...],
    x_label: str,
) -> Image.Image:
    """What a line plot holds whatever its values, drawn once per axes.

    The title, the legend, the grid, the ticks and the labels. Not to be drawn on:
    :func:`_series_picture` draws on a copy.
    """
    image = blank_image(VIRIDIS_START)
    draw = ImageDraw.Draw(image)
    x_of, y_of = _slot_x(slots), _log_y(low, high)
    put_text(image, title, 8, 15, size=TITLE_SIZE, anchor="lm")
    _legend(image, draw, names)
    for mark, label in _y_ticks(low, high):
        y = round(y_of(mark))
        draw.line([(_LEFT + 1, y), (_RIGHT - 1, y)], fill=INK[GRID_COLOUR])
        draw.line([(_LEFT - 3, y), (_LEFT, y)], fill=INK[FRAME_COLOUR])
        put_text(image, label, _LEFT - 5, y, anchor="rm")
    put_text(
        image,
        "mean (log scale)",
        6,
        (_TOP + _MAIN_BOTTOM) / 2,
        size=LABEL_SIZE,
        anchor="lm",
        rotate=True,
    )
    put_text(
        image,
        "tokens",
        6,
        (_STRIP_TOP + _STRIP_BOTTOM) / 2,
        size=TICK_SIZE,
        anchor="lm",
        colour=MUTED_COLOUR,
        rotate=True,
    )
    # x tick labels, each only where it does not run into the previous one.
    free_from = -math.inf
    for coordinate, label in x_ticks:
        x = round(x_of(coordinate))
        width, _ = text_size(label, TICK_SIZE)
        left = min(x - width / 2, _RIGHT + 6 - width)
        if left >= free_from:
            put_text(image, label, left, _STRIP_BOTTOM + 4)
            free_from = left + width + 3
    put_text(image, x_label, (_LEFT + _RIGHT) / 2, _STRIP_BOTTOM + 21, size=LABEL_SIZE, anchor="mt")
    return image


def _frame_lines(
    draw: ImageDraw.ImageDraw, x_of: Callable[[float], float], x_ticks: Sequence[tuple[float, str]]
) -> None:
    """The frames of the main axes and of the strip, and the x tick marks on both."""
    draw.rectangle([(_LEFT, _TOP), (_RIGHT, _MAIN_BOTTOM)], outline=INK[FRAME_COLOUR])
    draw.line([(_LEFT, _STRIP_BOTTOM), (_RIGHT, _STRIP_BOTTOM)], fill=INK[FRAME_COLOUR])
    draw.line([(_LEFT, _STRIP_TOP), (_LEFT, _STRIP_BOTTOM)], fill=INK[FRAME_COLOUR])
    for coordinate, _ in x_ticks:
        x = round(x_of(coordinate))
        draw.line([(x, _STRIP_BOTTOM), (x, _STRIP_BOTTOM + 3)], fill=INK[FRAME_COLOUR])
        draw.line([(x, _MAIN_BOTTOM), (x, _MAIN_BOTTOM + 3)], fill=INK[FRAME_COLOUR])


def by_position_picture(profile: Profile) -> np.ndarray | None:
    """Mean ``|pa - pb|`` and mean k3 by response position, with the tokens per bucket.

    One slot per position bucket ``[0, 1), [1, 2), [2, 4), ...`` (so the x axis is log2),
    labelled by its first position (``1k`` = 1024); ``None`` for an empty profile.

    Example:
        >>> import torch
        >>> from lightning_rollout_debug.metrics.extras import TokenExtras
        >>> extras = TokenExtras(histograms=False, worst_tokens_k=0, profile=True,
        ...                      compile=False)
        >>> old = torch.full((2, 100), -0.5)
        >>> extras.update(old + torch.linspace(0, 0.1, 100), old, torch.ones(2, 100))
        >>> by_position_picture(extras.summary(extras.state).profile).shape
        (320, 480, 3)
    """
    return rgb_array(_by_position(profile))


def _by_position(profile: Profile) -> Image.Image | None:
    if profile.tokens < 1 or not profile.by_position:
        return None
    buckets = profile.by_position
    return _series_picture(
        "Mismatch by response position",
        ("mean |pa - pb|", "mean k3 (KL)"),
        ([b.probs_diff_mean for b in buckets], [b.kl_k3 for b in buckets]),
        [b.tokens for b in buckets],
        [(i + 0.5, position_label(b.start)) for i, b in enumerate(buckets)],
        "position in the response (buckets [n, 2n), labelled n; k = 1024)",
    )


_PROBABILITY_TICKS = (1e-8, 1e-6, 1e-4, 0.01, 0.1, 0.5, 1.0)


def by_probability_picture(profile: Profile) -> np.ndarray | None:
    """Mean ``|pa - pb|`` and mean ``|a - b|`` by the trainer's probability ``pa``.

    One slot per bucket ``(2**-(k+1), 2**-k]`` from ``2**-29`` to 1 (the x axis is log2,
    ticks at probabilities), with the tokens per bucket; ``None`` for an empty profile.

    Example:
        >>> import torch
        >>> from lightning_rollout_debug.metrics.extras import TokenExtras
        >>> extras = TokenExtras(histograms=False, worst_tokens_k=0, profile=True,
        ...                      compile=False)
        >>> old = torch.log(torch.linspace(1e-6, 1, 64)).reshape(1, 64)
        >>> extras.update(old + 0.01, old, torch.ones(1, 64))
        >>> by_probability_picture(extras.summary(extras.state).profile).shape
        (320, 480, 3)
    """
    return rgb_array(_by_probability(profile))


def _by_probability(profile: Profile) -> Image.Image | None:
    if profile.tokens < 1:
        return None
    buckets = profile.by_probability
    return _series_picture(
        "Mismatch by trainer probability",
        ("mean |pa - pb|", "mean |a - b| (log-probs)"),
        ([b.probs_diff_mean for b in buckets], [b.log_probs_diff_mean for b in buckets]),
        [b.tokens for b in buckets],
        [(math.log2(p) + PROBABILITY_BUCKETS, probability_label(p)) for p in _PROBABILITY_TICKS],
        "trainer probability pa (buckets (p, 2p])",
    )


# ---------------------------------------------------------------------- all three
PICTURES: tuple[tuple[str, Callable[[Profile], np.ndarray | None]], ...] = (
    ("by_position", by_position_picture),
    ("by_probability", by_probability_picture),
    ("joint", joint_picture),
)
"""Each picture's name and the function that draws it."""

# Each picture's name and the function that draws it as a "P" image.
_DRAW: tuple[tuple[str, Callable[[Profile], Image.Image | None]], ...] = (
    ("by_position", _by_position),
    ("by_probability", _by_probability),
    ("joint", joint_image),
)


def profile_images(profile: Profile | None) -> dict[str, Image.Image]:
    """The pictures of :data:`PICTURES` by name, as "P" images with :data:`PALETTE`.

    Drawing one is cheaper than its RGB array (a byte per pixel); none for an empty (or
    missing) profile.
    """
    if profile is None or profile.tokens < 1:
        return {}
    drawn = {name: draw(profile) for name, draw in _DRAW}
    return {name: image for name, image in drawn.items() if image is not None}


def profile_pictures(profile: Profile | None) -> dict[str, np.ndarray]:
    """The pictures of :data:`PICTURES` by name, as RGB arrays; none for an empty profile."""
    return {
        name: np.asarray(image.convert("RGB")) for name, image in profile_images(profile).items()
    }


def profile_pngs(profile: Profile | None) -> dict[str, bytes]:
    """The pictures of :data:`PICTURES` by name, as PNGs (:func:`encode_png`).

    Each is an 8-bit palette PNG of ``WIDTH x HEIGHT`` (a few KB): decoded and converted
    to RGB, it is the array of :func:`profile_pictures`. None for an empty (or missing)
    profile.
    """
    return {name: encode_png(image) for name, image in profile_images(profile).items()}
