"""TensorBoard writers: the extras' histograms, worst tokens and profile pictures, the layout.

The scalars reach TensorBoard through the Lightning loggers (:func:`log_scalars`: a
TensorBoard logger's in one event); what only a ``SummaryWriter`` can show is written
here, from a window's host summary
(:class:`~lightning_rollout_debug.extras.ExtrasSummary`): histograms with the fixed bins
of :mod:`.extras`, a markdown table of the worst tokens, the pictures of the profile
(:mod:`.pictures`), and the custom-scalars layout of the catalog's
:data:`~lightning_rollout_debug.catalog.DASHBOARD`. :func:`use_fast_event_checksums`
gives TensorBoard's event writer a checksum in C.
"""

from __future__ import annotations

import functools
import importlib
import re
import sys
import warnings
import weakref
from collections.abc import Callable, Collection, Mapping, Sequence
from typing import Any

from lightning_rollout_debug.catalog import DASHBOARD
from lightning_rollout_debug.extras import ExtrasSummary
from lightning_rollout_debug.packages import TENSORBOARD_LOGGERS
from lightning_rollout_debug.pictures import HEIGHT, PICTURES, WIDTH, profile_pictures, profile_pngs
from lightning_rollout_debug.profile import Profile
from lightning_rollout_debug.worst_tokens import WorstToken

WORST_TOKENS_TAG = "rollout_worst_tokens"
"""Un-prefixed TensorBoard tag of the worst-tokens table."""

WORST_TOKENS_CAPTION = (
    "The window's tokens with the largest |r| = |log(actor prob / rollout prob)|. *batch*: "
    "index of the training batch within the window (0 = first batch after the previous "
    "logged step); *row*, *position*: the token's place in that batch's [B, T] tensors."
)
"""First paragraph of the worst-tokens text, above the table."""

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


@functools.cache
def _masked_crc32c_in_c() -> Callable[[bytes], int] | None:
    """TensorBoard's masked CRC-32C of a record, computed by google-crc32c's C extension.

    ``None`` without that extension (google-crc32c then falls back to Python; its warning
    about that is not shown here).
    """
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        try:
            from google_crc32c.cext import value
        except ImportError:
            return None

    def masked_crc32c(data: bytes) -> int:
        crc = value(data)
        rotated = ((crc >> 15) | (crc << 17)) & 0xFFFFFFFF
        return (rotated + 0xA282EAD8) & 0xFFFFFFFF

    return masked_crc32c


def use_fast_event_checksums() -> bool:
    """Give TensorBoard's event writer google-crc32c's checksum in C; whether it has it now.

    The event files of torch's ``SummaryWriter`` (TensorBoard's writer, that of Lightning's
    ``TensorBoardLogger``) hold a masked CRC-32C of each record, which TensorBoard's writer
    computes in Python, byte by byte, on its writer thread and holding the interpreter's
    lock while the training step runs: of a logged step's work, the pictures' checksum
    cost more than drawing them. google-crc32c's C extension computes the same values;
    the files are byte for byte the same. The monitor calls this at each logged step
    with a TensorBoard logger. It changes nothing without that extension, or where
    something else has already replaced the writer's checksum; tensorboardX has its own
    (in C with the ``crc32c`` package installed).

    Example:
        >>> from tensorboard.compat.tensorflow_stub.pywrap_tensorflow import masked_crc32c
        >>> from tensorboard.summary.writer import record_writer
        >>> use_fast_event_checksums()
        True
        >>> record_writer.masked_crc32c(b"rollout") == masked_crc32c(b"rollout")
        True
    """
    fast = _masked_crc32c_in_c()
    try:
        from tensorboard.compat.tensorflow_stub import pywrap_tensorflow
        from tensorboard.summary.writer import record_writer
    except ImportError:
        return False
    # A TensorBoard whose writer finds its checksum elsewhere is left as it is.
    current = getattr(record_writer, "masked_crc32c", None)
    if fast is None or current is None:
        return False
    if current is getattr(pywrap_tensorflow, "masked_crc32c", None):
        record_writer.masked_crc32c = fast
    return record_writer.masked_crc32c is fast


def write_extras(
    writer: Any, prefix: str, summary: ExtrasSummary, step: int, *, show_rank: bool = False
) -> None:
    """Write a window's histograms and worst-tokens table with a ``SummaryWriter``.

    A histogram is written from its first to its last non-empty bin (``bucket_limit`` is
    a contiguous run of the fixed edges, then ``DBL_MAX`` if the overflow bin is
    included). Nothing is written for an empty window.
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
        table = worst_tokens_markdown(summary.worst_tokens, show_rank=show_rank)
        writer.add_text(f"{prefix}{WORST_TOKENS_TAG}", f"{WORST_TOKENS_CAPTION}\n\n{table}", step)


# A SummaryWriter's module, and the module of the Summary protobuf its file writer takes:
# torch's takes TensorBoard's protobufs, tensorboardX its own copy of them (same fields).
_SUMMARY_PROTOS = (
    ("torch.utils.tensorboard", "tensorboard.compat.proto.summary_pb2"),
    ("tensorboardX", "tensorboardX.proto.summary_pb2"),
)


def _summary_class(
    writer: Any, method: str = "add_image", kinds: Sequence[tuple[str, str]] = _SUMMARY_PROTOS
) -> Any:
    """The ``Summary`` protobuf class ``writer._get_file_writer().add_summary`` takes.

    ``None`` for a writer other than the ``SummaryWriter`` of ``kinds`` (torch's or
    tensorboardX's), a subclass of theirs with its own ``method``, or one without
    ``_get_file_writer``.
    """
    if not callable(getattr(writer, "_get_file_writer", None)):
        return None
    for writer_module, proto_module in kinds:
        module = sys.modules.get(writer_module)
        if (
            module is not None
            and isinstance(writer, module.SummaryWriter)
            and getattr(type(writer), method) is getattr(module.SummaryWriter, method)
        ):
            return importlib.import_module(proto_module).Summary
    return None


@functools.cache
def _stock_log_metrics() -> frozenset[Any]:
    """The ``log_metrics`` of the TensorBoard loggers of Lightning's packages."""
    return frozenset(logger.log_metrics for logger in TENSORBOARD_LOGGERS)


def _one_event_summary(logger: Any) -> Any:
    """The ``Summary`` class with which :func:`log_scalars` writes ``logger``'s scalars.

    ``None`` unless ``logger`` is a TensorBoard logger of Lightning's with Lightning's own
    ``log_metrics`` and prefix, on torch's ``SummaryWriter`` (or a subclass that keeps its
    ``add_scalar``). tensorboardX's ``add_scalar`` also hands each value to its Comet
    logger: its writers keep ``log_metrics``.
    """
    if not isinstance(logger, TENSORBOARD_LOGGERS) or not isinstance(
        getattr(logger, "_prefix", None), str
    ):
        return None
    if type(logger).log_metrics not in _stock_log_metrics():
        return None
    return _summary_class(logger.experiment, "add_scalar", _SUMMARY_PROTOS[:1])


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
    """Log ``scalars`` at ``step`` with ``logger``, in one TensorBoard event where that is the same.

    Lightning's ``TensorBoardLogger.log_metrics`` writes an event per scalar, each through
    the writer's queue of 10 events and its thread: 2.5 to 2.7 ms for the catalog's 42
    scalars, against 0.2 ms for one event (``python benchmarks/bench_logged_step.py``).
    With a Lightning or Fabric ``TensorBoardLogger`` of torch's ``SummaryWriter`` the
    values go instead into one event of one summary: one value per scalar, the
    ``simple_value`` that its ``add_scalar`` writes, under the logger's prefix, through
    the same file writer. Every other logger (a subclass with its own ``log_metrics``
    too) gets ``log_metrics``.

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
    summary = _one_event_summary(logger)
    if summary is None:
        logger.log_metrics(dict(scalars), step=step)
        return
    join = logger_prefix(logger)
    values = [
        summary.Value(tag=f"{join}{name}", simple_value=float(value))
        for name, value in scalars.items()
    ]
    logger.experiment._get_file_writer().add_summary(summary(value=values), step)


def write_profile(writer: Any, prefix: str, profile: Profile | None, step: int) -> None:
    """Write a window's profile pictures (:mod:`.pictures`) with a ``SummaryWriter``.

    Each picture is an image summary under ``{prefix}rollout_profile/{name}``
    (:data:`PROFILE_IMAGE_TAGS`), the kind ``add_image`` writes, with the picture's palette
    PNG (:func:`~lightning_rollout_debug.pictures.profile_pngs`) as its encoded image. With
    torch's or tensorboardX's ``SummaryWriter`` the PNG goes into the event file as it is;
    any other writer (a subclass with its own ``add_image`` included) gets
    ``add_image(tag, rgb_array, step, dataformats="HWC")``, which encodes the picture again.
    Nothing is written for an empty window (or without a profile).

    Example:
        >>> import tempfile
        >>> import torch
        >>> from torch.utils.tensorboard import SummaryWriter
        >>> from lightning_rollout_debug.extras import TokenExtras
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
    summary_class = _summary_class(writer)
    if summary_class is None:
        # The public API: add_image converts the RGB array and encodes an RGB PNG itself.
        for name, picture in profile_pictures(profile).items():
            writer.add_image(
                f"{prefix}{PROFILE_IMAGE_TAG}/{name}", picture, step, dataformats="HWC"
            )
        return
    pngs = profile_pngs(profile)
    if not pngs:
        return
    # What add_image does after encoding, through the same private API: a Summary value
    # with the image (no plugin metadata), wrapped in an event by the file writer;
    # tensorboardX's add_image also hands the PNG to its Comet logger.
    file_writer = writer._get_file_writer()
    comet_logger = getattr(writer, "_get_comet_logger", None)
    for name, png in pngs.items():
        tag = f"{prefix}{PROFILE_IMAGE_TAG}/{name}"
        image = summary_class.Image(
            height=HEIGHT, width=WIDTH, colorspace=3, encoded_image_string=png
        )
        file_writer.add_summary(
            summary_class(value=[summary_class.Value(tag=tag, image=image)]), step
        )
        if comet_logger is not None:
            comet_logger().log_image_encoded(png, tag, step=step)


def worst_tokens_markdown(tokens: Sequence[WorstToken], *, show_rank: bool = False) -> str:
    """A Markdown table of the worst tokens (TensorBoard's text plugin renders it).

    The token column appears when any token has an id, the rank column with ``show_rank``.

    Example:
        >>> token = WorstToken(-0.223144, 0.2, 0.25, batch=0, row=1, position=7, token_id=42,
        ...                    rank=0)
        >>> print(worst_tokens_markdown([token]))
        | # | batch | row | position | token | rollout prob | actor prob | r = log(actor/rollout) |
        |---:|---:|---:|---:|---:|---:|---:|---:|
        | 1 | 0 | 1 | 7 | 42 | 0.25 | 0.2 | -0.223144 |
    """
    show_token = any(token.token_id is not None for token in tokens)
    header = ["#", *(["rank"] if show_rank else []), "batch", "row", "position"]
    header += [*(["token"] if show_token else []), "rollout prob", "actor prob"]
    header.append("r = log(actor/rollout)")
    lines = ["| " + " | ".join(header) + " |", "|" + "---:|" * len(header)]
    for number, token in enumerate(tokens, start=1):
        cells = [str(number), *([str(token.rank)] if show_rank else [])]
        cells += [str(token.batch), str(token.row), str(token.position)]
        if show_token:
            cells.append("-" if token.token_id is None else str(token.token_id))
        cells += [f"{token.rollout_prob:.6g}", f"{token.actor_prob:.6g}", f"{token.log_ratio:.6g}"]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


DashboardLayout = dict[str, dict[str, list[Any]]]
"""A custom-scalars layout as ``SummaryWriter.add_custom_scalars`` takes it."""


def dashboard_layout(prefix: str, names: Collection[str]) -> DashboardLayout:
    """The custom-scalars layout of :data:`DASHBOARD` for ``SummaryWriter.add_custom_scalars``.

    Only metrics in ``names`` (un-prefixed) appear; empty charts and categories are left
    out. Chart tags are anchored regular expressions of the prefixed names.

    Example:
        >>> dashboard_layout("training/", ["rollout_actor_kl_k1", "rollout_actor_kl_k3"])
        {'training/divergence': {'KL(rollout || actor): k1, k3': ['Multiline', ['^training/rollout_actor_kl_k1$', '^training/rollout_actor_kl_k3$']]}}
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
