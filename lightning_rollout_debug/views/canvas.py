"""The canvas of the profile pictures: palette, blank images, text, tick labels, PNG.

The pictures (:mod:`.pictures`) are drawn at every logged step, so they are plain Pillow
drawings (lines, rectangles, a NumPy heatmap) in 8-bit palette images ("P" mode) of
``WIDTH x HEIGHT`` with one fixed :data:`PALETTE`: the interface colours, the
anti-aliasing shades of the text on the background, and viridis. A picture is a byte per
pixel, and its PNG (:func:`encode_png`, Pillow's) holds those bytes and the palette.
Every piece of text is rendered once and kept (:func:`put_text`): tick labels, titles
and legends repeat from step to step; the tick labels are formatted by
:func:`probability_label`, :func:`count_label` and :func:`position_label`.

TensorBoard shows a picture scaled to its card: 350 px wide on the Images tab, and at most
about 214 px high on the Time Series tab (:data:`SHOWN_WIDTH`, :data:`SHOWN_HEIGHT`). The
pictures are drawn at ``WIDTH x HEIGHT`` with text of :data:`TEXT_SIZES` (Pillow's
built-in TrueType font, at least :data:`MIN_TEXT_SIZE` pixels), so that their smallest
text still shows 10 px high there, and at full size where TensorBoard shows the actual
size.

Example:
    >>> image = blank_image()
    >>> put_text(image, probability_label(1e-3), 10, 10)
    >>> (image.mode, image.size, len(encode_png(image)) > 0)
    ('P', (800, 480), True)
"""

from __future__ import annotations

import functools
import io
import math
from collections.abc import Sequence

import numpy as np
from PIL import Image, ImageChops, ImageDraw, ImageFont

WIDTH = 800
"""Width of every picture, in pixels."""

HEIGHT = 480
"""Height of every picture, in pixels."""

SHOWN_WIDTH = 350
"""The width TensorBoard's Images tab shows a picture at (its card's, without "Show actual
image size"): a picture is scaled by ``SHOWN_WIDTH / WIDTH`` there."""

SHOWN_HEIGHT = 214
"""The height a Time Series card of the default size shows a picture at, at most: a picture
is scaled by ``min(width of the card / WIDTH, SHOWN_HEIGHT / HEIGHT)`` there."""

RGB = tuple[int, int, int]

BACKGROUND: RGB = (255, 255, 255)
"""The background, also the colour of an empty cell of the heatmap."""

SERIES_COLOURS: tuple[RGB, RGB] = ((31, 119, 180), (230, 97, 1))
"""The two series of the profile pictures: blue, then orange."""

TOKEN_BAR_COLOUR: RGB = (205, 205, 205)
"""The bars of the token counts."""

DIAGONAL_COLOUR: RGB = (200, 200, 200)
"""The heatmap's diagonal, drawn where no cell is coloured."""

TEXT_COLOUR: RGB = (30, 30, 30)
"""Titles, tick labels and values."""

MUTED_COLOUR: RGB = (105, 105, 105)
"""Secondary text: axis names of the token counts, notes."""

FRAME_COLOUR: RGB = (120, 120, 120)
"""Frames of the axes and tick marks."""

GRID_COLOUR: RGB = (234, 234, 234)
"""Grid lines of the line plots."""

RULE_PX = 3
"""Width of the frames, grid lines and tick marks: at least ``WIDTH / SHOWN_WIDTH`` pixels,
so that TensorBoard's nearest-neighbour scaling keeps every one."""

TITLE_SIZE, LABEL_SIZE, TICK_SIZE = 28, 24, 24
"""Text sizes in pixels: titles; axis names, legends and captions; tick labels and values."""

TEXT_SIZES = (TITLE_SIZE, LABEL_SIZE, TICK_SIZE)
"""Every text size the pictures use."""

MIN_TEXT_SIZE = math.ceil(10 * WIDTH / SHOWN_WIDTH)
"""The smallest text :func:`put_text` draws, in pixels: 10 px on the Images tab (23 px, with
capitals of 16 px, at full size)."""

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
    TEXT_COLOUR,
    MUTED_COLOUR,
    FRAME_COLOUR,
    GRID_COLOUR,
)

INK = {colour: index for index, colour in enumerate(_UI_COLOURS)}
"""The palette index of each interface colour."""

TEXT_LEVELS = 16
"""Steps of the text's anti-aliasing: a glyph pixel of coverage ``a`` (0 to 1) is drawn
``round(a * TEXT_LEVELS) / TEXT_LEVELS`` of the way from the background to the text colour."""

_TEXT_COLOURS = (TEXT_COLOUR, MUTED_COLOUR)

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

VIRIDIS_START = 256 - HEAT_SHADES
"""The palette index of the first viridis shade: the entries below it are the line plots'."""

# Palette index by coverage level (0 to TEXT_LEVELS), for each text colour.
_TEXT_INKS = {
    colour: np.array(
        [INK[BACKGROUND], *range(start, start + TEXT_LEVELS - 1), INK[colour]], dtype=np.uint8
    )
    for colour, start in (
        (colour, len(_UI_COLOURS) + k * (TEXT_LEVELS - 1)) for k, colour in enumerate(_TEXT_COLOURS)
    )
}

HEAT_INKS = np.array([INK[BACKGROUND], *range(VIRIDIS_START, 256)], dtype=np.uint8)
"""Palette index of a heatmap cell by shade + 1: the background for an empty cell (0)."""

_PALETTE_BYTES = PALETTE.tobytes()


def blank_image(colours: int = 256) -> Image.Image:
    """A new picture: the background, in "P" mode with the first ``colours`` of :data:`PALETTE`.

    A PNG holds as many palette entries as its image has: a picture without the heatmap's
    colours leaves them out.
    """
    image = Image.new("P", (WIDTH, HEIGHT), INK[BACKGROUND])
    image.putpalette(_PALETTE_BYTES[: 3 * colours])
    return image


def index_image(indices: np.ndarray) -> Image.Image:
    """A "P" image of the palette indices in the 2-D uint8 array ``indices``."""
    height, width = indices.shape
    return Image.frombytes("P", (width, height), np.ascontiguousarray(indices).tobytes())


def rgb_array(image: Image.Image | None) -> np.ndarray | None:
    """The picture as a read-only ``HEIGHT x WIDTH x 3`` uint8 RGB array."""
    return None if image is None else np.asarray(image.convert("RGB"))


PNG_COMPRESS_LEVEL = 3
"""zlib's level for the pictures' PNGs (a few KB each): about as fast as level 1, smaller."""


def encode_png(image: Image.Image) -> bytes:
    """The picture as a PNG (Pillow's encoder): a palette PNG of a "P" picture."""
    buffer = io.BytesIO()
    image.save(buffer, format="PNG", compress_level=PNG_COMPRESS_LEVEL)
    return buffer.getvalue()


# ---------------------------------------------------------------------- text
@functools.lru_cache(maxsize=8)
def _font(size: int) -> ImageFont.FreeTypeFont | ImageFont.ImageFont:
    """Pillow's built-in font at ``size`` pixels; its one bitmap font without FreeType."""
    try:
        return ImageFont.load_default(size=size)
    except ImportError:  # a Pillow built without FreeType: a size needs it
        return ImageFont.load_default()


@functools.lru_cache(maxsize=8)
def _line_height(size: int) -> int:
    return int(_font(size).getbbox("Ag|y")[3]) + 1


HALO = 0.5
"""The coverage of the 1-px outline around every glyph, against the glyph's own 1: strokes
about 3 px wide, which TensorBoard's nearest-neighbour scaling of a picture to its card
(``image-rendering: pixelated``) keeps, where it drops pixels of the font's own 2 px."""


@functools.lru_cache(maxsize=2048)
def _text_mask(text: str, size: int, rotate: bool) -> Image.Image:
    """The text as an ``L`` mask, one line high with a pixel either side, and its :data:`HALO`.

    Turned to read upwards with ``rotate``.
    """
    font = _font(size)
    box = (max(1, math.ceil(font.getlength(text))) + 2, _line_height(size) + 2)
    mask = Image.new("L", box, 0)
    ImageDraw.Draw(mask).text((1, 1), text, fill=255, font=font)
    if isinstance(font, ImageFont.FreeTypeFont):  # a bitmap font draws no outline
        halo = Image.new("L", box, 0)
        ImageDraw.Draw(halo).text((1, 1), text, fill=round(255 * HALO), font=font, stroke_width=1)
        mask = ImageChops.lighter(mask, halo)
    return mask.transpose(Image.Transpose.ROTATE_90) if rotate else mask


@functools.lru_cache(maxsize=2048)
def _text_stamp(text: str, size: int, rotate: bool, colour: RGB) -> tuple[Image.Image, Image.Image]:
    """The text as a "P" image of its colour's shades on the background, and its ``1`` mask.

    The mask holds the pixels of coverage ``1 / (2 * TEXT_LEVELS)`` or more (the stamp
    replaces them); the others keep what is under the text.
    """
    coverage = np.asarray(_text_mask(text, size, rotate), dtype=np.int32)
    levels = (coverage * TEXT_LEVELS + 127) // 255
    return index_image(_TEXT_INKS[colour][levels]), Image.fromarray(levels > 0)


def text_size(text: str, size: int) -> tuple[int, int]:
    """The ``(width, height)`` in pixels of ``text`` at ``size``, unrotated, one line high.

    A pixel either side of the glyphs included, for their outline (:data:`HALO`).
    """
    return _text_mask(text, size, False).size


def put_text(
    image: Image.Image,
    text: str,
    x: float,
    y: float,
    *,
    size: int = TICK_SIZE,
    colour: RGB = TEXT_COLOUR,
    anchor: str = "lt",
    rotate: bool = False,
) -> None:
    """Paint ``text`` in ``colour`` with its box anchored at ``(x, y)``.

    ``colour`` is ``TEXT_COLOUR`` or ``MUTED_COLOUR``. ``anchor`` is ``l``, ``m`` or ``r``
    (left, middle, right), then ``t``, ``m`` or ``b`` (top, middle, bottom). A ``size``
    below :data:`MIN_TEXT_SIZE` is refused (``ValueError``).
    """
    if size < MIN_TEXT_SIZE:
        raise ValueError(f"text of {size} px is below the pictures' {MIN_TEXT_SIZE} px")
    stamp, mask = _text_stamp(text, size, rotate, colour)
    width, height = stamp.size
    left = x - {"l": 0.0, "m": width / 2, "r": width}[anchor[0]]
    top = y - {"t": 0.0, "m": height / 2, "b": height}[anchor[1]]
    image.paste(stamp, (round(left), round(top)), mask)


CAPTION_LAST_TOP, CAPTION_STEP = 440, 30
"""The top of a picture's last caption line, and the step from one line to the next."""


def put_caption(image: Image.Image, lines: Sequence[str]) -> None:
    """The caption's lines below the axes, muted, the last at :data:`CAPTION_LAST_TOP`."""
    for k, line in enumerate(lines):
        top = CAPTION_LAST_TOP - (len(lines) - 1 - k) * CAPTION_STEP
        put_text(image, line, 12, top, size=LABEL_SIZE, colour=MUTED_COLOUR)


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
