"""Pictures of the mismatch profile, and their way through TensorBoard.

Profiles come from real batches through ``TokenExtras``; the pictures are checked pixel by
pixel where the layout says where things are (the heatmap's cells, the centre of each
bucket), and after a real ``SummaryWriter`` (torch's, tensorboardX's where installed, or
any writer through its ``add_image``) the PNGs TensorBoard's own reader returns are
compared with the arrays drawn.
"""

from __future__ import annotations

import io
import itertools
import math
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from PIL import Image
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from tensorboard.backend.event_processing.event_file_loader import LegacyEventFileLoader
from torch.utils.tensorboard import SummaryWriter

from lightning_rollout_debug.metrics.extras import TokenExtras
from lightning_rollout_debug.metrics.profile import PROBABILITY_BUCKETS, Profile
from lightning_rollout_debug.views import canvas, heatmap, line_plot, pictures
from lightning_rollout_debug.views.pictures import (
    BACKGROUND,
    DIAGONAL_COLOUR,
    HEIGHT,
    PALETTE,
    PICTURES,
    PLOT_BOX,
    SERIES_COLOURS,
    TOKEN_BAR_COLOUR,
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
    profile_pngs,
)
from lightning_rollout_debug.views.tensorboard import PROFILE_IMAGE_TAGS, write_profile

PREFIX = "training/"


# ---------------------------------------------------------------------- data
def profile_of(rollout: torch.Tensor, old: torch.Tensor, mask: torch.Tensor) -> Profile:
    extras = TokenExtras(histograms=False, worst_tokens_k=0, profile=True, compile=False)
    extras.update(rollout, old, mask)
    profile = extras.summary(extras.state).profile
    assert profile is not None
    return profile


def realistic(
    seed: int, rows: int = 16, width: int = 512, counted_rows: int | None = None
) -> Profile:
    """bf16-like noise growing with position, and a larger mismatch at low probability
    (the tokens of the first ``counted_rows`` rows, or of all of them)."""
    generator = torch.Generator().manual_seed(seed)
    confident = -(torch.rand(rows, width, generator=generator) ** 3) * 0.3
    tail = -(torch.rand(rows, width, generator=generator) ** 0.7) * 22
    old = torch.where(torch.rand(rows, width, generator=generator) < 0.75, confident, tail)
    growth = 1 + torch.arange(width, dtype=torch.float32) / 300
    noise = torch.randn(rows, width, generator=generator) * 0.004 * growth
    low = torch.where(old < -4, torch.randn(rows, width, generator=generator) * 0.25, 0.0)
    rollout = (old + noise + low).clamp(max=0)
    mask = torch.ones(rows, width)
    if counted_rows is not None:
        mask[counted_rows:] = 0
    return profile_of(rollout, old, mask)


def empty_profile() -> Profile:
    old = torch.full((2, 8), -0.5)
    return profile_of(old + 0.1, old, torch.zeros(2, 8))


# ---------------------------------------------------------------------- pixels
def is_colour(picture: np.ndarray, colour: tuple[int, int, int]) -> np.ndarray:
    return np.all(picture == np.asarray(colour, dtype=np.uint8), axis=-1)


def slot_centre(slots: int, i: int) -> int:
    left, _, right, _ = PLOT_BOX
    return round(left + (i + 0.5) * (right - left) / slots)


def dot_height(picture: np.ndarray, slots: int, i: int, colour: tuple[int, int, int]) -> float:
    """Middle row of the series' dot at bucket ``i`` (NaN if none).

    The dot is where the colour spans the columns 2 px either side of the centre: a line
    leaving the dot covers one side only (but at the dot's centre).
    """
    _, top, _, bottom = PLOT_BOX
    x = slot_centre(slots, i)
    band = is_colour(picture[top + 1 : bottom, x - 2 : x + 3], colour)
    rows = np.flatnonzero(band[:, 0] & band[:, 2] & band[:, 4])
    return float(rows.mean()) + top + 1 if rows.size else math.nan


def series_pixels_in_slot(picture: np.ndarray, slots: int, i: int) -> int:
    """Pixels of either series over the whole width of bucket ``i``, inside the axes."""
    left, top, right, bottom = PLOT_BOX
    start = math.ceil(left + i * (right - left) / slots)
    stop = math.floor(left + (i + 1) * (right - left) / slots)
    area = picture[top + 1 : bottom, start : stop + 1]
    return int(sum(is_colour(area, colour).sum() for colour in SERIES_COLOURS))


def bar_height(picture: np.ndarray, slots: int, i: int) -> int:
    _, top, _, bottom = TOKEN_STRIP_BOX
    return int(is_colour(picture[top:bottom, slot_centre(slots, i)], TOKEN_BAR_COLOUR).sum())


# ---------------------------------------------------------------------- shape, emptiness
def test_pictures_are_rgb_arrays_of_the_picture_size() -> None:
    profile = realistic(0)
    pictures = profile_pictures(profile)
    names = [name for name, _ in PICTURES]
    assert list(pictures) == names == ["by_position", "by_probability", "joint"]
    for name, draw in PICTURES:
        picture = draw(profile)
        assert picture is not None
        assert picture.shape == (HEIGHT, WIDTH, 3) and picture.dtype == np.uint8
        np.testing.assert_array_equal(picture, pictures[name])  # drawing is deterministic
        assert (~is_colour(picture, BACKGROUND)).mean() > 0.05, name


def test_pngs_are_the_pictures_with_the_fixed_palette() -> None:
    profile = realistic(1)
    pictures = profile_pictures(profile)
    pngs = profile_pngs(profile)
    assert list(pngs) == list(pictures)
    assert PALETTE.shape == (256, 3) and PALETTE.dtype == np.uint8
    palette = {tuple(colour) for colour in PALETTE.tolist()}
    interface = [BACKGROUND, *SERIES_COLOURS, TOKEN_BAR_COLOUR, DIAGONAL_COLOUR]
    assert palette >= {*interface, *(tuple(colour) for colour in VIRIDIS.tolist())}
    for name, png in pngs.items():
        decoded = Image.open(io.BytesIO(png))
        assert decoded.format == "PNG" and decoded.mode == "P" and decoded.size == (WIDTH, HEIGHT)
        # The line plots' palettes end before the heatmap's colours.
        entries = len(PALETTE) - (len(VIRIDIS) if name != "joint" else 0)
        assert decoded.getpalette() == PALETTE[:entries].ravel().tolist()
        np.testing.assert_array_equal(np.asarray(decoded.convert("RGB")), pictures[name])
        assert len(png) < 32_000, (name, len(png))  # a few KB each
    assert profile_pngs(empty_profile()) == {} and profile_pngs(None) == {}


def test_a_png_holds_the_pictures_indices_and_palette() -> None:
    """Each picture's PNG (Pillow's): 8-bit palette, the image's own palette entries, and
    the picture's indices."""
    for name, image in pictures.profile_images(realistic(2)).items():
        decoded = Image.open(io.BytesIO(canvas.encode_png(image)))
        assert (decoded.mode, decoded.size) == ("P", (WIDTH, HEIGHT)), name
        assert decoded.getpalette() == image.getpalette()
        np.testing.assert_array_equal(np.asarray(decoded), np.asarray(image))
        np.testing.assert_array_equal(np.asarray(decoded.convert("RGB")), rgb_of(image))


def rgb_of(image: Image.Image) -> np.ndarray:
    """The RGB pixels of a "P" image, looked up in its palette with NumPy."""
    palette = np.array(image.getpalette(), dtype=np.uint8).reshape(-1, 3)
    return palette[np.asarray(image)]


def test_a_picture_does_not_carry_over_into_the_next_on_the_same_axes() -> None:
    """What a picture holds whatever its values is drawn once per axes and copied: drawing
    one profile leaves nothing behind in the next profile's pictures."""
    first, second = realistic(0), realistic(0, counted_rows=12)
    frames = (line_plot._series_frame, heatmap._joint_frame)
    for frame in frames:
        frame.cache_clear()
    alone = profile_pictures(second)
    for frame in frames:
        frame.cache_clear()
    profile_pictures(first)
    hits = [frame.cache_info().hits for frame in frames]
    after = profile_pictures(second)
    # The second profile's pictures were drawn on the frames the first one's were.
    reused = [frame.cache_info().hits - was for frame, was in zip(frames, hits, strict=True)]
    assert reused == [2, 1]
    assert alone.keys() == after.keys() == {name for name, _ in PICTURES}
    for name, picture in alone.items():
        np.testing.assert_array_equal(after[name], picture, err_msg=name)
    drawn_first = profile_pictures(first)
    assert not any(np.array_equal(drawn_first[name], picture) for name, picture in alone.items())


def test_pictures_are_drawn_by_a_pillow_without_freetype() -> None:
    """A Pillow built without FreeType has no font of a chosen size: the pictures use its
    bitmap font rather than fail (in a fresh process, where the FreeType module is absent)."""
    script = """
import sys
sys.modules["PIL._imagingft"] = None  # as a Pillow built without libfreetype has it
import torch
from PIL import Image, ImageFont
from lightning_rollout_debug import RolloutDebugMonitor
from lightning_rollout_debug.views.pictures import profile_pngs
try:
    ImageFont.load_default(size=12)
    raise SystemExit("FreeType still loads")
except ImportError:
    pass
monitor = RolloutDebugMonitor(alert_ranges={})
old = -torch.rand(4, 64) * 3
monitor.update({"rollout_log_probs": old - 0.01, "old_log_probs": old,
                "response_mask": torch.ones(4, 64)})
monitor.log(0)
for name, png in profile_pngs(monitor.profile).items():
    print(name, Image.open(__import__("io").BytesIO(png)).size)
"""
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          timeout=300, check=False)  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    drawn = dict(line.split(" ", 1) for line in done.stdout.splitlines())
    assert sorted(drawn) == sorted(name for name, _ in PICTURES)
    assert len(set(drawn.values())) == 1  # each of the picture size


def test_an_empty_profile_has_no_picture() -> None:
    profile = empty_profile()
    assert profile.tokens == 0
    assert by_position_picture(profile) is None
    assert by_probability_picture(profile) is None
    assert joint_picture(profile) is None
    assert profile_pictures(profile) == {}
    assert profile_pictures(None) == {}


# ---------------------------------------------------------------------- joint heatmap
def test_identical_log_probs_colour_only_the_diagonal_cells() -> None:
    generator = torch.Generator().manual_seed(1)
    old = -torch.rand(8, 64, generator=generator) * 18
    old[0, :4] = 0.0  # p = 1: the top right cell
    profile = profile_of(old.clone(), old, torch.ones(8, 64))
    picture = joint_picture(profile)
    assert picture is not None
    joint = profile.joint_histogram
    counts = np.asarray(joint.counts)
    shown = joint_shown_bins(counts, joint.edges)
    assert counts.sum() == 8 * 64 and np.trace(counts) == counts.sum()

    expected = np.zeros((HEIGHT, WIDTH), dtype=bool)
    colours = {tuple(colour) for colour in VIRIDIS.tolist()}
    for trainer in shown:
        for rollout in shown:
            left, top, right, bottom = joint_cell_box(shown, trainer, rollout)
            cell = picture[top:bottom, left:right]
            if counts[trainer, rollout] > 0:
                expected[top:bottom, left:right] = True
                assert trainer == rollout
                assert tuple(cell[1, 1].tolist()) in colours
                assert (cell == cell[1, 1]).all()  # a cell is one colour
            else:
                tinted = ~(is_colour(cell, BACKGROUND) | is_colour(cell, DIAGONAL_COLOUR))
                assert not tinted.any(), (trainer, rollout)
    # p = 1 for both is the top right cell of the heatmap.
    top_right = joint_cell_box(shown, shown[-1], shown[-1])
    corner = joint_cell_box(shown, shown[0], shown[0])
    assert top_right[0] > corner[0] and top_right[1] < corner[1]
    assert counts[shown[-1], shown[-1]] >= 4 and expected[top_right[1], top_right[0]]


def test_joint_cells_are_coloured_by_log_one_plus_count() -> None:
    # One token at (trainer 0.5, rollout 0.25), 9 at (0.9, 0.8), 90 at (0.99, 0.99).
    pairs = [(0.5, 0.25)] + [(0.9, 0.8)] * 9 + [(0.99, 0.99)] * 90
    old = torch.log(torch.tensor([[a for a, _ in pairs]]))
    rollout = torch.log(torch.tensor([[b for _, b in pairs]]))
    profile = profile_of(rollout, old, torch.ones_like(old))
    picture = joint_picture(profile)
    assert picture is not None
    joint = profile.joint_histogram
    counts = np.asarray(joint.counts)
    shown = joint_shown_bins(counts, joint.edges)
    filled = sorted(zip(*np.nonzero(counts), strict=True), key=lambda ij: counts[ij])
    assert [counts[ij] for ij in filled] == [1, 9, 90]
    for (trainer, rollout_bin), count in zip(filled, (1, 9, 90), strict=True):
        left, top, _, _ = joint_cell_box(shown, trainer, rollout_bin)
        shade = round(math.log1p(count) / math.log1p(90) * (len(VIRIDIS) - 1))
        assert picture[top + 1, left + 1].tolist() == VIRIDIS[shade].tolist()
    # Trainer more confident than the rollout: above the diagonal, i.e. left of the cell
    # on the diagonal of the same row.
    trainer, rollout_bin = filled[0]
    assert rollout_bin < trainer
    assert (
        joint_cell_box(shown, trainer, rollout_bin)[0] < joint_cell_box(shown, trainer, trainer)[0]
    )


# ---------------------------------------------------------------------- line plots
def test_by_position_shows_a_mismatch_growing_with_position_and_gaps() -> None:
    width = 256
    old = torch.full((4, width), math.log(0.5))
    rollout = old + 1e-3 * (1 + torch.arange(width, dtype=torch.float32))
    mask = torch.ones(4, width)
    mask[:, 4:8] = 0  # bucket [4, 8) has no token
    profile = profile_of(rollout, old, mask)
    picture = by_position_picture(profile)
    assert picture is not None
    buckets = profile.by_position
    slots = len(buckets)
    assert [b.start for b in buckets] == [0, 1, 2, 4, 8, 16, 32, 64, 128]
    assert buckets[3].tokens == 0 and math.isnan(buckets[3].probs_diff_mean)

    # The empty bucket: no dot, no line through it, no bar.
    assert series_pixels_in_slot(picture, slots, 3) == 0
    assert bar_height(picture, slots, 3) == 0
    for colour in SERIES_COLOURS:
        heights = [dot_height(picture, slots, i, colour) for i in range(slots) if i != 3]
        assert not any(math.isnan(h) for h in heights)
        # The means grow with position, so the dots climb (rows decrease).
        assert all(b < a for a, b in itertools.pairwise(heights)), heights
    # The bars grow with the tokens per bucket (4, 4, 8, 32, 64, ... tokens).
    bars = [bar_height(picture, slots, i) for i in range(slots) if i != 3]
    assert bars == sorted(bars) and bars[0] >= 2 and bars[-1] > bars[0]


def test_by_probability_shows_the_mismatch_concentrated_at_low_probability() -> None:
    # Trainer probabilities just below 2**-11, ..., 1/2, 1 (one bucket each), 16 tokens in
    # each; the rollout differs by 0.5 nats below 1/64 and by 0.001 above.
    exponents = torch.arange(0, 12, dtype=torch.float32).repeat_interleave(16)
    old = (-exponents * math.log(2) - 1e-3).reshape(1, -1)
    shift = torch.where(old < math.log(1 / 64), 0.5, 1e-3)
    profile = profile_of(old + shift, old, torch.ones_like(old))
    picture = by_probability_picture(profile)
    assert picture is not None
    filled = [i for i, b in enumerate(profile.by_probability) if b.tokens > 0]
    assert filled == list(range(PROBABILITY_BUCKETS - 12, PROBABILITY_BUCKETS))
    # The axis: one empty bucket below the lowest filled one, none above (1 is the top).
    shown = probability_range(profile)
    assert shown == range(PROBABILITY_BUCKETS - 13, PROBABILITY_BUCKETS)
    slots = len(shown)
    slot = {i: i - shown.start for i in filled}

    log_colour = SERIES_COLOURS[1]  # mean |a - b|
    low = [dot_height(picture, slots, slot[i], log_colour) for i in filled[:6]]
    high = [dot_height(picture, slots, slot[i], log_colour) for i in filled[6:]]
    assert not any(math.isnan(height) for height in low + high)
    assert max(low) < min(high)  # large mismatch drawn higher
    assert max(low) - min(low) <= 2 and max(high) - min(high) <= 2  # level within each
    # No token in the margin's bucket: no dot, no line, no bar there.
    assert series_pixels_in_slot(picture, slots, 0) == 0
    assert bar_height(picture, slots, 0) == 0
    bars = {bar_height(picture, slots, slot[i]) for i in filled}
    assert len(bars) == 1 and bars.pop() > 0  # 16 tokens in each


def test_means_of_zero_sit_on_the_bottom_edge() -> None:
    old = torch.log(torch.rand(4, 32, generator=torch.Generator().manual_seed(2)))
    profile = profile_of(old.clone(), old, torch.ones(4, 32))
    for draw in (by_position_picture, by_probability_picture):
        picture = draw(profile)
        assert picture is not None
        left, top, right, bottom = PLOT_BOX
        inside = picture[top + 1 : bottom, left + 1 : right]
        rows = np.flatnonzero(
            np.any(is_colour(inside, SERIES_COLOURS[0]) | is_colour(inside, SERIES_COLOURS[1]), 1)
        )
        # The triangles: 9 px high, their tips on the frame's bottom edge.
        assert rows.size and rows.min() + top + 1 >= bottom - 10


# ---------------------------------------------------------------------- TensorBoard
class AddImageOnly:
    """A writer with ``add_image`` only: it keeps each call and hands it to a SummaryWriter."""

    def __init__(self, logdir: Path) -> None:
        self.writer = SummaryWriter(str(logdir))
        self.calls: list[tuple[str, np.ndarray, int, str]] = []

    def add_image(
        self, tag: str, img_tensor: np.ndarray, global_step: int, dataformats: str = "CHW"
    ) -> None:
        self.calls.append((tag, img_tensor, global_step, dataformats))
        self.writer.add_image(tag, img_tensor, global_step, dataformats=dataformats)

    def add_scalar(self, tag: str, value: float, global_step: int) -> None:
        self.writer.add_scalar(tag, value, global_step)

    def close(self) -> None:
        self.writer.close()


class RecordingSummaryWriter(SummaryWriter):
    """torch's SummaryWriter with an ``add_image`` of its own: it keeps each call."""

    def __init__(self, logdir: Path) -> None:
        super().__init__(str(logdir))
        self.calls: list[tuple[str, np.ndarray, int, str]] = []

    def add_image(
        self,
        tag: str,
        img_tensor: Any,
        global_step: Any = None,
        walltime: Any = None,
        dataformats: str = "CHW",
    ) -> None:
        self.calls.append((tag, img_tensor, global_step, dataformats))
        super().add_image(tag, img_tensor, global_step, walltime, dataformats)


def tensorboardx_writer(logdir: Path) -> Any:
    tensorboardx = pytest.importorskip("tensorboardX")
    return tensorboardx.SummaryWriter(str(logdir))


WRITERS: dict[str, Callable[[Path], Any]] = {
    "torch": lambda logdir: SummaryWriter(str(logdir)),
    "tensorboardX": tensorboardx_writer,
    "add_image only": AddImageOnly,
    "subclass with its own add_image": RecordingSummaryWriter,
}


def read_images(logdir: Path) -> EventAccumulator:
    accumulator = EventAccumulator(str(logdir), size_guidance={"images": 0})
    accumulator.Reload()
    return accumulator


@pytest.mark.parametrize("make_writer", list(WRITERS.values()), ids=list(WRITERS))
def test_write_profile_round_trips_through_tensorboard(
    tmp_path: Path, make_writer: Callable[[Path], Any]
) -> None:
    profiles = {3: realistic(3), 7: realistic(7), 9: empty_profile()}
    writer = make_writer(tmp_path)
    for step, profile in profiles.items():
        write_profile(writer, PREFIX, profile, step)
    writer.close()
    # add_image encodes RGB PNGs (a writer of its own records its calls).
    through_add_image = hasattr(writer, "calls")

    accumulator = read_images(tmp_path)
    tags = [f"{PREFIX}{tag}" for tag in PROFILE_IMAGE_TAGS]
    assert sorted(accumulator.Tags()["images"]) == sorted(tags)
    assert PROFILE_IMAGE_TAGS == (
        "rollout_profile/by_position",
        "rollout_profile/by_probability",
        "rollout_profile/joint",
    )
    for tag, (_, draw) in zip(tags, PICTURES, strict=True):
        events = accumulator.Images(tag)
        assert [event.step for event in events] == [3, 7]  # nothing for the empty step 9
        for event in events:
            expected = draw(profiles[event.step])
            assert expected is not None
            assert (event.height, event.width) == expected.shape[:2] == (HEIGHT, WIDTH)
            decoded = Image.open(io.BytesIO(event.encoded_image_string))
            assert decoded.format == "PNG" and decoded.mode == "RGB"
            np.testing.assert_array_equal(np.asarray(decoded.convert("RGB")), expected)
    if through_add_image:
        assert [(tag, step, form) for tag, _, step, form in writer.calls] == [
            (tag, step, "HWC") for step in (3, 7) for tag in tags
        ]
        for (_, picture, step, _), (_, draw) in zip(writer.calls, PICTURES * 2, strict=True):
            np.testing.assert_array_equal(picture, draw(profiles[step]))


def image_values(logdir: Path) -> dict[str, Any]:
    """Each image summary value in the event files by tag, as the protobuf read back."""
    values = {}
    for path in sorted(logdir.glob("events.out.tfevents.*")):
        for event in LegacyEventFileLoader(str(path)).Load():
            for value in event.summary.value:
                if value.WhichOneof("value") == "image":
                    values[value.tag] = value
    return values


def test_write_profile_writes_the_summary_add_image_writes(tmp_path: Path) -> None:
    profile = realistic(4)
    writer = SummaryWriter(str(tmp_path))
    write_profile(writer, PREFIX, profile, 5)
    for name, picture in profile_pictures(profile).items():
        writer.add_image(f"add_image/{name}", picture, 5, dataformats="HWC")
    writer.close()

    values = image_values(tmp_path)
    for name, _ in PICTURES:
        ours, theirs = values[f"{PREFIX}rollout_profile/{name}"], values[f"add_image/{name}"]
        assert ours.metadata == theirs.metadata and ours.image == theirs.image
        rgb = [
            np.asarray(Image.open(io.BytesIO(value.image.encoded_image_string)).convert("RGB"))
            for value in (ours, theirs)
        ]
        np.testing.assert_array_equal(*rgb)


@pytest.mark.parametrize("make_writer", list(WRITERS.values()), ids=list(WRITERS))
@pytest.mark.parametrize("profile", [None, "empty"])
def test_write_profile_writes_nothing_without_tokens(
    tmp_path: Path, profile: str | None, make_writer: Callable[[Path], Any]
) -> None:
    writer = make_writer(tmp_path)
    write_profile(writer, "", empty_profile() if profile else None, 1)
    writer.add_scalar("anything", 1.0, 1)  # so that the event file has a record to read
    writer.close()
    accumulator = read_images(tmp_path)
    assert accumulator.Tags()["images"] == []
    assert [event.step for event in accumulator.Scalars("anything")] == [1]
    assert getattr(writer, "calls", []) == []
