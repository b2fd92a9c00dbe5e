"""Pictures of a window's mismatch profile, for TensorBoard's Images page.

Three small pictures of a :class:`~lightning_rollout_debug.profile.Profile`, as
``HEIGHT x WIDTH x 3`` uint8 RGB arrays (read-only), or as PNGs (:func:`profile_pngs`):

* :func:`by_position_picture`: mean ``|pa - pb|`` and mean k3 of each position bucket
  ``[0, 1), [1, 2), [2, 4), ...`` (log y axis), above a strip of the token counts;
* :func:`by_probability_picture`: mean ``|pa - pb|`` and mean ``|a - b|`` of each bucket
  ``[p, 2p)`` of the trainer's probability ``pa``, above the token counts;
* :func:`joint_picture`: a heatmap of ``log(1 + count)`` over (rollout probability, trainer
  probability) bins, ``p = 1`` at the top right, with the diagonal where the two agree.

They are drawn at every logged step, so they are plain Pillow drawings (lines, rectangles,
a NumPy heatmap) in 8-bit palette images ("P" mode) with one fixed :data:`PALETTE`: the
interface colours, the anti-aliasing shades of the text on the background, and viridis.
A picture is a byte per pixel, and its PNG (:func:`encode_png`: palette, fast zlib level)
is written without converting or quantising colours. Every piece of text is rendered once
and kept: tick labels, titles and legends repeat from step to step. A bucket without tokens
leaves a gap; a mean of 0 (or below the y axis) is a small triangle on the bottom of the
axis. An empty profile (no token counted) has no picture: each function returns ``None``.

Example:
    >>> import torch
    >>> from lightning_rollout_debug.extras import TokenExtras
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
import io
import math
from collections.abc import Callable, Sequence

import numpy as np
from PIL import Image, ImageDraw, ImageFont

from lightning_rollout_debug.profile import PROBABILITY_BUCKETS, Profile
from lightning_rollout_debug.rows import LOG_PROB_FLOOR

WIDTH = 480
"""Width of every picture, in pixels."""

HEIGHT = 320
"""Height of every picture, in pixels."""

RGB = tuple[int, int, int]

BACKGROUND: RGB = (255, 255, 255)
"""The background, also the colour of an empty cell of the heatmap."""

SERIES_COLOURS: tuple[RGB, RGB] = ((31, 119, 180), (230, 97, 1))
"""The two series of the profile pictures: blue, then orange."""

TOKEN_BAR_COLOUR: RGB = (205, 205, 205)
"""The bars of the token counts."""

DIAGONAL_COLOUR: RGB = (200, 200, 200)
"""The heatmap's diagonal, drawn where no cell is coloured."""

_TEXT: RGB = (30, 30, 30)
_MUTED: RGB = (105, 105, 105)
_FRAME: RGB = (120, 120, 120)
_GRID: RGB = (234, 234, 234)

_TITLE_SIZE, _LABEL_SIZE, _TICK_SIZE = 13, 11, 10

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

# Heatmap: one square cell of JOINT_CELL_PX per bin, from the bin of the log-prob floor up.
JOINT_CELL_PX = 4
"""Side of a heatmap cell, in pixels."""

_JOINT_LEFT, _JOINT_TOP = 62, 32

# matplotlib's viridis at 0, 1/8, ..., 1; the lookup table interpolates between them.
_VIRIDIS_ANCHORS = (
    (68, 1, 84),
    (72, 40, 120),
    (62, 73, 137),
    (49, 104, 142),
    (38, 130, 142),
    (31, 158, 137),
    (53, 183, 121),
    (110, 206, 88),
    (253, 231, 37),
)


def _lookup_table(anchors: Sequence[RGB], size: int = 256) -> np.ndarray:
    """A ``[size, 3]`` uint8 colour map, linear between equally spaced anchors."""
    where = np.linspace(0.0, 1.0, len(anchors))
    at = np.linspace(0.0, 1.0, size)
    channels = [np.interp(at, where, [colour[c] for colour in anchors]) for c in range(3)]
    return np.rint(np.stack(channels, axis=1)).astype(np.uint8)


# ---------------------------------------------------------------------- palette
_UI_COLOURS: tuple[RGB, ...] = (
    BACKGROUND,
    *SERIES_COLOURS,
    TOKEN_BAR_COLOUR,
    DIAGONAL_COLOUR,
    _TEXT,
    _MUTED,
    _FRAME,
    _GRID,
)
_INK = {colour: index for index, colour in enumerate(_UI_COLOURS)}  # palette indices

TEXT_LEVELS = 16
"""Steps of the text's anti-aliasing: a glyph pixel of coverage ``a`` (0 to 1) is drawn
``round(a * TEXT_LEVELS) / TEXT_LEVELS`` of the way from the background to the text colour."""

_TEXT_COLOURS = (_TEXT, _MUTED)

HEAT_SHADES = 256 - len(_UI_COLOURS) - len(_TEXT_COLOURS) * (TEXT_LEVELS - 1)
"""Shades of viridis in the heatmap: the palette entries left after the interface colours
and the text's anti-aliasing shades."""

VIRIDIS = _lookup_table(_VIRIDIS_ANCHORS, HEAT_SHADES)
"""Viridis as a ``[HEAT_SHADES, 3]`` uint8 lookup table (anchors of matplotlib's,
interpolated): the heatmap's colours, from one token to the fullest cell."""


def _text_shades(colour: RGB) -> np.ndarray:
    """``[TEXT_LEVELS - 1, 3]``: ``colour`` over the background at coverage ``k / TEXT_LEVELS``."""
    weights = np.arange(1, TEXT_LEVELS, dtype=np.float64)[:, None] / TEXT_LEVELS
    background, ink = np.asarray(BACKGROUND, np.float64), np.asarray(colour, np.float64)
    return np.rint(background + weights * (ink - background)).astype(np.uint8)


PALETTE = np.vstack(
    [
        np.asarray(_UI_COLOURS, dtype=np.uint8),
        *(_text_shades(colour) for colour in _TEXT_COLOURS),
        VIRIDIS,
    ]
)
"""The ``[256, 3]`` uint8 palette of the pictures: the interface colours (index 0 is the
background), the text's anti-aliasing shades, then :data:`VIRIDIS`. The line plots carry
its entries up to the heatmap's colours, the heatmap all 256."""

_VIRIDIS_START = 256 - HEAT_SHADES

# Palette index by coverage level (0 to TEXT_LEVELS), for each text colour.
_TEXT_INKS = {
    colour: np.array(
        [_INK[BACKGROUND], *range(start, start + TEXT_LEVELS - 1), _INK[colour]], dtype=np.uint8
    )
    for colour, start in (
        (colour, len(_UI_COLOURS) + k * (TEXT_LEVELS - 1)) for k, colour in enumerate(_TEXT_COLOURS)
    )
}

# Palette index of a heatmap cell by shade + 1: the background for an empty cell (0).
_HEAT_INKS = np.array([_INK[BACKGROUND], *range(_VIRIDIS_START, 256)], dtype=np.uint8)

_PALETTE_BYTES = PALETTE.tobytes()


def _blank(colours: int = 256) -> Image.Image:
    """A new picture: the background, in "P" mode with the first ``colours`` of :data:`PALETTE`.

    A PNG holds as many palette entries as its image has: a picture without the heatmap's
    colours leaves them out.
    """
    image = Image.new("P", (WIDTH, HEIGHT), _INK[BACKGROUND])
    image.putpalette(_PALETTE_BYTES[: 3 * colours])
    return image


def _index_image(indices: np.ndarray) -> Image.Image:
    """A "P" image of the palette indices in the 2-D uint8 array ``indices``."""
    height, width = indices.shape
    return Image.frombytes("P", (width, height), np.ascontiguousarray(indices).tobytes())


def _rgb(image: Image.Image | None) -> np.ndarray | None:
    """The picture as a read-only ``HEIGHT x WIDTH x 3`` uint8 RGB array."""
    return None if image is None else np.asarray(image.convert("RGB"))


PNG_COMPRESS_LEVEL = 3
"""zlib level of the pictures' PNGs (a few KB each): about as fast to encode as level 1, and
smaller. Each byte of an event costs TensorBoard's writer a checksum computed in Python,
so the size counts as much as the encoding time."""


def encode_png(image: Image.Image) -> bytes:
    """The picture as a PNG: 8-bit palette for a "P" image, at :data:`PNG_COMPRESS_LEVEL`."""
    buffer = io.BytesIO()
    image.save(buffer, format="PNG", compress_level=PNG_COMPRESS_LEVEL)
    return buffer.getvalue()


# ---------------------------------------------------------------------- text
@functools.lru_cache(maxsize=8)
def _font(size: int) -> ImageFont.FreeTypeFont | ImageFont.ImageFont:
    """Pillow's built-in font at ``size`` pixels (its bitmap font without FreeType)."""
    return ImageFont.load_default(size=size)


@functools.lru_cache(maxsize=8)
def _line_height(size: int) -> int:
    return int(_font(size).getbbox("Ag|y")[3]) + 1


@functools.lru_cache(maxsize=2048)
def _text_mask(text: str, size: int, rotate: bool) -> Image.Image:
    """The text as an ``L`` mask, one line high; turned to read upwards with ``rotate``."""
    font = _font(size)
    mask = Image.new("L", (max(1, math.ceil(font.getlength(text))), _line_height(size)), 0)
    ImageDraw.Draw(mask).text((0, 0), text, fill=255, font=font)
    return mask.transpose(Image.Transpose.ROTATE_90) if rotate else mask


@functools.lru_cache(maxsize=2048)
def _text_stamp(text: str, size: int, rotate: bool, colour: RGB) -> tuple[Image.Image, Image.Image]:
    """The text as a "P" image of its colour's shades on the background, and its ``1`` mask.

    The mask holds the pixels of coverage ``1 / (2 * TEXT_LEVELS)`` or more (the stamp
    replaces them); the others keep what is under the text.
    """
    coverage = np.asarray(_text_mask(text, size, rotate), dtype=np.int32)
    levels = (coverage * TEXT_LEVELS + 127) // 255
    return _index_image(_TEXT_INKS[colour][levels]), Image.fromarray(levels > 0)


def _text_size(text: str, size: int) -> tuple[int, int]:
    return _text_mask(text, size, False).size


def _put(
    image: Image.Image,
    text: str,
    x: float,
    y: float,
    *,
    size: int = _TICK_SIZE,
    colour: RGB = _TEXT,
    anchor: str = "lt",
    rotate: bool = False,
) -> None:
    """Paint ``text`` in ``colour`` (``_TEXT`` or ``_MUTED``) with its box anchored at ``(x, y)``.

    ``anchor`` is ``l``, ``m`` or ``r`` (left, middle, right), then ``t``, ``m`` or ``b``
    (top, middle, bottom).
    """
    stamp, mask = _text_stamp(text, size, rotate, colour)
    width, height = stamp.size
    left = x - {"l": 0.0, "m": width / 2, "r": width}[anchor[0]]
    top = y - {"t": 0.0, "m": height / 2, "b": height}[anchor[1]]
    image.paste(stamp, (round(left), round(top)), mask)


# ---------------------------------------------------------------------- labels
def probability_label(p: float) -> str:
    """A probability tick label: ``1e-8``, ``1e-3``, ``0.01``, ``0.5``, ``0.999``, ``1``.

    Example:
        >>> [probability_label(p) for p in (1e-8, 1e-3, 0.01, 0.5, 0.999, 1.0)]
        ['1e-8', '1e-3', '0.01', '0.5', '0.999', '1']
    """
    if p >= 0.01 or p <= 0:
        return f"{p:g}"
    exponent = math.floor(math.log10(p) + 1e-9)
    mantissa = p / 10.0**exponent
    head = f"{mantissa:.0f}" if abs(mantissa - round(mantissa)) < 1e-6 else f"{mantissa:.2g}"
    return f"{head}e{exponent}"


def count_label(count: float) -> str:
    """A token count, short: ``7``, ``950``, ``12k``, ``1.5M`` (k = 1000).

    Example:
        >>> [count_label(n) for n in (7, 950, 1000, 12_345, 1_500_000)]
        ['7', '950', '1k', '12k', '1.5M']
    """
    for unit, scale in (("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if count >= scale:
            digits = ".2g" if count < 10 * scale else ".0f"
            return f"{count / scale:{digits}}{unit}"
    return f"{count:.0f}"


def position_label(position: int) -> str:
    """A position tick label: ``0``, ``512``, ``1k``, ``4k``, ``1M`` (k = 1024).

    Example:
        >>> [position_label(n) for n in (0, 1, 512, 1024, 4096, 2**20)]
        ['0', '1', '512', '1k', '4k', '1M']
    """
    if position >= 2**20:
        return f"{position / 2**20:g}M"
    if position >= 2**10:
        return f"{position / 2**10:g}k"
    return str(position)


# ---------------------------------------------------------------------- line plots
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
        width, _ = _text_size(name, _LABEL_SIZE)
        _put(image, name, x, 15, size=_LABEL_SIZE, anchor="rm")
        x -= width + 5
        draw.line([(x - 16, 15), (x, 15)], fill=_INK[colour], width=2)
        draw.ellipse([(x - 10, 13), (x - 6, 17)], fill=_INK[colour])
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
    image = _blank(_VIRIDIS_START)
    draw = ImageDraw.Draw(image)
    slots = len(tokens)
    slot_px = (_RIGHT - _LEFT) / slots

    def x_of(coordinate: float) -> float:
        return _LEFT + coordinate * slot_px

    low, high = _decade_range(series)

    def y_of(log_value: float) -> float:
        return _MAIN_BOTTOM - (log_value - low) / (high - low) * (_MAIN_BOTTOM - _TOP)

    _put(image, title, 8, 15, size=_TITLE_SIZE, anchor="lm")
    _legend(image, draw, names)

    # Grid and y ticks of the main axes.
    for mark, label in _y_ticks(low, high):
        y = round(y_of(mark))
        draw.line([(_LEFT + 1, y), (_RIGHT - 1, y)], fill=_INK[_GRID])
        draw.line([(_LEFT - 3, y), (_LEFT, y)], fill=_INK[_FRAME])
        _put(image, label, _LEFT - 5, y, anchor="rm")
    _put(
        image,
        "mean (log scale)",
        6,
        (_TOP + _MAIN_BOTTOM) / 2,
        size=_LABEL_SIZE,
        anchor="lm",
        rotate=True,
    )
    if not any(value > 0 for values in series for value in values):
        _put(
            image,
            "every mean is 0 (triangles on the bottom edge)",
            (_LEFT + _RIGHT) / 2,
            (_TOP + _MAIN_BOTTOM) / 2,
            size=_LABEL_SIZE,
            anchor="mm",
            colour=_MUTED,
        )

    # Token counts: log-scaled bars, at least 2 px for a single token.
    most = max(tokens)
    strip = _STRIP_BOTTOM - _STRIP_TOP - 2
    half_bar = max(1.0, 0.35 * slot_px)
    for i, count in enumerate(tokens):
        if count < 1:
            continue
        share = math.log(count) / math.log(most) if most > 1 else 1.0
        top = _STRIP_BOTTOM - 2 - share * (strip - 2)
        middle = x_of(i + 0.5)
        draw.rectangle(
            [(round(middle - half_bar), round(top)), (round(middle + half_bar) - 1, _STRIP_BOTTOM)],
            fill=_INK[TOKEN_BAR_COLOUR],
        )
    _put(image, count_label(most), _LEFT - 5, _STRIP_TOP, anchor="rt", colour=_MUTED)
    if most >= 2:
        _put(image, "1", _LEFT - 5, _STRIP_BOTTOM, anchor="rb", colour=_MUTED)
    _put(
        image,
        "tokens",
        6,
        (_STRIP_TOP + _STRIP_BOTTOM) / 2,
        size=_TICK_SIZE,
        anchor="lm",
        colour=_MUTED,
        rotate=True,
    )

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
                draw.line(run, fill=_INK[colour], width=2, joint="curve")
            run = []
            if math.isfinite(value):
                x, y = x + 4 * number - 2, _MAIN_BOTTOM - 1
                draw.polygon([(x - 3, y - 5), (x + 3, y - 5), (x, y)], fill=_INK[colour])
        if len(run) > 1:
            draw.line(run, fill=_INK[colour], width=2, joint="curve")
        for x, y in dots:
            draw.ellipse([(x - 2.5, y - 2.5), (x + 2.5, y + 2.5)], fill=_INK[colour])

    # Frames, x ticks (a label only where it does not run into the previous one).
    draw.rectangle([(_LEFT, _TOP), (_RIGHT, _MAIN_BOTTOM)], outline=_INK[_FRAME])
    draw.line([(_LEFT, _STRIP_BOTTOM), (_RIGHT, _STRIP_BOTTOM)], fill=_INK[_FRAME])
    draw.line([(_LEFT, _STRIP_TOP), (_LEFT, _STRIP_BOTTOM)], fill=_INK[_FRAME])
    free_from = -math.inf
    for coordinate, label in x_ticks:
        x = round(x_of(coordinate))
        width, _ = _text_size(label, _TICK_SIZE)
        left = min(x - width / 2, _RIGHT + 6 - width)
        draw.line([(x, _STRIP_BOTTOM), (x, _STRIP_BOTTOM + 3)], fill=_INK[_FRAME])
        draw.line([(x, _MAIN_BOTTOM), (x, _MAIN_BOTTOM + 3)], fill=_INK[_FRAME])
        if left >= free_from:
            _put(image, label, left, _STRIP_BOTTOM + 4)
            free_from = left + width + 3
    _put(image, x_label, (_LEFT + _RIGHT) / 2, _STRIP_BOTTOM + 21, size=_LABEL_SIZE, anchor="mt")
    return image


def by_position_picture(profile: Profile) -> np.ndarray | None:
    """Mean ``|pa - pb|`` and mean k3 by response position, with the tokens per bucket.

    One slot per position bucket ``[0, 1), [1, 2), [2, 4), ...`` (so the x axis is log2),
    labelled by its first position (``1k`` = 1024); ``None`` for an empty profile.

    Example:
        >>> import torch
        >>> from lightning_rollout_debug.extras import TokenExtras
        >>> extras = TokenExtras(histograms=False, worst_tokens_k=0, profile=True,
        ...                      compile=False)
        >>> old = torch.full((2, 100), -0.5)
        >>> extras.update(old + torch.linspace(0, 0.1, 100), old, torch.ones(2, 100))
        >>> by_position_picture(extras.summary(extras.state).profile).shape
        (320, 480, 3)
    """
    return _rgb(_by_position(profile))


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

    One slot per bucket ``[2**-(k+1), 2**-k)`` from ``2**-29`` to 1 (the x axis is log2,
    ticks at probabilities), with the tokens per bucket; ``None`` for an empty profile.

    Example:
        >>> import torch
        >>> from lightning_rollout_debug.extras import TokenExtras
        >>> extras = TokenExtras(histograms=False, worst_tokens_k=0, profile=True,
        ...                      compile=False)
        >>> old = torch.log(torch.linspace(1e-6, 1, 64)).reshape(1, 64)
        >>> extras.update(old + 0.01, old, torch.ones(1, 64))
        >>> by_probability_picture(extras.summary(extras.state).profile).shape
        (320, 480, 3)
    """
    return _rgb(_by_probability(profile))


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
        "trainer probability pa (buckets [p, 2p))",
    )


# ---------------------------------------------------------------------- heatmap
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


def _colour_bar(
    image: Image.Image, draw: ImageDraw.ImageDraw, left: int, side: int, most: float
) -> None:
    """A vertical viridis bar from count 0 to ``most`` on the ``log(1 + count)`` scale.

    It ends level with the bottom of the heatmap (of ``side`` pixels), below its label.
    """
    top, bottom = _JOINT_TOP + 20, _JOINT_TOP + side
    height = bottom - top
    ramp = _VIRIDIS_START + np.linspace(HEAT_SHADES - 1, 0, height).round().astype(np.uint8)
    image.paste(_index_image(np.repeat(ramp[:, None], 10, 1)), (left, top))
    draw.rectangle([(left - 1, top - 1), (left + 10, bottom)], outline=_INK[_FRAME])
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
        draw.line([(left + 10, round(y)), (left + 13, round(y))], fill=_INK[_FRAME])
        _put(image, count_label(count), left + 16, y, anchor="lm")
        free_above = y - 6
    _put(image, "tokens", left - 1, _JOINT_TOP, anchor="lt", colour=_MUTED)


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
        >>> from lightning_rollout_debug.extras import TokenExtras
        >>> extras = TokenExtras(histograms=False, worst_tokens_k=0, profile=True,
        ...                      compile=False)
        >>> old = torch.log(torch.rand(4, 64, generator=torch.Generator().manual_seed(0)))
        >>> extras.update(old, old, torch.ones(4, 64))
        >>> joint_picture(extras.summary(extras.state).profile).shape
        (320, 480, 3)
    """
    return _rgb(_joint(profile))


def _joint(profile: Profile) -> Image.Image | None:
    if profile.tokens < 1:
        return None
    joint = profile.joint_histogram
    counts = np.asarray(joint.counts, dtype=np.float64)
    shown = joint_shown_bins(joint.edges)
    cells = counts[shown.start :, shown.start :][::-1]  # top row: the highest trainer bin
    side = len(shown) * JOINT_CELL_PX

    most = max(float(counts.max()), 1.0)
    # Index into _HEAT_INKS: 0 for an empty cell, 1 (one token) to HEAT_SHADES (the fullest).
    shade = np.rint(np.log1p(cells) * ((HEAT_SHADES - 1) / math.log1p(most))).astype(np.intp) + 1
    shade[cells <= 0] = 0
    heat = _index_image(_HEAT_INKS[shade]).resize((side, side), Image.Resampling.NEAREST)
    # The diagonal, faint, through the empty cells on it.
    on_diagonal = ImageDraw.Draw(heat)
    for k in np.flatnonzero(np.diagonal(counts[shown.start :, shown.start :]) <= 0).tolist():
        x, y = k * JOINT_CELL_PX, side - 1 - k * JOINT_CELL_PX
        on_diagonal.line(
            [(x, y), (x + JOINT_CELL_PX - 1, y - JOINT_CELL_PX + 1)], _INK[DIAGONAL_COLOUR]
        )

    image = _blank()
    draw = ImageDraw.Draw(image)
    image.paste(heat, (_JOINT_LEFT, _JOINT_TOP))
    left, top = _JOINT_LEFT, _JOINT_TOP
    right, bottom = left + side, top + side
    draw.rectangle([(left - 1, top - 1), (right, bottom)], outline=_INK[_FRAME])

    _put(
        image,
        "Tokens by trainer and rollout probability: log(1 + count)",
        8,
        15,
        size=_TITLE_SIZE,
        anchor="lm",
    )
    for p in _JOINT_TICKS:
        at = _joint_coordinate(joint.edges, p) * JOINT_CELL_PX
        y = round(bottom - at)
        draw.line([(left - 4, y), (left - 1, y)], fill=_INK[_FRAME])
        _put(image, probability_label(p), left - 6, y, anchor="rm")
        if p in _JOINT_X_TICKS:
            x = round(left + at)
            draw.line([(x, bottom), (x, bottom + 3)], fill=_INK[_FRAME])
            _put(image, probability_label(p), x, bottom + 4, anchor="mt")
    _put(
        image,
        "rollout probability pb",
        (left + right) / 2,
        bottom + 21,
        size=_LABEL_SIZE,
        anchor="mt",
    )
    _put(
        image,
        "trainer probability pa",
        6,
        (top + bottom) / 2,
        size=_LABEL_SIZE,
        anchor="lm",
        rotate=True,
    )
    _colour_bar(image, draw, right + 16, side, most)

    total = float(counts.sum())
    rows = [
        ("tokens", count_label(total)),
        ("same bin", f"{np.trace(counts) / total:.1%}"),
        ("pa > pb", f"{np.tril(counts, -1).sum() / total:.1%}"),
        ("pa < pb", f"{np.triu(counts, 1).sum() / total:.1%}"),
    ]
    x = right + 72
    for k, (name, value) in enumerate(rows):
        y = top + 8 + 18 * k
        _put(image, name, x, y, anchor="lm", colour=_MUTED)
        _put(image, value, WIDTH - 10, y, anchor="rm")
    _put(image, "pa > pb: above the", x, top + 86, anchor="lm", colour=_MUTED)
    _put(image, "diagonal (trainer", x, top + 100, anchor="lm", colour=_MUTED)
    _put(image, "more confident)", x, top + 114, anchor="lm", colour=_MUTED)
    return image


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
    ("joint", _joint),
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
