"""The profile pictures read at TensorBoard's size: their size and text, fitted axes, told-apart
series, and the words on them.

TensorBoard shows a picture scaled to its card (350 px wide on the Images tab); the
pictures are drawn large enough, with text large enough, to read there. Profiles come from
real batches through ``TokenExtras``; text is found in the pictures pixel for pixel, as
the canvas renders it.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from PIL import ImageFont
from test_pictures import bar_height, is_colour, profile_of, realistic, slot_centre

from lightning_rollout_debug.metrics.profile import JOINT_EDGES, PROBABILITY_BUCKETS
from lightning_rollout_debug.metrics.tokens import LOG_PROB_FLOOR
from lightning_rollout_debug.views import canvas, line_plot
from lightning_rollout_debug.views.heatmap import JOINT_CAPTION, joint_cell_px
from lightning_rollout_debug.views.pictures import (
    BACKGROUND,
    HEIGHT,
    PICTURES,
    PLOT_BOX,
    POSITION_PLOT,
    PROBABILITY_PLOT,
    SERIES_COLOURS,
    SERIES_STYLES,
    TOKEN_STRIP_BOX,
    VIRIDIS,
    WIDTH,
    by_position_picture,
    by_probability_picture,
    joint_cell_box,
    joint_picture,
    joint_shown_bins,
    probability_range,
    profile_pictures,
)


# ---------------------------------------------------------------------- text in a picture
def text_template(text: str, size: int, colour: tuple[int, int, int], rotate: bool) -> np.ndarray:
    """The RGB pixels ``put_text`` paints for ``text``, on the background."""
    image = canvas.blank_image()
    canvas.put_text(image, text, 0, 0, size=size, colour=colour, rotate=rotate)
    width, height = canvas.text_size(text, size)
    if rotate:
        width, height = height, width
    return np.asarray(image.convert("RGB"))[:height, :width]


def holds_text(
    picture: np.ndarray,
    text: str,
    size: int = canvas.LABEL_SIZE,
    colour: tuple[int, int, int] = canvas.TEXT_COLOUR,
    rotate: bool = False,
) -> bool:
    """Whether ``text`` is painted somewhere in ``picture``: every pixel of its glyphs."""
    template = text_template(text, size, colour, rotate)
    dys, dxs = np.nonzero(~is_colour(template, BACKGROUND))
    assert dys.size, text
    inks = template[dys, dxs]
    for y, x in zip(*np.nonzero(is_colour(picture, tuple(inks[0].tolist()))), strict=True):
        top, left = y - dys[0], x - dxs[0]
        if top < 0 or left < 0 or top + template.shape[0] > picture.shape[0]:
            continue
        if left + template.shape[1] > picture.shape[1]:
            continue
        if np.array_equal(picture[top + dys, left + dxs], inks):
            return True
    return False


def ink_rows(band: np.ndarray, colour: tuple[int, int, int]) -> int:
    """How many rows of ``band`` hold a pixel of ``colour``."""
    return int(np.any(is_colour(band, colour), axis=1).sum())


# ---------------------------------------------------------------------- size and text
def test_every_picture_is_at_least_800_px_wide() -> None:
    pictures = profile_pictures(realistic(0))
    assert list(pictures) == [name for name, _ in PICTURES]
    for name, picture in pictures.items():
        assert picture.shape[1] >= 800 and picture.shape == (HEIGHT, WIDTH, 3), name


def test_text_is_a_truetype_font_of_at_least_14_px_and_10_px_on_tensorboards_card() -> None:
    """Every size the pictures write text in: Pillow's TrueType font at that pixel size, at
    least 14 px, and at least 10 px once TensorBoard scales the picture to its card (350 px
    wide on the Images tab, at most 214 px high on a Time Series card)."""
    shown = min(canvas.SHOWN_WIDTH / WIDTH, canvas.SHOWN_HEIGHT / HEIGHT)
    assert canvas.SHOWN_WIDTH == 350 and canvas.MIN_TEXT_SIZE >= 14
    for size in canvas.TEXT_SIZES:
        font = canvas._font(size)
        assert isinstance(font, ImageFont.FreeTypeFont) and font.size == size
        assert size >= canvas.MIN_TEXT_SIZE and size * shown >= 10, size
        # Measured from the rendered text: the full-ink rows of a capital.
        image = canvas.blank_image()
        canvas.put_text(image, "H", 0, 0, size=size)
        assert ink_rows(np.asarray(image.convert("RGB")), canvas.TEXT_COLOUR) >= 14, size
    with pytest.raises(ValueError, match="below"):
        canvas.put_text(canvas.blank_image(), "small", 0, 0, size=canvas.MIN_TEXT_SIZE - 1)


def test_the_pictures_text_is_rendered_at_least_14_px_tall() -> None:
    """In the pictures themselves: the digits of the x tick labels, the smallest text."""
    profile = realistic(1)
    for draw in (by_position_picture, by_probability_picture):
        picture = draw(profile)
        assert picture is not None
        _, _, right, bottom = TOKEN_STRIP_BOX
        _, line_height = canvas.text_size("0", canvas.TICK_SIZE)
        labels = picture[bottom + 5 : bottom + 5 + line_height, : right + 1]  # below the ticks
        assert ink_rows(labels, canvas.TEXT_COLOUR) >= 14


# ---------------------------------------------------------------------- fitted axes
def bucket_of(p: float) -> int:
    """The bucket ``(2**-(k+1), 2**-k]`` of a trainer probability, as the profile numbers them
    (0 the lowest, ``PROBABILITY_BUCKETS - 1`` for ``(1/2, 1]``)."""
    k = math.floor(-math.log2(p))
    return PROBABILITY_BUCKETS - 1 - k


@pytest.mark.parametrize(
    "probabilities",
    [(3e-4, 1e-3, 0.02, 0.1), (0.3, 0.6, 0.97), (2e-6,)],
    ids=["middle", "at one", "one bucket"],
)
def test_the_probability_axis_spans_the_occupied_buckets_and_one_more(
    probabilities: tuple[float, ...],
) -> None:
    old = torch.log(torch.tensor(probabilities, dtype=torch.float64)).float().repeat(4, 8)
    profile = profile_of(old - 0.01, old, torch.ones_like(old))
    occupied = [bucket_of(p) for p in probabilities]
    expected = range(min(occupied) - 1, min(max(occupied) + 2, PROBABILITY_BUCKETS))
    assert probability_range(profile) == expected

    picture = by_probability_picture(profile)
    assert picture is not None
    slots = len(expected)
    # The token bars stand where the occupied buckets are on the fitted axis, and nowhere else.
    with_tokens = [i for i in range(slots) if bar_height(picture, slots, i) > 0]
    assert with_tokens == sorted({bucket - expected.start for bucket in occupied})
    assert 0 not in with_tokens  # one empty bucket of margin below


def joint_bin(log_prob: float) -> int:
    """The joint histogram's bin of a log-prob: ``(edges[i-1], edges[i]]`` is bin ``i``."""
    return sum(edge < max(log_prob, LOG_PROB_FLOOR) for edge in JOINT_EDGES)


def test_the_heatmap_spans_the_occupied_bins_and_one_more() -> None:
    pairs = [(0.9, 0.9), (0.95, 0.8), (0.5, 0.6), (0.99, 0.99)]  # (trainer, rollout)
    old = torch.log(torch.tensor([[a for a, _ in pairs]]))
    rollout = torch.log(torch.tensor([[b for _, b in pairs]]))
    profile = profile_of(rollout, old, torch.ones_like(old))
    bins = [joint_bin(math.log(p)) for pair in pairs for p in pair]
    expected = range(min(bins) - 1, max(bins) + 2)
    counts = profile.joint_counts
    assert joint_shown_bins(counts) == expected

    picture = joint_picture(profile)
    assert picture is not None
    viridis = {tuple(colour) for colour in VIRIDIS.tolist()}
    every_bin = joint_shown_bins(np.ones_like(counts))  # the heatmap of a full histogram
    for a, b in pairs:
        trainer, rollout = joint_bin(math.log(a)), joint_bin(math.log(b))
        left, top, right, bottom = joint_cell_box(expected, trainer, rollout)
        assert right - left == bottom - top > joint_cell_px(every_bin)  # cells grown to fit
        cell = picture[top:bottom, left:right]
        assert tuple(cell[1, 1].tolist()) in viridis and (cell == cell[1, 1]).all()


# ---------------------------------------------------------------------- series told apart
def test_the_series_differ_in_colour_marker_and_line() -> None:
    first, second = SERIES_STYLES
    assert (first.colour, second.colour) == SERIES_COLOURS
    assert first.marker != second.marker and first.dash != second.dash
    assert first.radius > second.radius  # drawn first, behind the smaller marks


def test_both_series_show_where_their_means_coincide() -> None:
    """Confident tokens: ``|pa - pb|`` and ``|a - b|`` agree to 0.5%, so the two marks of the
    top bucket sit on the same pixel; the smaller diamond shows inside the larger circle."""
    old = torch.full((4, 16), math.log(0.9999))
    profile = profile_of(old - 0.01, old, torch.ones_like(old))
    bucket = profile.by_probability[-1]
    assert bucket.tokens == 64
    assert bucket.probs_diff_mean == pytest.approx(bucket.log_probs_diff_mean, rel=6e-3)
    picture = by_probability_picture(profile)
    assert picture is not None
    shown = probability_range(profile)
    x = slot_centre(len(shown), PROBABILITY_BUCKETS - 1 - shown.start)
    _, top, _, bottom = PLOT_BOX
    around = picture[top + 1 : bottom - 1, x - 12 : x + 13]
    blue, orange = (np.nonzero(is_colour(around, colour)) for colour in SERIES_COLOURS)
    assert blue[0].size >= 30 and orange[0].size >= 30
    # The orange diamond inside the blue circle, the circle's rim around it.
    assert blue[0].min() < orange[0].min() and orange[0].max() < blue[0].max()
    assert blue[1].min() < orange[1].min() and orange[1].max() < blue[1].max()


def test_the_second_series_line_is_dashed_the_first_solid() -> None:
    plot = line_plot.LinePlot("t", ("one", "two"), ((0.5, "a"),), "x", ("caption",))
    image = line_plot.series_picture(plot, ([2e-3] * 4, [2e-2] * 4), [5.0] * 4)
    picture = np.asarray(image.convert("RGB"))
    # Between the marks of the second and third buckets, on each series' row.
    start, stop = slot_centre(4, 1) + 12, slot_centre(4, 2) - 12
    for colour, dashed in zip(SERIES_COLOURS, (False, True), strict=True):
        rows = is_colour(picture, colour)[:, start:stop]
        row = rows[int(np.argmax(rows.sum(axis=1)))]
        assert row.any() and (not row.all()) == dashed, colour


# ---------------------------------------------------------------------- words
def test_axis_names_and_captions_say_what_pa_pb_buckets_and_k_are() -> None:
    assert POSITION_PLOT.x_label == "position in the response"
    assert PROBABILITY_PLOT.x_label.startswith("trainer probability")
    for caption in (POSITION_PLOT.caption, PROBABILITY_PLOT.caption, JOINT_CAPTION):
        assert caption[0].startswith("pa, pb: ") and "trainer" in caption[0]
        assert "rollout" in caption[0]
    assert "bucket n: positions n to 2n - 1" in POSITION_PLOT.caption[1]
    assert "1k = 1024" in POSITION_PLOT.caption[1]
    assert "bucket: the tokens with pa in (p/2, p]" in PROBABILITY_PLOT.caption[1]
    assert "cells: 4 per doubling of -log p" in JOINT_CAPTION[0]


def test_the_axis_names_and_captions_are_on_the_pictures() -> None:
    profile = realistic(2)
    pictures = profile_pictures(profile)
    muted = canvas.MUTED_COLOUR
    for name, plot in (("by_position", POSITION_PLOT), ("by_probability", PROBABILITY_PLOT)):
        picture = pictures[name]
        assert holds_text(picture, plot.title, canvas.TITLE_SIZE), name
        assert holds_text(picture, plot.x_label), name
        assert holds_text(picture, "mean (log scale)", rotate=True), name
        for line in plot.caption:
            assert holds_text(picture, line, colour=muted), (name, line)
        for series in plot.names:
            assert holds_text(picture, series), (name, series)
    joint = pictures["joint"]
    assert holds_text(joint, "rollout probability pb")
    assert holds_text(joint, "trainer probability pa", rotate=True)
    assert holds_text(joint, JOINT_CAPTION[0], colour=muted)
    # and not anywhere: a string the pictures do not hold is not found.
    assert not holds_text(joint, "position in the response")
