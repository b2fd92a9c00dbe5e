"""The line plots of the profile pictures: means over buckets, with the tokens below.

:func:`series_picture` draws series of means on a log y axis over equal slots, one per
bucket, above a strip of each bucket's token count (log-scaled bars), with a title, a
legend, the axis names and a caption of what the symbols mean (:class:`LinePlot` holds
that text). Each series has its colour, its marker and its line (:data:`SERIES_STYLES`):
large circles on a solid line, then small diamonds on a dashed one. The larger marks are
drawn first, so that where two means coincide the smaller mark sits inside the larger
one and both show. A bucket without tokens leaves a gap; a mean of 0 (or below the y
axis) is a triangle on the bottom edge of the axes, one beside the other.

Example:
    >>> plot = LinePlot("Title", ("one", "two"), ((0.5, "a"), (1.5, "b")), "buckets",
    ...                 ("a caption",))
    >>> series_picture(plot, ([1e-3, 2e-3], [1e-3, 0.0]), [10.0, 3.0]).size
    (800, 480)
"""

from __future__ import annotations

import functools
import itertools
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from PIL import Image, ImageDraw

from lightning_rollout_debug.views.canvas import (
    FRAME_COLOUR,
    GRID_COLOUR,
    INK,
    LABEL_SIZE,
    MUTED_COLOUR,
    RGB,
    RULE_PX,
    SERIES_COLOURS,
    TICK_SIZE,
    TITLE_SIZE,
    TOKEN_BAR_COLOUR,
    VIRIDIS_START,
    WIDTH,
    blank_image,
    count_label,
    probability_label,
    put_caption,
    put_text,
    text_size,
)

_LEFT, _RIGHT = 100, WIDTH - 24
_TITLE_Y, _LEGEND_Y = 22, 58
_TOP, _MAIN_BOTTOM = 80, 290
_STRIP_TOP, _STRIP_BOTTOM = 298, 336
_X_TICKS_TOP, _X_NAME_TOP = 341, 373
_MAX_DECADES = 12
_INSET = 12
_SERIES_LINE_PX = RULE_PX + 1
"""A series' line: Pillow draws a sloped line of 4 px at 3 px or more across."""

PLOT_BOX = (_LEFT, _TOP, _RIGHT, _MAIN_BOTTOM)
"""The axes of the means in the two profile plots: ``(left, top, right, bottom)`` pixels.

Bucket ``i`` of ``n`` is centred at ``left + (i + 0.5) * (right - left) / n``."""

TOKEN_STRIP_BOX = (_LEFT, _STRIP_TOP, _RIGHT, _STRIP_BOTTOM)
"""The strip of token counts below them, on the same x axis: ``(left, top, right, bottom)``."""


@dataclass(frozen=True)
class SeriesStyle:
    """How a series is drawn: its colour, its marker and its line.

    ``marker`` is ``circle`` or ``diamond``, of ``radius`` pixels; the line is solid, or
    dashed with ``dash`` = (pixels on, pixels off).
    """

    colour: RGB
    marker: str
    radius: float
    dash: tuple[int, int] | None


SERIES_STYLES = (
    SeriesStyle(SERIES_COLOURS[0], "circle", 8.0, None),
    SeriesStyle(SERIES_COLOURS[1], "diamond", 6.0, (14, 8)),
)
"""The first series: blue circles on a solid line; the second: smaller orange diamonds on
a dashed line, drawn over the first."""


@dataclass(frozen=True)
class LinePlot:
    """What a line plot says whatever its values.

    ``names`` are the series' (legend); ``x_ticks`` are ``(slot coordinate, label)``, slot
    ``i`` spanning ``[i, i + 1)``; ``x_label`` names the x axis; ``caption`` is the lines
    below it, saying what the symbols and the buckets are.
    """

    title: str
    names: tuple[str, ...]
    x_ticks: tuple[tuple[float, str], ...]
    x_label: str
    caption: tuple[str, ...]


def series_picture(
    plot: LinePlot, series: Sequence[Sequence[float]], tokens: Sequence[float]
) -> Image.Image:
    """Series on a log y axis over equal slots, one per bucket, with the token counts below."""
    slots = len(tokens)
    low, high = _decade_range(series)
    image = _series_frame(plot, slots, low, high).copy()
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
    _token_bars(image, draw, tokens, x_of)
    _draw_series(draw, series, low, x_of, y_of)
    _frame_lines(draw, x_of, plot.x_ticks)  # over the series and the bars
    return image


def _token_bars(
    image: Image.Image,
    draw: ImageDraw.ImageDraw,
    tokens: Sequence[float],
    x_of: Callable[[float], float],
) -> None:
    """The tokens of each bucket: log-scaled bars, at least 2 px for a single token."""
    most = max(tokens)
    strip = _STRIP_BOTTOM - _STRIP_TOP - 2
    half_bar = max(1.0, 0.35 * (_RIGHT - _LEFT) / len(tokens))
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
    put_text(image, count_label(most), _LEFT - 8, _STRIP_TOP - 2, anchor="rt", colour=MUTED_COLOUR)


def _draw_series(
    draw: ImageDraw.ImageDraw,
    series: Sequence[Sequence[float]],
    low: int,
    x_of: Callable[[float], float],
    y_of: Callable[[float], float],
) -> None:
    """The series' lines and markers: the larger markers' series first, the markers last.

    A line runs through consecutive buckets with a mean, a marker sits at each mean, and a
    triangle on the bottom edge stands for a mean of 0 or below the axis.
    """
    order = sorted(range(len(series)), key=lambda k: -SERIES_STYLES[k].radius)
    marks: list[tuple[SeriesStyle, float, float]] = []
    for number in order:
        style = SERIES_STYLES[number]
        run: list[tuple[float, float]] = []
        for i, value in enumerate([*series[number], math.nan]):
            x = x_of(i + 0.5)
            if math.isfinite(value) and value > 0 and math.log10(value) >= low:
                run.append((x, y_of(math.log10(value))))
                marks.append((style, *run[-1]))
                continue
            _polyline(draw, run, style)
            run = []
            if math.isfinite(value):
                x, y = x + 12 * number - 6, _MAIN_BOTTOM - 1
                draw.polygon([(x - 5, y - 9), (x + 5, y - 9), (x, y)], fill=INK[style.colour])
    for style, x, y in marks:
        _marker(draw, style, x, y)


def _polyline(
    draw: ImageDraw.ImageDraw, points: Sequence[tuple[float, float]], style: SeriesStyle
) -> None:
    """A series' line through ``points``: solid, or dashed with the dashes running on."""
    if len(points) < 2:
        return
    ink = INK[style.colour]
    if style.dash is None:
        draw.line(list(points), fill=ink, width=_SERIES_LINE_PX, joint="curve")
        return
    on, off = style.dash
    travelled = 0.0
    for (x0, y0), (x1, y1) in itertools.pairwise(points):
        length = math.hypot(x1 - x0, y1 - y0)
        start = 0.0
        while start < length:
            phase = (travelled + start) % (on + off)
            end = min(length, start + (on - phase if phase < on else on + off - phase))
            if phase < on:
                a, b = start / length, end / length
                segment = [(x0 + a * (x1 - x0), y0 + a * (y1 - y0))]
                segment.append((x0 + b * (x1 - x0), y0 + b * (y1 - y0)))
                draw.line(segment, fill=ink, width=_SERIES_LINE_PX)
            start = end
        travelled += length


def _marker(draw: ImageDraw.ImageDraw, style: SeriesStyle, x: float, y: float) -> None:
    """A series' marker centred at ``(x, y)``."""
    r = style.radius
    if style.marker == "circle":
        draw.ellipse([(x - r, y - r), (x + r, y + r)], fill=INK[style.colour])
    else:
        draw.polygon([(x, y - r), (x + r, y), (x, y + r), (x - r, y)], fill=INK[style.colour])


def _y_ticks(low: int, high: int) -> list[tuple[float, str]]:
    """Ticks of a log axis over decades ``[low, high]``: ``(log10 value, label)``."""
    decades = high - low
    if decades <= 2:
        marks = [k + math.log10(m) for k in range(low, high) for m in (1, 2, 5)] + [high]
    else:
        step = 1 if decades <= 6 else 2 if decades <= 12 else 3
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


def _slot_x(slots: int) -> Callable[[float], float]:
    """The x pixel of a coordinate in slots (slot ``i`` spans ``[i, i + 1)``)."""
    slot_px = (_RIGHT - _LEFT) / slots
    return lambda coordinate: _LEFT + coordinate * slot_px


def _log_y(low: int, high: int) -> Callable[[float], float]:
    """The y pixel of a ``log10`` value on the main axes over decades ``[low, high]``.

    The decades end :data:`_INSET` pixels inside the frame, so that a marker on either
    shows whole.
    """
    bottom, height = _MAIN_BOTTOM - _INSET, _MAIN_BOTTOM - _TOP - 2 * _INSET
    return lambda log_value: bottom - (log_value - low) / (high - low) * height


def _legend(image: Image.Image, draw: ImageDraw.ImageDraw, names: Sequence[str]) -> None:
    """Each series' line and marker with its name, then the token bars', on the legend row."""
    x = float(_LEFT)
    for name, style in zip(names, SERIES_STYLES, strict=False):
        _polyline(draw, [(x, _LEGEND_Y), (x + 44, _LEGEND_Y)], style)
        _marker(draw, style, x + 22, _LEGEND_Y)
        put_text(image, name, x + 52, _LEGEND_Y, size=LABEL_SIZE, anchor="lm")
        x += 52 + text_size(name, LABEL_SIZE)[0] + 32
    draw.rectangle([(x, _LEGEND_Y - 10), (x + 14, _LEGEND_Y + 10)], fill=INK[TOKEN_BAR_COLOUR])
    put_text(image, "tokens (log scale)", x + 22, _LEGEND_Y, size=LABEL_SIZE, anchor="lm")


@functools.lru_cache(maxsize=8)
def _series_frame(plot: LinePlot, slots: int, low: int, high: int) -> Image.Image:
    """What a line plot holds whatever its values, drawn once per axes.

    The title, the legend, the grid, the ticks, the axis names and the caption. Not to be
    drawn on: :func:`series_picture` draws on a copy.
    """
    image = blank_image(VIRIDIS_START)
    draw = ImageDraw.Draw(image)
    x_of, y_of = _slot_x(slots), _log_y(low, high)
    put_text(image, plot.title, 12, _TITLE_Y, size=TITLE_SIZE, anchor="lm")
    _legend(image, draw, plot.names)
    for mark, label in _y_ticks(low, high):
        y = round(y_of(mark))
        draw.line([(_LEFT + 1, y), (_RIGHT - 1, y)], fill=INK[GRID_COLOUR], width=RULE_PX)
        draw.line([(_LEFT - 5, y), (_LEFT, y)], fill=INK[FRAME_COLOUR], width=RULE_PX)
        put_text(image, label, _LEFT - 8, y, anchor="rm")
    middle = (_TOP + _MAIN_BOTTOM) / 2
    put_text(image, "mean (log scale)", 6, middle, size=LABEL_SIZE, anchor="lm", rotate=True)
    # x tick labels, each only where it does not run into the previous one.
    free_from = -math.inf
    for coordinate, label in plot.x_ticks:
        width, _ = text_size(label, TICK_SIZE)
        left = min(x_of(coordinate) - width / 2, WIDTH - 4 - width)
        if left >= free_from:
            put_text(image, label, left, _X_TICKS_TOP)
            free_from = left + width + 10
    put_text(image, plot.x_label, (_LEFT + _RIGHT) / 2, _X_NAME_TOP, size=LABEL_SIZE, anchor="mt")
    put_caption(image, plot.caption)
    return image


def _frame_lines(
    draw: ImageDraw.ImageDraw, x_of: Callable[[float], float], x_ticks: Sequence[tuple[float, str]]
) -> None:
    """The frames of the main axes and of the strip, and the x tick marks on both."""
    draw.rectangle(
        [(_LEFT, _TOP), (_RIGHT, _MAIN_BOTTOM)], outline=INK[FRAME_COLOUR], width=RULE_PX
    )
    draw.line(
        [(_LEFT, _STRIP_BOTTOM), (_RIGHT, _STRIP_BOTTOM)], fill=INK[FRAME_COLOUR], width=RULE_PX
    )
    draw.line([(_LEFT, _STRIP_TOP), (_LEFT, _STRIP_BOTTOM)], fill=INK[FRAME_COLOUR], width=RULE_PX)
    for coordinate, _ in x_ticks:
        x = round(x_of(coordinate))
        draw.line(
            [(x, _STRIP_BOTTOM), (x, _STRIP_BOTTOM + 5)], fill=INK[FRAME_COLOUR], width=RULE_PX
        )
        draw.line([(x, _MAIN_BOTTOM), (x, _MAIN_BOTTOM + 5)], fill=INK[FRAME_COLOUR], width=RULE_PX)
