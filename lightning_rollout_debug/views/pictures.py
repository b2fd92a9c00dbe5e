"""Pictures of a window's mismatch profile, for TensorBoard's Images page.

Three pictures of a :class:`~lightning_rollout_debug.metrics.profile.Profile`, as
``HEIGHT x WIDTH x 3`` uint8 RGB arrays (read-only), or as PNGs (:func:`profile_pngs`):

* :func:`by_position_picture`: mean ``|pa - pb|`` and mean k3 of each position bucket
  ``[0, 1), [1, 2), [2, 4), ...`` (log y axis), above a strip of the token counts;
* :func:`by_probability_picture`: mean ``|pa - pb|`` and mean ``|a - b|`` of each bucket
  ``(p/2, p]`` of the trainer's probability ``pa``, over the occupied buckets and one
  more on either side (:func:`probability_range`), above the token counts;
* :func:`joint_picture` (:mod:`.heatmap`): a heatmap of ``log(1 + count)`` over (rollout
  probability, trainer probability) bins, ``p = 1`` at the top right, with the diagonal
  where the two agree, over the occupied bins and one more on either side.

Each picture names its axes in words and says in a caption below them what ``pa`` and
``pb`` are and what a bucket (or cell) holds. This module holds the text of the two line
plots (:data:`POSITION_PLOT`, :data:`PROBABILITY_PLOT`) and the entry points
(:data:`PICTURES`, :func:`profile_images`, :func:`profile_pictures`,
:func:`profile_pngs`); the line plots are drawn by :mod:`.line_plot`, on the palette,
text and PNG encoding of :mod:`.canvas`, and the names of all three that the pictures'
users need are importable from here too. An empty profile (no token counted) has no
picture: each function returns ``None``.

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
    {'by_position': ((480, 800, 3), 'uint8'), 'by_probability': ((480, 800, 3), 'uint8'), 'joint': ((480, 800, 3), 'uint8')}
    >>> pngs = profile_pngs(extras.summary(extras.state).profile)
    >>> {name: Image.open(io.BytesIO(png)).mode for name, png in pngs.items()}
    {'by_position': 'P', 'by_probability': 'P', 'joint': 'P'}
"""  # noqa: E501

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable

import numpy as np
from PIL import Image

from lightning_rollout_debug.metrics.profile import PROBABILITY_BUCKETS, Profile
from lightning_rollout_debug.views.canvas import (
    BACKGROUND,
    DIAGONAL_COLOUR,
    HEAT_SHADES,
    HEIGHT,
    PALETTE,
    PNG_COMPRESS_LEVEL,
    SERIES_COLOURS,
    TEXT_LEVELS,
    TOKEN_BAR_COLOUR,
    VIRIDIS,
    WIDTH,
    count_label,
    encode_png,
    position_label,
    probability_label,
    rgb_array,
)
from lightning_rollout_debug.views.heatmap import (
    JOINT_CAPTION,
    joint_cell_box,
    joint_image,
    joint_picture,
    joint_shown_bins,
)
from lightning_rollout_debug.views.line_plot import (
    PLOT_BOX,
    SERIES_STYLES,
    TOKEN_STRIP_BOX,
    LinePlot,
    series_picture,
)

__all__ = [
    "BACKGROUND",
    "DIAGONAL_COLOUR",
    "HEAT_SHADES",
    "HEIGHT",
    "JOINT_CAPTION",
    "PALETTE",
    "PICTURES",
    "PLOT_BOX",
    "PNG_COMPRESS_LEVEL",
    "POSITION_PLOT",
    "PROBABILITY_PLOT",
    "SERIES_COLOURS",
    "SERIES_STYLES",
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
    "probability_range",
    "profile_images",
    "profile_pictures",
    "profile_pngs",
]


# ---------------------------------------------------------------------- line plots
PROBABILITIES = "pa, pb: the trainer's and the rollout's probability of a token"
"""The caption line that says what ``pa`` and ``pb`` are."""

POSITION_PLOT = LinePlot(
    "Mismatch by position in the response",
    ("mean |pa - pb|", "mean k3 (KL)"),
    (),
    "position in the response",
    (PROBABILITIES, "bucket n: positions n to 2n - 1 (bucket 0: position 0); 1k = 1024"),
)
"""The text of :func:`by_position_picture` (its x ticks are the buckets it shows)."""

PROBABILITY_PLOT = LinePlot(
    "Mismatch by trainer probability",
    ("mean |pa - pb|", "mean |a - b|"),
    (),
    "trainer probability pa",
    (
        "pa, pb: the trainer's and the rollout's probability; a, b: their logs",
        "bucket: the tokens with pa in (p/2, p], for p = 1, 1/2, 1/4, ...",
    ),
)
"""The text of :func:`by_probability_picture` (its x ticks are the buckets it shows)."""


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
        (480, 800, 3)
    """
    return rgb_array(_by_position(profile))


def _by_position(profile: Profile) -> Image.Image | None:
    if profile.tokens < 1 or not profile.by_position:
        return None
    buckets = profile.by_position
    ticks = tuple((i + 0.5, position_label(b.start)) for i, b in enumerate(buckets))
    return series_picture(
        dataclasses.replace(POSITION_PLOT, x_ticks=ticks),
        ([b.probs_diff_mean for b in buckets], [b.kl_k3 for b in buckets]),
        [b.tokens for b in buckets],
    )


def probability_range(profile: Profile) -> range:
    """The buckets of the trainer's probability a picture shows: the occupied, one either side.

    Bucket ``i`` is ``(2**(i-29), 2**(i-28)]``; no bucket beyond the first or the last.

    Example:
        >>> import torch
        >>> from lightning_rollout_debug.metrics.extras import TokenExtras
        >>> extras = TokenExtras(histograms=False, worst_tokens_k=0, profile=True,
        ...                      compile=False)
        >>> old = torch.log(torch.tensor([[0.01, 0.03, 0.2]]))  # buckets 22, 23 and 26
        >>> extras.update(old, old, torch.ones(1, 3))
        >>> probability_range(extras.summary(extras.state).profile)
        range(21, 28)
    """
    occupied = [i for i, bucket in enumerate(profile.by_probability) if bucket.tokens > 0]
    if not occupied:
        return range(PROBABILITY_BUCKETS)
    return range(max(occupied[0] - 1, 0), min(occupied[-1] + 2, PROBABILITY_BUCKETS))


def _probability_ticks(shown: range) -> tuple[tuple[float, str], ...]:
    """Ticks of the probability axis over the buckets ``shown``: ``(slot coordinate, label)``.

    Each decade, and 0.5; with fewer than three of them in range, 2 and 5 of each decade.
    """
    low = 2.0 ** (shown.start - PROBABILITY_BUCKETS)
    high = 2.0 ** (shown.stop - PROBABILITY_BUCKETS)
    marks = {10.0**-k for k in range(9)} | {0.5}
    if sum(low <= p <= high for p in marks) < 3:
        marks |= {m * 10.0**-k for k in range(1, 9) for m in (2, 5)}
    offset = PROBABILITY_BUCKETS - shown.start
    return tuple(
        (math.log2(p) + offset, probability_label(p)) for p in sorted(marks) if low <= p <= high
    )


def by_probability_picture(profile: Profile) -> np.ndarray | None:
    """Mean ``|pa - pb|`` and mean ``|a - b|`` by the trainer's probability ``pa``.

    One slot per bucket ``(2**-(k+1), 2**-k]`` (the x axis is log2, ticks at
    probabilities), from one below the lowest occupied bucket to one above the highest
    (:func:`probability_range`), with the tokens per bucket; ``None`` for an empty
    profile.

    Example:
        >>> import torch
        >>> from lightning_rollout_debug.metrics.extras import TokenExtras
        >>> extras = TokenExtras(histograms=False, worst_tokens_k=0, profile=True,
        ...                      compile=False)
        >>> old = torch.log(torch.linspace(1e-6, 1, 64)).reshape(1, 64)
        >>> extras.update(old + 0.01, old, torch.ones(1, 64))
        >>> by_probability_picture(extras.summary(extras.state).profile).shape
        (480, 800, 3)
    """
    return rgb_array(_by_probability(profile))


def _by_probability(profile: Profile) -> Image.Image | None:
    if profile.tokens < 1:
        return None
    shown = probability_range(profile)
    buckets = profile.by_probability[shown.start : shown.stop]
    return series_picture(
        dataclasses.replace(PROBABILITY_PLOT, x_ticks=_probability_ticks(shown)),
        ([b.probs_diff_mean for b in buckets], [b.log_probs_diff_mean for b in buckets]),
        [b.tokens for b in buckets],
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

    Each is an 8-bit palette PNG of ``WIDTH x HEIGHT`` (about 20 KB): decoded and converted
    to RGB, it is the array of :func:`profile_pictures`. None for an empty (or missing)
    profile.
    """
    return {name: encode_png(image) for name, image in profile_images(profile).items()}
