"""TensorBoard extras: histograms, worst-token table (with the tokens' text), dashboard layout.

Real CPU Trainer runs write event files, which are read back with ``EventAccumulator``
and compared with NumPy references computed from the batches of each window.
"""

from __future__ import annotations

import json
import math
import pickle
import re
import sys
from collections.abc import Mapping, Sequence
from html.parser import HTMLParser
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import pytorch_lightning as pl
import torch
from conftest import NEEDS_CXX
from lightning_helpers import (
    PACKAGES,
    PYTORCH_LIGHTNING,
    TRAINER_DEFAULTS,
    Lightning,
    ReleaseProcessGroups,
    RolloutModule,
    make_batch,
    read_csv_metrics,
)
from pytorch_lightning.loggers import CSVLogger, TensorBoardLogger
from tensorboard import plugin_util
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from tensorboard.compat.tensorflow_stub import errors, pywrap_tensorflow
from tensorboard.plugins.custom_scalar import layout_pb2
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode
from torch.utils._python_dispatch import TorchDispatchMode

from lightning_rollout_debug import RolloutDebugCallback, RolloutDebugMonitor, RolloutDebugWarning
from lightning_rollout_debug.checks.alerts import enabled_metric_names
from lightning_rollout_debug.loop.agreement import WIDTH
from lightning_rollout_debug.loop.logs import WindowLogs
from lightning_rollout_debug.loop.ranks import Ranks
from lightning_rollout_debug.metrics import backends, native
from lightning_rollout_debug.metrics.bins import (
    HISTOGRAMS,
    LOG_RATIO_BINS,
    LOG_RATIO_EDGES,
    PROBS_DIFF_BINS,
    PROBS_DIFF_EDGES,
    QuarterOctaveBins,
)
from lightning_rollout_debug.metrics.catalog import DASHBOARD
from lightning_rollout_debug.metrics.extras import ExtrasSummary, TokenExtras
from lightning_rollout_debug.metrics.tokens import LOG_PROB_FLOOR
from lightning_rollout_debug.metrics.worst_tokens import WORST_FIELDS, WorstToken
from lightning_rollout_debug.views.tensorboard import (
    SEGMENT_CAPTION,
    dashboard_layout,
    worst_tokens_markdown,
    write_extras,
)
from lightning_rollout_debug.views.token_text import TokenText, markdown_cell

pytestmark = [
    pytest.mark.filterwarnings("ignore:The '.*dataloader' does not have many workers"),
    pytest.mark.filterwarnings("ignore:`isinstance.treespec, LeafSpec.` is deprecated"),
    pytest.mark.filterwarnings("ignore:RolloutDebugCallback at step .* is outside"),
]

PREFIX = "training/"
LOG_RATIO_TAG = f"{PREFIX}rollout_log_ratio_hist"
PROBS_DIFF_TAG = f"{PREFIX}rollout_probs_diff_hist"
TEXT_TAG = f"{PREFIX}rollout_worst_tokens/text_summary"  # torch's add_text appends the suffix
LAYOUT_TAG = "custom_scalars__config__"


# ---------------------------------------------------------------------- data
def batch(seed: int, rows: int = 4, width: int = 7) -> dict[str, torch.Tensor]:
    """A batch with every kind of token: masked out, non-finite, floored, exactly equal."""
    data = make_batch(rows, width, seed=seed, noise=0.05)
    old, rollout, mask = data["old_log_probs"], data["rollout_log_probs"], data["response_mask"]
    generator = torch.Generator().manual_seed(seed)
    old[0, 1] = rollout[0, 1]  # r == 0 exactly
    rollout[1, 2] = -30.0  # below the floor: counts as -20
    old[1, 3] = math.nan  # dropped (non-finite)
    rollout[2, 0] = math.inf  # dropped (non-finite)
    old[2, 1] = -math.inf  # floored to -20: counts
    rollout[3, 4] = 0.0  # a dummy rollout log-prob ...
    mask[3, 4] = 0  # ... masked out
    mask[:, 0] = 1
    mask[0, 1] = mask[1, 2] = mask[1, 3] = mask[2, 1] = 1
    data["responses"] = torch.randint(0, 50_000, (rows, width), generator=generator)
    data["tool_ids"] = torch.randint(0, 50_000, (rows, width), generator=generator)
    return data


def counting(data: dict[str, torch.Tensor]) -> dict[str, np.ndarray]:
    """The counting tokens of a batch, in row-major order, computed with NumPy (float32)."""
    a = np.maximum(data["old_log_probs"].numpy().astype(np.float32), np.float32(LOG_PROB_FLOOR))
    b = np.maximum(data["rollout_log_probs"].numpy().astype(np.float32), np.float32(LOG_PROB_FLOOR))
    keep = (data["response_mask"].numpy() != 0) & np.isfinite(a) & np.isfinite(b)
    rows, positions = np.nonzero(keep)
    a, b = a[keep], b[keep]
    r = a - b
    return {
        "r": r.astype(np.float64),
        "dp": np.abs(np.exp(b) * np.expm1(r)).astype(np.float64),
        "pa": np.exp(a.astype(np.float64)),
        "pb": np.exp(b.astype(np.float64)),
        "row": rows,
        "position": positions,
        **{key: data[key].numpy()[keep] for key in ("responses", "tool_ids") if key in data},
    }


def reference_counts(values: np.ndarray, edges: Sequence[float]) -> np.ndarray:
    bins = np.searchsorted(np.asarray(edges), values, side="right")
    return np.bincount(bins, minlength=len(edges) + 1)


def assert_histogram(histogram: Any, values: np.ndarray, edges: Sequence[float]) -> None:
    """The written buckets are the NumPy binning, from the first to the last non-empty bin."""
    want = reference_counts(values, edges)
    filled = np.flatnonzero(want)
    first, last = filled[0], filled[-1]
    assert list(histogram.bucket_limit) == [*edges, sys.float_info.max][first : last + 1]
    np.testing.assert_array_equal(histogram.bucket, want[first : last + 1])


def fit(
    batches: list[dict[str, torch.Tensor]],
    callback: RolloutDebugCallback,
    logger: Any,
    lit: Lightning = PYTORCH_LIGHTNING,
    **trainer_kwargs: Any,
) -> pl.Trainer:
    """A CPU run of the batches with the Trainer of ``lit``'s package, logging every 2 steps."""
    options = {**TRAINER_DEFAULTS, "max_steps": len(batches), "log_every_n_steps": 2}
    trainer = lit.Trainer(**{**options, **trainer_kwargs}, logger=logger, callbacks=[callback])
    trainer.fit(lit.RolloutModule(batches))
    return trainer


def accumulator(log_dir: str | Path) -> EventAccumulator:
    guidance = {"histograms": 0, "tensors": 0, "scalars": 0}
    ea = EventAccumulator(str(log_dir), size_guidance=guidance)
    ea.Reload()
    return ea


def parse_table(text: str) -> list[dict[str, str]]:
    lines = [line for line in text.splitlines() if line.startswith("|")]
    header = [cell.strip() for cell in lines[0].strip("|").split("|")]
    return [
        dict(zip(header, (cell.strip() for cell in line.strip("|").split("|")), strict=True))
        for line in lines[2:]
    ]


@pytest.fixture(scope="module", params=PACKAGES)
def run(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """Four batches, logged every two steps: two windows of two batches each (each package)."""
    lit = request.param
    batches = [batch(seed) for seed in range(4)]
    logger = lit.loggers.TensorBoardLogger(tmp_path_factory.mktemp("tb"), name="tb", version=0)
    fit(batches, RolloutDebugCallback(worst_tokens_k=5), logger, lit)
    return {
        "batches": batches,
        "windows": [batches[:2], batches[2:]],
        "ea": accumulator(logger.log_dir),
    }


# ---------------------------------------------------------------------- histograms
@pytest.mark.parametrize(
    ("tag", "key", "edges"),
    [
        (LOG_RATIO_TAG, "r", LOG_RATIO_EDGES),
        (PROBS_DIFF_TAG, "dp", PROBS_DIFF_EDGES),
    ],
)
def test_histograms_match_numpy_binning(
    run: dict[str, Any], tag: str, key: str, edges: tuple[float, ...]
) -> None:
    events = sorted(run["ea"].Histograms(tag), key=lambda event: event.step)
    assert len(events) == len(run["windows"])
    tokens = {event.step: event.value for event in run["ea"].Scalars(f"{PREFIX}rollout_tokens")}
    total = 0
    for event, window in zip(events, run["windows"], strict=True):
        values = np.concatenate([counting(data)[key] for data in window])
        histogram = event.histogram_value
        assert_histogram(histogram, values, edges)
        assert histogram.num == len(values) == tokens[event.step]
        assert histogram.min == pytest.approx(values.min(), rel=1e-6)
        assert histogram.max == pytest.approx(values.max(), rel=1e-6)
        assert histogram.sum == pytest.approx(values.sum(), rel=1e-6, abs=1e-9)
        assert histogram.sum_squares == pytest.approx((values**2).sum(), rel=1e-6)
        total += histogram.num
    # Both windows together: every counting token once.
    assert total == sum(len(counting(data)["r"]) for data in run["batches"])


def test_exact_zero_and_floored_tokens_land_in_the_edge_bins(run: dict[str, Any]) -> None:
    first = min(run["ea"].Histograms(LOG_RATIO_TAG), key=lambda event: event.step)
    histogram = first.histogram_value
    counts = dict(zip(histogram.bucket_limit, histogram.bucket, strict=True))
    middle = len(LOG_RATIO_EDGES) // 2
    assert LOG_RATIO_EDGES[middle - 1] == -(2.0**-20) and LOG_RATIO_EDGES[middle] == 2.0**-20
    assert counts[LOG_RATIO_EDGES[middle]] >= 1  # old[0, 1] == rollout[0, 1]: r == 0
    # rollout[1, 2] = -30 floors to -20, so r = a + 20 > 10: the last non-empty bin.
    assert histogram.max > 10 and histogram.bucket[-1] >= 1
    assert histogram.bucket_limit[-2] <= histogram.max < histogram.bucket_limit[-1]


@pytest.mark.parametrize("bins", [LOG_RATIO_BINS, PROBS_DIFF_BINS], ids=["signed", "unsigned"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_bit_binning_equals_bucketize(bins: QuarterOctaveBins, dtype: torch.dtype) -> None:
    edges = torch.tensor(bins.edges, dtype=dtype)
    up, down = torch.full_like(edges, math.inf), torch.full_like(edges, -math.inf)
    tiny = torch.finfo(dtype).tiny
    special = [0.0, -0.0, tiny, -tiny, tiny / 4, -tiny / 4, 1e-30, -1e-30, 40.0, -40.0, 1.0]
    generator = torch.Generator().manual_seed(0)
    spread = torch.randn(20_000, generator=generator, dtype=dtype)
    spread = spread * torch.exp(5 * torch.randn(20_000, generator=generator, dtype=dtype))
    values = torch.cat(
        [
            edges,
            torch.nextafter(edges, up),
            torch.nextafter(edges, down),
            torch.tensor(special, dtype=dtype),
            spread,
        ]
    )
    if not bins.signed:
        values = values.abs()
    want = torch.bucketize(
        values.double(), torch.tensor(bins.edges, dtype=torch.float64), right=True
    )
    assert torch.equal(bins.index(values), want)


def test_bins_are_symmetric_and_quarter_octaves() -> None:
    edges = np.asarray(LOG_RATIO_EDGES)
    np.testing.assert_array_equal(edges, -edges[::-1])
    positive = edges[edges > 0]
    assert positive[0] == 2.0**-20 and positive[-1] == 32.0 > 20.0
    for magnitudes in (positive, np.asarray(PROBS_DIFF_EDGES)):
        ratios = magnitudes[1:] / magnitudes[:-1]
        assert set(np.round(ratios, 12)) == {1.25, 1.2, round(1.75 / 1.5, 12), round(2 / 1.75, 12)}
        assert np.all(np.float32(magnitudes) == magnitudes)  # exact in float32
    assert PROBS_DIFF_EDGES[0] == 2.0**-27 and PROBS_DIFF_EDGES[-1] == 1.0


# ---------------------------------------------------------------------- worst tokens
def reference_worst(
    window: Sequence[dict[str, torch.Tensor]], k: int, ids: str | None
) -> list[dict[str, Any]]:
    tokens = []
    for index, data in enumerate(window):
        values = counting(data)
        for i in range(len(values["r"])):
            tokens.append(
                {
                    "batch": index,
                    "row": int(values["row"][i]),
                    "position": int(values["position"][i]),
                    "token": None if ids is None else int(values[ids][i]),
                    "rollout prob": values["pb"][i],
                    "actor prob": values["pa"][i],
                    "r": values["r"][i],
                }
            )
    return sorted(tokens, key=lambda token: -abs(token["r"]))[:k]


@pytest.mark.parametrize(
    ("token_ids_keys", "ids"),
    [(None, "responses"), (("tool_ids", "tool_ids"), "tool_ids")],
)
def test_worst_tokens_match_numpy(
    tmp_path: Path, token_ids_keys: tuple[str, str] | None, ids: str
) -> None:
    k = 6
    batches = [batch(seed, rows=5, width=9) for seed in range(10, 14)]
    logger = TensorBoardLogger(tmp_path, name="tb", version=0)
    fit(batches, RolloutDebugCallback(worst_tokens_k=k, token_ids_keys=token_ids_keys), logger)
    events = sorted(accumulator(logger.log_dir).Tensors(TEXT_TAG), key=lambda event: event.step)
    assert len(events) == 2
    for event, window in zip(events, [batches[:2], batches[2:]], strict=True):
        text = event.tensor_proto.string_val[0].decode()
        assert "largest |r|" in text
        rows = parse_table(text)
        want = reference_worst(window, k, ids)
        assert len(rows) == k
        assert "rank" not in rows[0]  # single process
        for got, expected in zip(rows, want, strict=True):
            assert int(got["batch"]) == expected["batch"]
            assert int(got["row"]) == expected["row"]
            assert int(got["position"]) == expected["position"]
            assert int(got["token"]) == expected["token"]
            for column in ("rollout prob", "actor prob"):
                assert float(got[column]) == pytest.approx(expected[column], rel=1e-5)
            assert float(got["r = log(actor/rollout)"]) == pytest.approx(expected["r"], rel=1e-5)


def tied_batch(tokens: Sequence[tuple[int, int, float]]) -> dict[str, torch.Tensor]:
    """A [3, 8] batch whose tokens at ``(row, position)`` have ``r`` as given, the rest 2^-10."""
    rollout = torch.full((3, 8), -1.0)
    old = rollout + 2.0**-10
    for row, position, r in tokens:
        rollout[row, position] = -10.0
        old[row, position] = -10.0 + r
    return {"rollout_log_probs": rollout, "old_log_probs": old, "response_mask": torch.ones(3, 8)}


@pytest.mark.parametrize("compile", [None, False], ids=["native", "torch"])
def test_of_tied_worst_tokens_the_earliest_in_the_window_win(
    tmp_path: Path, compile: bool | None
) -> None:
    """Eight tokens of |r| = 3 in two batches, k = 6: the six earliest, in window order."""
    batches = [
        tied_batch([(0, 5, 3.0), (1, 6, -3.0), (2, 0, 3.0), (2, 7, 3.0)]),
        tied_batch([(0, 0, -3.0), (0, 1, 3.0), (1, 2, 3.0), (2, 0, -3.0)]),
    ]
    monitor = RolloutDebugMonitor(worst_tokens_k=6, alert_ranges={}, compile=compile)
    for data in batches:
        monitor.update(data)
    logger = TensorBoardLogger(tmp_path, name="tb", version=0)
    monitor.log(0, [logger])
    logger.finalize("success")  # the writer's thread has written every event
    (event,) = accumulator(logger.log_dir).Tensors(TEXT_TAG)
    rows = parse_table(event.tensor_proto.string_val[0].decode())
    kept = [(int(row["batch"]), int(row["row"]), int(row["position"])) for row in rows]
    assert kept == [(0, 0, 5), (0, 1, 6), (0, 2, 0), (0, 2, 7), (1, 0, 0), (1, 0, 1)]


def test_worst_tokens_without_ids_have_no_token_column(tmp_path: Path) -> None:
    batches = [batch(seed) for seed in range(2)]
    for data in batches:
        del data["responses"]
    logger = TensorBoardLogger(tmp_path, name="tb", version=0)
    fit(batches, RolloutDebugCallback(worst_tokens_k=3), logger)
    (event,) = accumulator(logger.log_dir).Tensors(TEXT_TAG)
    rows = parse_table(event.tensor_proto.string_val[0].decode())
    assert len(rows) == 3 and "token" not in rows[0]


# ---------------------------------------------------------------------- the tokens' text
SENTENCES = ["the cat sat on the mat", "a|b x*y <s> it's [1] & \\ _z_", "\n \t done"]
"""A tiny corpus split on single spaces: plain words, Markdown's markup, and whitespace
tokens (a newline, a tab)."""
WORDS = ["[UNK]", *sorted({word for line in SENTENCES for word in line.split(" ")})]
SHOWN = {" ": "␣", "\n": "↵", "\t": "→"}
CONTEXT = 6
"""How many tokens before a worst token the table shows (the package's constant)."""


def words_tokenizer() -> Tokenizer:
    """A word-level ``tokenizers.Tokenizer`` over :data:`WORDS`, made here (no download): it
    decodes ids to their words joined by single spaces."""
    vocab = {word: index for index, word in enumerate(WORDS)}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return tokenizer


def visible(text: str) -> str:
    """``text`` as the table shows it: a space ``␣``, a newline ``↵``, a tab ``→``."""
    return "".join(SHOWN.get(character, character) for character in text)


class TableCells(HTMLParser):
    """The text of every cell of an HTML table, row by row (the header row first)."""

    def __init__(self) -> None:
        super().__init__(convert_charrefs=True)
        self.rows: list[list[str]] = []
        self._cell: list[str] | None = None

    def handle_starttag(self, tag: str, attrs: Any) -> None:
        if tag == "tr":
            self.rows.append([])
        elif tag in ("td", "th"):
            self._cell = []

    def handle_endtag(self, tag: str) -> None:
        if tag in ("td", "th") and self._cell is not None:
            self.rows[-1].append("".join(self._cell))
            self._cell = None

    def handle_data(self, data: str) -> None:
        if self._cell is not None:
            self._cell.append(data)


def rendered_table(markdown: str) -> list[dict[str, str]]:
    """The cells of a Markdown table as TensorBoard's text plugin renders them."""
    cells = TableCells()
    cells.feed(plugin_util.markdown_to_safe_html(markdown))
    header, *rows = cells.rows
    return [dict(zip(header, row, strict=True)) for row in rows]


def text_batch(seed: int) -> dict[str, torch.Tensor]:
    """A [4, 10] batch of word ids with its largest |r| planted at the start of a row, a
    few tokens in, at the end of a row, and after masked tokens (which the context shows)."""
    data = make_batch(4, 10, seed=seed, mask="ones", noise=0.01)
    generator = torch.Generator().manual_seed(seed)
    data["responses"] = torch.randint(1, len(WORDS), (4, 10), generator=generator)
    data["response_mask"][3, :4] = 0
    for row, position, shift in [(0, 0, 2.0), (1, 3, 1.5), (2, 9, 1.25), (3, 6, 1.0)]:
        data["old_log_probs"][row, position] = data["rollout_log_probs"][row, position] - shift
    return data


@pytest.mark.parametrize("compile", [None, False], ids=["native", "torch"])
def test_the_table_shows_each_tokens_text_and_the_text_before_it(
    tmp_path: Path, compile: bool | None
) -> None:
    """A real run with a word-level tokenizer: each row's text and context are the words of
    its token and of the ids before it in its row, decoded and shown independently here."""
    k = 6
    batches = [text_batch(seed) for seed in range(80, 84)]
    logger = TensorBoardLogger(tmp_path, name="tb", version=0)
    callback = RolloutDebugCallback(worst_tokens_k=k, tokenizer=words_tokenizer(), compile=compile)
    fit(batches, callback, logger)
    events = sorted(accumulator(logger.log_dir).Tensors(TEXT_TAG), key=lambda event: event.step)
    assert len(events) == 2
    positions = set()
    for event, window in zip(events, [batches[:2], batches[2:]], strict=True):
        text = event.tensor_proto.string_val[0].decode()
        assert "␣ is a space, ↵ a newline, → a tab" in text
        rows = rendered_table(text)
        want = reference_worst(window, k, "responses")
        assert [(int(r["batch"]), int(r["row"]), int(r["position"])) for r in rows] == [
            (w["batch"], w["row"], w["position"]) for w in want
        ]
        for row in rows:
            ids = window[int(row["batch"])]["responses"][int(row["row"])].tolist()
            position = int(row["position"])
            before = [WORDS[i] for i in ids[max(0, position - CONTEXT) : position]]
            assert int(row["token"]) == ids[position]
            assert row["context"] == visible(" ".join(before))
            assert row["text"] == visible(" " * bool(before) + WORDS[ids[position]])
            positions.add(position)
    assert {0, 3, 9} <= positions  # no context, part of it, the whole of it


MARKUP = ["|", "a|b", "\n", " ", "\t", " x ", "*x*", "_x_", "<s>", "&amp;", "\\", "[1](u)", "`c`"]


@pytest.mark.parametrize("text", MARKUP, ids=[repr(text) for text in MARKUP])
def test_a_cell_shows_its_text_as_it_is_with_whitespace_made_visible(text: str) -> None:
    """Rendered by TensorBoard's own Markdown, a cell reads the text: a pipe does not split
    the row, markup is not applied, whitespace shows as a sign."""
    cell = markdown_cell(text)
    assert "\n" not in cell and " " not in cell
    (row,) = rendered_table(f"| a | cell | b |\n|---|---|---|\n| 1 | {cell} | 2 |")
    assert row == {"a": "1", "cell": visible(text), "b": "2"}


class IdsToTokens:
    """A tokenizer of the ``convert_ids_to_tokens`` shape alone."""

    def convert_ids_to_tokens(self, ids: list[int]) -> list[str]:
        return [WORDS[i] for i in ids]


class IdToToken:
    """A tokenizer of the ``id_to_token`` shape alone (a word or None)."""

    def id_to_token(self, index: int) -> str | None:
        return WORDS[index] if index < len(WORDS) else None


def transformers_tokenizer() -> Any:
    transformers = pytest.importorskip("transformers")
    return transformers.PreTrainedTokenizerFast(tokenizer_object=words_tokenizer())


@pytest.mark.parametrize(
    ("make", "spaced"),
    [
        (words_tokenizer, True),
        (transformers_tokenizer, True),
        (IdsToTokens, False),
        (IdToToken, False),
    ],
    ids=["tokenizers", "transformers", "convert_ids_to_tokens", "id_to_token"],
)
def test_every_shape_of_tokenizer_gives_the_words(make: Any, spaced: bool) -> None:
    """``decode`` gives each word with the space the decoded text puts before it; the
    token-by-token shapes give the words alone; an unknown id shows as itself."""
    ids = [WORDS.index(word) for word in ("the", "a|b", "\n", "cat")]
    context, text = TokenText(make()).cells(ids[:-1], ids[-1])
    space = " " if spaced else ""
    assert context == markdown_cell(space.join(["the", "a|b", "\n"]))
    assert text == markdown_cell(space + "cat")
    unknown = len(WORDS) + 5
    assert TokenText(make()).cells([], unknown) == ("", f"⟨{unknown}⟩")


def test_bytes_that_do_not_decode_show_as_their_ids() -> None:
    """A byte-level BPE trained here: an emoji's four bytes are four tokens, none of which
    is text of its own."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300,
        min_frequency=2,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    corpus = ["the cat sat on the mat", "the cat ate", "a mat for the cat", "the cat 😀"]
    tokenizer.train_from_iterator(corpus, trainer=trainer)
    ids = tokenizer.encode("the cat 😀").ids
    split = [i for i in ids if "\ufffd" in tokenizer.decode([i])]
    assert len(split) == 4 and ids[-4:] == split
    context, text = TokenText(tokenizer).cells(ids[:-1], ids[-1])
    words = visible(tokenizer.decode(ids[:-4]))
    assert words == "the␣cat␣"
    assert context == words + "".join(f"⟨{i}⟩" for i in split[:-1])
    assert text == f"⟨{split[-1]}⟩"


class Broken:
    def decode(self, ids: list[int]) -> str:
        raise RuntimeError("no vocabulary loaded")


def test_a_failing_tokenizer_shows_the_ids_and_warns_once(tmp_path: Path) -> None:
    monitor = RolloutDebugMonitor(worst_tokens_k=2, tokenizer=Broken(), alert_ranges={})
    logger = TensorBoardLogger(tmp_path, name="tb", version=0)
    with pytest.warns(RolloutDebugWarning, match="the tokenizer failed") as warned:
        for step in range(2):
            monitor.update(text_batch(step))
            monitor.log(step, [logger])
    assert sum("tokenizer failed" in str(w.message) for w in warned) == 1
    logger.finalize("success")
    events = accumulator(logger.log_dir).Tensors(TEXT_TAG)
    rows = rendered_table(events[0].tensor_proto.string_val[0].decode())
    assert all(row["text"] == f"⟨{row['token']}⟩" for row in rows)


def test_without_a_tokenizer_or_ids_the_table_has_no_text() -> None:
    data = text_batch(5)
    monitor = RolloutDebugMonitor(worst_tokens_k=3, alert_ranges={})
    extras = monitor._extras
    assert extras is not None
    extras.update(*tensors(data), data["responses"])
    table = worst_tokens_markdown(extras.summary(extras.state).worst_tokens)
    assert "context" not in table and "| token |" in table
    extras = TokenExtras(worst_tokens_k=3)
    extras.update(*tensors(data))
    worst = extras.summary(extras.state).worst_tokens
    table = worst_tokens_markdown(worst, token_text=TokenText(words_tokenizer()))
    assert "context" not in table and "token" not in table
    assert all(token.context == () for token in worst)


class TextWriter:
    """Keeps what ``add_text`` is given, as a ``SummaryWriter`` would write it."""

    def __init__(self) -> None:
        self.texts: dict[str, str] = {}

    def add_text(self, tag: str, text: str, step: int) -> None:
        self.texts[tag] = text


def test_the_table_names_each_tokens_segment() -> None:
    """Segment ``i`` shows ``segment_names[i]`` (``other`` the last), its number beyond
    them, ``-`` for a token of a batch without labels; no column where no token has one."""
    place = {"batch": 0, "row": 1, "token_id": None, "rank": 0}
    tokens = [
        WorstToken(-0.5, 0.2, 0.33, position=0, segment=0, **place),
        WorstToken(0.4, 0.3, 0.2, position=1, segment=2, **place),
        WorstToken(0.3, 0.3, 0.22, position=2, segment=5, **place),
        WorstToken(0.2, 0.3, 0.25, position=3, **place),
    ]
    names = ("math", "tool use", "other")  # two segments, then other
    rows = parse_table(worst_tokens_markdown(tokens, segment_names=names))
    assert [row["segment"] for row in rows] == ["math", "other", "5", "-"]
    assert [row["position"] for row in rows] == ["0", "1", "2", "3"]
    numbered = parse_table(worst_tokens_markdown(tokens))
    assert [row["segment"] for row in numbered] == ["0", "2", "5", "-"]
    unlabelled = [WorstToken(0.2, 0.3, 0.25, position=3, **place)]
    assert "segment" not in worst_tokens_markdown(unlabelled)

    writer = TextWriter()
    write_extras(writer, PREFIX, ExtrasSummary({}, tokens), 0, segment_names=names)
    (text,) = writer.texts.values()
    assert SEGMENT_CAPTION in text and "| segment |" in text
    write_extras(writer, PREFIX, ExtrasSummary({}, unlabelled), 0, segment_names=names)
    (text,) = writer.texts.values()
    assert SEGMENT_CAPTION not in text and "segment" not in text


def test_the_tokenizer_is_checked_at_once_and_shapes_no_state() -> None:
    with pytest.raises(ValueError) as error:
        RolloutDebugCallback(tokenizer="gpt2", worst_tokens_k=-1)
    message = str(error.value)
    assert "`worst_tokens_k`" in message and "AutoTokenizer.from_pretrained" in message
    for accepted in ("decode(ids)", "convert_ids_to_tokens(ids)", "id_to_token(id)"):
        assert accepted in message
    for wrong in (object(), Tokenizer, 3):
        with pytest.raises(ValueError, match="`tokenizer` must be None or a tokenizer"):
            RolloutDebugMonitor(tokenizer=wrong)
    callback = RolloutDebugCallback(tokenizer=words_tokenizer())
    plain = RolloutDebugCallback()
    assert callback.config == plain.config
    assert callback.config.checkpoint_identity() == plain.config.checkpoint_identity()
    assert callback.monitor._extras.size == plain.monitor._extras.size
    restored = pickle.loads(pickle.dumps(callback))  # ddp_spawn sends the callback so
    assert restored.config.tokenizer.decode([1]) == WORDS[1]


@pytest.mark.parametrize("road", ["native", "torch", pytest.param("compiled", marks=NEEDS_CXX)])
def test_the_context_is_the_ids_before_the_token_in_its_row(
    road: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every road, passes of a few rows, and two ranks merged: each worst token keeps the
    ids of up to six tokens before it in its own row, none from the row before."""
    compile = {"native": None, "torch": False, "compiled": True}[road]
    if road == "compiled":  # torch.compile on the CPU, as an accelerator's road
        monkeypatch.setattr(native.passes, "_pass", lambda *args, **kwargs: None)
        monkeypatch.setattr(backends, "_compiling", {"functions": {}, "failed": {}})
    batches = [text_batch(seed) for seed in (90, 91)]
    ranks = []
    for rank, data in enumerate(batches):
        extras = TokenExtras(worst_tokens_k=20, chunk_tokens=20, compile=compile)
        extras.update(*tensors(data), data["responses"].int(), batch_index=1, rank=rank)
        ranks.append(extras)
    merged = ranks[0].summary(ranks[0].merge_states(torch.stack([e.state for e in ranks])))
    assert len(merged.worst_tokens) == 20
    for token in merged.worst_tokens:
        ids = batches[token.rank]["responses"][token.row].tolist()
        assert token.token_id == ids[token.position]
        assert list(token.context) == ids[max(0, token.position - CONTEXT) : token.position]
    if road == "compiled":
        assert not backends._compiling["failed"] and len(backends._compiling["functions"]) == 1


# ---------------------------------------------------------------------- layout
def test_layout_written_once_and_matches_logged_tags(run: dict[str, Any]) -> None:
    (event,) = run["ea"].Tensors(LAYOUT_TAG)
    layout = layout_pb2.Layout()
    layout.ParseFromString(event.tensor_proto.string_val[0])
    titles = [category.title for category in layout.category]
    assert titles == [
        f"{PREFIX}{name}"
        for name in ("agreement", "divergence", "sequences", "health", "quantiles")
    ]
    scalars = run["ea"].Tags()["scalars"]
    charted = set()
    for category in layout.category:
        for chart in category.chart:
            for pattern in chart.multiline.tag:
                matches = [tag for tag in scalars if re.match(pattern, tag)]
                assert len(matches) == 1, (chart.title, pattern, matches)
                charted.update(matches)
    # Every metric is on the dashboard (token-id charts only appear with token ids).
    assert charted == {tag for tag in scalars if tag.startswith(PREFIX)}


@pytest.mark.parametrize("lit", PACKAGES)
def test_a_logger_prefix_goes_in_front_of_every_tag_and_chart(
    tmp_path: Path, lit: Lightning
) -> None:
    """``TensorBoardLogger(prefix="rl")`` writes the scalars as ``rl-training/...``: the
    extras and the pictures follow, and the dashboard charts those names."""
    logger = lit.loggers.TensorBoardLogger(tmp_path, name="tb", version=0, prefix="rl")
    fit([batch(seed) for seed in range(4)], RolloutDebugCallback(worst_tokens_k=5), logger, lit)
    ea = accumulator(logger.log_dir)
    tags = ea.Tags()
    ours = f"rl-{PREFIX}"
    written = [*tags["scalars"], *tags["histograms"], *tags["images"], *tags["tensors"]]
    assert f"{ours}rollout_profile/joint" in tags["images"]
    assert f"{ours}rollout_log_ratio_hist" in tags["histograms"]
    assert f"{ours}rollout_worst_tokens/text_summary" in tags["tensors"]
    module_scalars = {"rl-loss", "rl-epoch"}  # the module's own, prefixed by the logger
    ours_written = [tag for tag in written if tag not in {LAYOUT_TAG, *module_scalars}]
    assert all(tag.startswith(ours) for tag in ours_written), written
    (event,) = ea.Tensors(LAYOUT_TAG)
    layout = layout_pb2.Layout()
    layout.ParseFromString(event.tensor_proto.string_val[0])
    charted = set()
    for category in layout.category:
        assert category.title.startswith(ours)
        for chart in category.chart:
            for pattern in chart.multiline.tag:
                matches = [tag for tag in tags["scalars"] if re.match(pattern, tag)]
                assert len(matches) == 1, (chart.title, pattern, matches)
                charted.update(matches)
    assert charted == {tag for tag in tags["scalars"] if tag.startswith(ours)}


def served_layout(root: Path) -> list[str]:
    """The category titles TensorBoard's custom-scalars page serves for the runs under ``root``."""
    from tensorboard import context
    from tensorboard.backend.event_processing import data_provider, plugin_event_multiplexer
    from tensorboard.plugins import base_plugin
    from tensorboard.plugins.custom_scalar import custom_scalars_plugin

    multiplexer = plugin_event_multiplexer.EventMultiplexer()
    multiplexer.AddRunsFromDirectory(str(root))
    multiplexer.Reload()
    provider = data_provider.MultiplexerDataProvider(multiplexer, str(root))
    plugin = custom_scalars_plugin.CustomScalarsPlugin(
        base_plugin.TBContext(logdir=str(root), multiplexer=multiplexer, data_provider=provider)
    )
    layout = json.loads(plugin.layout_impl(context.RequestContext(), ""))  # the JSON it serves
    return [category["title"] for category in layout["category"]]


def test_callbacks_with_different_prefixes_each_keep_their_dashboard(tmp_path: Path) -> None:
    callbacks = [
        RolloutDebugCallback(prefix="a/", worst_tokens_k=0),
        RolloutDebugCallback(prefix="b/", groups=["seed", "kl"], worst_tokens_k=0),
    ]
    logger = TensorBoardLogger(tmp_path, name="tb", version=0)
    options = {**TRAINER_DEFAULTS, "max_steps": 4, "log_every_n_steps": 2}
    trainer = pl.Trainer(**options, logger=logger, callbacks=callbacks)
    trainer.fit(RolloutModule([batch(seed) for seed in range(4)]))
    want = [
        title
        for callback in callbacks
        for title in dashboard_layout(
            callback.config.prefix, enabled_metric_names(callback.config.groups)
        )
    ]
    assert served_layout(tmp_path / "tb") == want


def test_a_callback_fitted_again_draws_and_warns_in_its_new_run(tmp_path: Path) -> None:
    batches = [batch(seed) for seed in range(4)]
    for data in batches:
        del data["response_mask"], data["responses"]  # every position counts: one warning
    callback = RolloutDebugCallback(worst_tokens_k=0)
    for version in range(2):
        logger = TensorBoardLogger(tmp_path, name="tb", version=version)
        with pytest.warns(UserWarning) as caught:
            fit(batches, callback, logger)
        fallbacks = [w for w in caught if "response positions counts" in str(w.message)]
        assert len(fallbacks) == 1, (version, [str(w.message) for w in caught])
        images = accumulator(logger.log_dir).Tags()["images"]
        assert f"{PREFIX}rollout_profile/joint" in images, version


def test_layout_follows_groups_and_prefix() -> None:
    layout = dashboard_layout("rl.v2/", ["rollout_probs_diff_mean", "rollout_tokens"])
    assert list(layout) == ["rl.v2/agreement", "rl.v2/health"]
    (chart,) = layout["rl.v2/agreement"].values()
    assert chart == ["Multiline", [r"^rl\.v2/rollout_probs_diff_mean$"]]
    every = [name for _, charts in DASHBOARD for _, names in charts for name in names]
    assert len(every) == len(set(every))


def test_the_segments_category_charts_each_metric_with_every_segment() -> None:
    metrics = ("rollout_tokens", "rollout_actor_kl_k3")
    layout = dashboard_layout("rl.v2/", ["rollout_tokens"], metrics)
    assert list(layout) == ["rl.v2/health", "rl.v2/segments"]
    assert dashboard_layout("rl.v2/", ["rollout_tokens"]) == {
        "rl.v2/health": layout["rl.v2/health"]
    }
    charts = layout["rl.v2/segments"]
    assert list(charts) == [f"{metric} by segment" for metric in metrics]
    kind, (pattern,) = charts["rollout_actor_kl_k3 by segment"]
    assert kind == "Multiline"
    tags = {
        "rl.v2/segments/0/rollout_actor_kl_k3": True,
        "rl.v2/segments/math.hard/rollout_actor_kl_k3": True,
        "rl.v2/segments/other/rollout_actor_kl_k3": True,
        "rl.v2/rollout_actor_kl_k3": False,  # the window's own
        "rl.v2/segments/0/rollout_actor_kl_k1": False,
        "rl.v2/segments/0/rollout_actor_kl_k3_x": False,
        "rl.v2/segments/a/b/rollout_actor_kl_k3": False,
        "rl.v2/segments//rollout_actor_kl_k3": False,
        "rlxv2/segments/0/rollout_actor_kl_k3": False,  # the prefix is escaped
        "a/rl.v2/segments/0/rollout_actor_kl_k3": False,
    }
    assert {tag: bool(re.match(pattern, tag)) for tag in tags} == tags


def segment_scalars(names: Sequence[str], metrics: Sequence[str]) -> dict[str, float]:
    """A logged window's scalars with a value of each metric for each named segment."""
    scalars = {f"{PREFIX}{metric}": 2.0 for metric in metrics}
    scalars.update(
        {f"{PREFIX}segments/{name}/{metric}": 1.0 for name in names for metric in metrics}
    )
    return scalars


def read_layouts(ea: EventAccumulator) -> list[layout_pb2.Layout]:
    """Every custom-scalars layout a run wrote, in order."""
    layouts = []
    for event in ea.Tensors(LAYOUT_TAG):
        layout = layout_pb2.Layout()
        layout.ParseFromString(event.tensor_proto.string_val[0])
        layouts.append(layout)
    return layouts


@pytest.mark.parametrize("lit", PACKAGES)
def test_the_layout_is_written_again_with_the_segments_at_their_first_window(
    tmp_path: Path, lit: Lightning
) -> None:
    """Once without segments, once more at the first window that logs segments, then
    never again: TensorBoard serves the last, whose charts find every segment's tags."""
    logger = lit.loggers.TensorBoardLogger(tmp_path, name="tb", version=0, prefix="rl")
    metrics = ("rollout_tokens", "rollout_actor_kl_k3")

    def fail(kind: str, message: str) -> None:
        raise AssertionError(message)

    logs = WindowLogs(
        prefix=PREFIX,
        groups=("kl", "health"),
        dashboard_layout=True,
        profile_images=False,
        profile_images_every_n_steps=50,
        strict=True,
        warn_once=fail,
        segment_metrics=metrics,
    )
    plain = segment_scalars([], metrics)
    segmented = segment_scalars(["0", "math", "other"], metrics)
    for step, scalars in enumerate([plain, plain, segmented, plain, segmented]):
        logs.write([logger], scalars, None, None, step)
    logger.finalize("success")

    ea = accumulator(logger.log_dir)
    ours = f"rl-{PREFIX}"
    first, last = read_layouts(ea)
    titles = [f"{ours}{category}" for category in ("divergence", "health")]
    assert [category.title for category in first.category] == titles
    assert [category.title for category in last.category] == [*titles, f"{ours}segments"]
    assert served_layout(tmp_path / "tb") == [*titles, f"{ours}segments"]
    scalars = ea.Tags()["scalars"]
    (segments,) = (c for c in last.category if c.title == f"{ours}segments")
    assert [chart.title for chart in segments.chart] == [f"{m} by segment" for m in metrics]
    for chart, metric in zip(segments.chart, metrics, strict=True):
        (pattern,) = chart.multiline.tag
        found = {tag for tag in scalars if re.match(pattern, tag)}
        assert found == {f"{ours}segments/{name}/{metric}" for name in ("0", "math", "other")}


def labelled(seed: int) -> dict[str, torch.Tensor]:
    """A batch of :func:`batch` whose tokens are labelled by turn: 0 for the first three
    positions, 1 after; the label of row 1 (7, that of its floored token of large ``abs(r)``)
    is outside ``max_segments=2``."""
    data = batch(seed)
    turns = (torch.arange(7) >= 3).long().repeat(4, 1)
    turns[1] = 7
    return {**data, "segment_ids": turns}


def test_a_run_that_logs_segments_charts_them_and_names_its_worst_tokens(tmp_path: Path) -> None:
    """A first window without labels, two with: the layout is written without the
    segments' category, then once more with it, whose charts find the tags the run
    logged; the worst-tokens tables name each labelled token's segment."""
    batches = [batch(0), batch(1), *(labelled(seed) for seed in range(2, 6))]
    names = {0: "first", 1: "second", 7: "other"}
    callback = RolloutDebugCallback(
        worst_tokens_k=6, max_segments=2, segment_names=["first", "second"]
    )
    logger = TensorBoardLogger(tmp_path, name="tb", version=0)
    with pytest.warns(UserWarning, match="holds labels outside"):
        fit(batches, callback, logger)

    ea = accumulator(logger.log_dir)
    first, last = read_layouts(ea)
    assert f"{PREFIX}segments" not in [category.title for category in first.category]
    titles = [category.title for category in last.category]
    assert titles == [*(c.title for c in first.category), f"{PREFIX}segments"]
    assert served_layout(tmp_path / "tb") == titles
    scalars = ea.Tags()["scalars"]
    (segments,) = (c for c in last.category if c.title == f"{PREFIX}segments")
    metrics = callback.config.segment_metrics
    assert [chart.title for chart in segments.chart] == [f"{m} by segment" for m in metrics]
    for chart, metric in zip(segments.chart, metrics, strict=True):
        (pattern,) = chart.multiline.tag
        found = {tag for tag in scalars if re.match(pattern, tag)}
        assert found == {f"{PREFIX}segments/{name}/{metric}" for name in names.values()}

    events = sorted(ea.Tensors(TEXT_TAG), key=lambda event: event.step)
    tables = [parse_table(event.tensor_proto.string_val[0].decode()) for event in events]
    assert len(tables) == 3 and "segment" not in tables[0][0]
    shown = set()
    for table, window in zip(tables[1:], [batches[2:4], batches[4:]], strict=True):
        for row in table:
            labels = window[int(row["batch"])]["segment_ids"]
            assert row["segment"] == names[int(labels[int(row["row"]), int(row["position"])])]
            shown.add(row["segment"])
    assert shown == set(names.values())


# ---------------------------------------------------------------------- loggers, flags
def test_csv_logger_only_gets_scalars_and_nothing_fails(tmp_path: Path) -> None:
    batches = [batch(seed) for seed in range(4)]
    logger = CSVLogger(tmp_path, name="csv", version=0)
    fit(batches, RolloutDebugCallback(), logger)
    series = read_csv_metrics(Path(logger.log_dir) / "metrics.csv")
    assert sorted(series[f"{PREFIX}rollout_tokens"]) == [1, 3]
    assert not list(tmp_path.rglob("events.out.tfevents.*"))


@pytest.mark.parametrize("lit", PACKAGES)
def test_csv_and_tensorboard_together(tmp_path: Path, lit: Lightning) -> None:
    batches = [batch(seed) for seed in range(2)]
    csv = lit.loggers.CSVLogger(tmp_path, name="csv", version=0)
    tb = lit.loggers.TensorBoardLogger(tmp_path, name="tb", version=0)
    fit(batches, RolloutDebugCallback(), [csv, tb], lit)
    assert f"{PREFIX}rollout_tokens" in read_csv_metrics(Path(csv.log_dir) / "metrics.csv")
    tags = accumulator(tb.log_dir).Tags()
    assert LOG_RATIO_TAG in tags["histograms"] and TEXT_TAG in tags["tensors"]


def scalar_series(log_dir: str | Path, prefix: str) -> dict[str, list[tuple[int, float]]]:
    ea = accumulator(log_dir)
    return {
        tag: [(s.step, s.value) for s in ea.Scalars(tag)]
        for tag in ea.Tags()["scalars"]
        if tag.startswith(prefix)
    }


@pytest.mark.parametrize("lit", PACKAGES)
def test_a_logged_steps_scalars_are_what_log_metrics_writes(tmp_path: Path, lit: Lightning) -> None:
    """Beside a subclass of the logger with its own ``log_metrics`` (which calls
    Lightning's), the same tags, steps and values, with the logger's prefix: the scalars
    go through each logger's ``log_metrics``."""

    class OwnLogMetrics(lit.loggers.TensorBoardLogger):  # type: ignore[name-defined]
        def log_metrics(self, metrics: Any, step: int | None = None) -> None:
            super().log_metrics(metrics, step)

    batches = [batch(seed) for seed in range(4)]
    stock = lit.loggers.TensorBoardLogger(tmp_path, name="stock", version=0, prefix="run")
    own = OwnLogMetrics(tmp_path, name="own", version=0, prefix="run")
    fit(batches, RolloutDebugCallback(), [stock, own], lit)
    ours = f"run-{PREFIX}"
    series = scalar_series(stock.log_dir, ours)
    assert f"{ours}rollout_tokens" in series and not scalar_series(stock.log_dir, PREFIX)
    assert series == scalar_series(own.log_dir, ours)
    assert {step for values in series.values() for step, _ in values} == {1, 3}


# ---------------------------------------------------------------------- event checksums
def records(path: Path) -> list[bytes]:
    """Every record of an event file, each checked by TensorBoard's reader (its own checksum)."""
    reader = pywrap_tensorflow.PyRecordReader_New(str(path))
    found = []
    while True:
        try:
            reader.GetNext()
        except errors.OutOfRangeError:
            return found
        found.append(reader.record())


def test_a_run_writes_event_files_that_tensorboards_reader_checks(tmp_path: Path) -> None:
    """Every record's checksum is accepted by TensorBoard's reader, which checks them."""
    logger = TensorBoardLogger(tmp_path, name="tb", version=0)
    fit([batch(seed) for seed in range(4)], RolloutDebugCallback(), logger)
    (path,) = Path(logger.log_dir).glob("events.out.tfevents.*")
    found = records(path)
    pictures = [record for record in found if b"rollout_profile/joint" in record]
    assert len(found) > 10 and len(pictures) == 1 and len(pictures[0]) > 5000
    assert f"{PREFIX}rollout_profile/joint" in accumulator(logger.log_dir).Tags()["images"]
    # The reader does check: one byte changed in the pictures' record is refused.
    data = bytearray(path.read_bytes())
    data[data.index(pictures[0]) + len(pictures[0]) // 2] ^= 0x01
    path.write_bytes(bytes(data))
    with pytest.raises(errors.DataLossError, match="crc32"):
        records(path)


def test_extras_can_be_turned_off(tmp_path: Path) -> None:
    batches = [batch(seed) for seed in range(2)]
    logger = TensorBoardLogger(tmp_path, name="tb", version=0)
    callback = RolloutDebugCallback(histograms=False, worst_tokens_k=0, dashboard_layout=False)
    fit(batches, callback, logger)
    tags = accumulator(logger.log_dir).Tags()
    assert tags["histograms"] == [] and tags["tensors"] == []
    assert f"{PREFIX}rollout_tokens" in tags["scalars"]


def test_only_histograms(tmp_path: Path) -> None:
    batches = [batch(seed) for seed in range(2)]
    logger = TensorBoardLogger(tmp_path, name="tb", version=0)
    fit(batches, RolloutDebugCallback(worst_tokens_k=0, dashboard_layout=False), logger)
    tags = accumulator(logger.log_dir).Tags()
    assert sorted(tags["histograms"]) == sorted([LOG_RATIO_TAG, PROBS_DIFF_TAG])
    assert tags["tensors"] == []


def test_invalid_extras_arguments_are_all_reported() -> None:
    with pytest.raises(ValueError) as error:
        RolloutDebugCallback(histograms="yes", worst_tokens_k=-1, dashboard_layout=None, prefix=3)
    message = str(error.value)
    for name in ("histograms", "worst_tokens_k", "dashboard_layout", "prefix"):
        assert f"`{name}`" in message


# ---------------------------------------------------------------------- the state
def tensors(data: dict[str, torch.Tensor]) -> tuple[torch.Tensor, ...]:
    return data["rollout_log_probs"], data["old_log_probs"], data["response_mask"]


def test_merge_of_ranks_equals_one_window_of_all_tokens() -> None:
    first, second = batch(20, rows=6, width=11), batch(21, rows=4, width=11)
    ranks = []
    for rank, data in enumerate((first, second)):
        extras = TokenExtras(worst_tokens_k=8)
        extras.update(*tensors(data), data["responses"], rank=rank)
        ranks.append(extras)
    merged = ranks[0].summary(ranks[0].merge_states(torch.stack([e.state for e in ranks])))
    values = [counting(first), counting(second)]
    for name, key in (("rollout_log_ratio_hist", "r"), ("rollout_probs_diff_hist", "dp")):
        edges = dict(HISTOGRAMS)[name].edges
        both = np.concatenate([v[key] for v in values])
        np.testing.assert_array_equal(merged.histograms[name].counts, reference_counts(both, edges))
        assert merged.histograms[name].num == len(both)
        assert merged.histograms[name].max == pytest.approx(both.max(), rel=1e-6)
    everyone = sorted(
        ((abs(r), rank) for rank, v in enumerate(values) for r in v["r"]), reverse=True
    )[:8]
    assert [token.rank for token in merged.worst_tokens] == [rank for _, rank in everyone]
    assert [abs(token.log_ratio) for token in merged.worst_tokens] == pytest.approx(
        [value for value, _ in everyone], rel=1e-6
    )


def test_chunks_and_batches_do_not_change_the_result() -> None:
    data = batch(30, rows=9, width=13)
    whole = TokenExtras(worst_tokens_k=7)
    whole.update(*tensors(data), data["responses"])
    chunked = TokenExtras(worst_tokens_k=7, chunk_tokens=20)
    chunked.update(*tensors(data), data["responses"])
    size = len(WORST_FIELDS) * 7
    torch.testing.assert_close(whole.state[:-size], chunked.state[:-size], rtol=1e-12, atol=0)
    a, b = whole.summary(whole.state), chunked.summary(chunked.state)
    assert a.worst_tokens == b.worst_tokens


def test_empty_windows_and_tiny_batches() -> None:
    extras = TokenExtras(worst_tokens_k=4)
    empty = extras.summary(extras.state)
    assert all(h.num == 0 for h in empty.histograms.values()) and empty.worst_tokens == []
    extras.update(torch.zeros(0, 5), torch.zeros(0, 5), torch.ones(0, 5))
    assert extras.summary(extras.state).worst_tokens == []
    extras.update(
        torch.tensor([[-1.0, -2.0]]), torch.tensor([[-1.5, -2.0]]), torch.tensor([[1, 0]])
    )
    summary = extras.summary(extras.state)
    assert len(summary.worst_tokens) == 1  # fewer tokens than k: only the real ones
    assert summary.worst_tokens[0].log_ratio == pytest.approx(-0.5)
    assert summary.worst_tokens[0].token_id is None
    assert extras.state.shape == (extras.size,)


def test_all_ranks_sends_stats_and_extras_in_one_collective() -> None:
    """Two simulated ranks: one ``all_gather`` of one vector, split and merged per part
    (after the one that compares their settings, before the first merge only)."""
    batches = [batch(40), batch(41, rows=5)]
    monitors = [RolloutDebugMonitor(worst_tokens_k=4) for _ in batches]
    for rank, (monitor, data) in enumerate(zip(monitors, batches, strict=True)):
        monitor.rank = rank
        monitor.update(data)
    sent = []

    def all_gather(tensor: torch.Tensor) -> torch.Tensor:
        sent.append(tensor)
        if len(sent) == 1:  # the settings: the same on both ranks
            return torch.stack([tensor, tensor])
        parts = monitors[1]._window.parts(torch.device("cpu"))
        return torch.stack([tensor, torch.cat([part for part in parts if part is not None])])

    ranks = Ranks(world_size=2, is_global_zero=True, gather=all_gather)
    stats, extras, *_ = monitors[0]._window.on_host(ranks)
    parts = monitors[0]._window.parts(torch.device("cpu"))
    assert [len(vector) for vector in sent] == [WIDTH, sum(len(p) for p in parts if p is not None)]
    assert sent[1].dtype == torch.float64
    monitors[0]._window.on_host(ranks)  # the next merge compares nothing
    assert len(sent) == 3 and len(sent[2]) == len(sent[1])
    tokens = sum(len(counting(data)["r"]) for data in batches)
    assert stats.compute()["rollout_tokens"] == tokens
    assert extras.histograms["rollout_log_ratio_hist"].num == tokens
    assert {token.rank for token in extras.worst_tokens} == {0, 1}
    want = sorted((abs(r) for data in batches for r in counting(data)["r"]), reverse=True)[:4]
    assert [abs(t.log_ratio) for t in extras.worst_tokens] == pytest.approx(want, rel=1e-6)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_update_does_not_synchronize_on_cuda() -> None:
    data = {key: value.cuda() for key, value in batch(50, rows=64, width=128).items()}
    extras = TokenExtras(worst_tokens_k=10, chunk_tokens=1024)
    extras.update(*tensors(data), data["responses"])  # warm-up: CUDA context, kernels
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for index in range(3):
            extras.update(*tensors(data), data["responses"], batch_index=index)
        merged = extras.merge_states(torch.stack([extras.state, extras.state]))
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert merged.device.type == "cuda"


class OpRecorder(TorchDispatchMode):
    """Records the name of every aten op that reaches the dispatcher."""

    def __init__(self) -> None:
        super().__init__()
        self.names: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.names.append(func._schema.name)
        return func(*args, **(kwargs or {}))


WAITING_OPS = {
    "aten::_local_scalar_dense",
    "aten::item",
    "aten::nonzero",
    "aten::masked_select",
    "aten::is_nonzero",
    "aten::bincount",  # sizes its output from the data's maximum
    "aten::histc",
    "aten::unique",
    "aten::_unique2",
    "aten::_copy_from",
}


def test_update_and_merge_use_no_op_that_waits_for_the_device() -> None:
    """The torch arithmetic (the path of accelerators)."""
    data = batch(60)
    extras = TokenExtras(worst_tokens_k=5, chunk_tokens=8, compile=False)
    with OpRecorder() as recorder:
        extras.update(*tensors(data), data["responses"], batch_index=1)
        extras.merge_states(torch.stack([extras.state, extras.state]))
    assert "aten::index_add_" in recorder.names  # the counted bins, in one scatter
    assert not WAITING_OPS & set(recorder.names)


def test_update_runs_on_fake_tensors() -> None:
    """Nothing data-dependent reaches the host: a fake tensor has no data to read."""
    extras = TokenExtras(worst_tokens_k=5)
    with FakeTensorMode() as fake:
        values = fake.from_tensor(torch.randn(4, 8))
        ids = fake.from_tensor(torch.zeros(4, 8, dtype=torch.long))
        mask = fake.from_tensor(torch.ones(4, 8))
        extras.update(values, values, mask, ids)
        extras.update(values, values, mask, ids)
        assert isinstance(extras.state, FakeTensor) and extras.state.shape == (extras.size,)


def test_tensors_without_data_are_refused() -> None:
    extras = TokenExtras(worst_tokens_k=5)
    values = torch.randn(4, 8, device="meta")
    with pytest.raises(ValueError, match="is a meta tensor"):
        extras.update(values, values, torch.ones(4, 8, device="meta"))
    assert extras.state.device.type == "cpu"  # the window never moved


PLACE = ("row", "position", "responses")


def rows_match(rows: list[dict[str, str]], places: list[set], assignment: tuple[int, ...]) -> bool:
    """Every table row is a token of the batch that ``assignment`` gives its rank."""
    return all(
        (int(row["row"]), int(row["position"]), int(row["token"]))
        in places[assignment[int(row["rank"])]]
        for row in rows
    )


@pytest.mark.skipif(
    not torch.distributed.is_available() or not torch.distributed.is_gloo_available(),
    reason="needs torch.distributed with the gloo backend",
)
def test_two_ranks_histograms_and_worst_tokens_cover_both(tmp_path: Path) -> None:
    """A real ``ddp_spawn`` run on two CPU processes: rank 0 writes every rank's tokens."""
    batches = [batch(seed, rows=4 + seed % 2, width=8) for seed in range(70, 74)]
    logger = TensorBoardLogger(tmp_path, name="tb", version=0)
    trainer = pl.Trainer(
        **{**TRAINER_DEFAULTS, "devices": 2},
        strategy="ddp_spawn",
        max_steps=2,
        log_every_n_steps=1,
        logger=logger,
        callbacks=[RolloutDebugCallback(worst_tokens_k=5), ReleaseProcessGroups()],
    )
    trainer.fit(RolloutModule(batches))
    ea = accumulator(logger.log_dir)
    # Step s merges batches 2s and 2s + 1, one per rank (which rank has which is the
    # sampler's business: the table must match one of the two assignments).
    windows = {0: batches[0:2], 1: batches[2:4]}
    histograms = {event.step: event.histogram_value for event in ea.Histograms(LOG_RATIO_TAG)}
    texts = {e.step: e.tensor_proto.string_val[0].decode() for e in ea.Tensors(TEXT_TAG)}
    assert sorted(histograms) == sorted(texts) == [0, 1]
    ranks_seen = set()
    for step, window in windows.items():
        values = np.concatenate([counting(data)["r"] for data in window])
        assert_histogram(histograms[step], values, LOG_RATIO_EDGES)
        assert histograms[step].num == len(values)
        rows = parse_table(texts[step])
        want = sorted((abs(r) for data in window for r in counting(data)["r"]), reverse=True)[:5]
        got = [abs(float(row["r = log(actor/rollout)"])) for row in rows]
        assert got == pytest.approx(want, rel=1e-5)
        places = [
            set(zip(*(counting(data)[key].tolist() for key in PLACE), strict=True))
            for data in window
        ]
        assert rows_match(rows, places, (0, 1)) != rows_match(rows, places, (1, 0))
        ranks_seen |= {int(row["rank"]) for row in rows}
    assert ranks_seen == {0, 1}


class RefusingLogger(CSVLogger):
    """A logging service that refuses the callback's names (as some refuse a character)."""

    def log_metrics(self, metrics: Mapping[str, float], step: int | None = None) -> None:
        if any(name.startswith("training/") for name in metrics):
            raise ValueError("this service refuses these names")
        super().log_metrics(metrics, step)


@pytest.mark.parametrize("strict", [False, True], ids=["default", "strict"])
def test_a_logger_that_refuses_the_scalars_never_stops_the_fit(
    tmp_path: Path, strict: bool
) -> None:
    """One warning; the other loggers get every scalar and extra; ``strict`` raises."""
    batches = [batch(seed) for seed in range(4)]
    logger = TensorBoardLogger(tmp_path, name="tb", version=0)
    loggers = [RefusingLogger(tmp_path / "csv"), logger]
    callback = RolloutDebugCallback(strict=strict)
    if strict:
        with pytest.raises(ValueError, match="refuses these names"):
            fit(batches, callback, loggers)
        return
    with pytest.warns(RolloutDebugWarning, match="could not log the scalars") as got:
        fit(batches, callback, loggers)
    failed = [str(w.message) for w in got if "could not log the scalars" in str(w.message)]
    assert len(failed) == 1, failed
    assert "to RefusingLogger at step 1" in failed[0] and "refuses these names" in failed[0]
    ea = accumulator(logger.log_dir)
    assert [event.step for event in ea.Scalars("training/rollout_tokens")] == [1, 3]
    assert [event.step for event in ea.Histograms("training/rollout_log_ratio_hist")] == [1, 3]


@pytest.mark.parametrize("strict", [False, True], ids=["default", "strict"])
def test_extras_that_fail_to_be_written_never_stop_the_fit(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, strict: bool
) -> None:
    """Drawing fails at every logged step (as a Pillow without a usable font would): one
    warning, every scalar still logged and the histograms written; ``strict`` raises."""

    def failing(*args: Any, **kwargs: Any) -> None:
        raise ValueError("no picture today")

    monkeypatch.setattr("lightning_rollout_debug.loop.logs.write_profile", failing)
    batches = [batch(seed) for seed in range(4)]
    logger = TensorBoardLogger(tmp_path, name="tb", version=0)
    callback = RolloutDebugCallback(profile_images_every_n_steps=1, strict=strict)
    if strict:
        with pytest.raises(ValueError, match="no picture today"):
            fit(batches, callback, logger)
        return
    with pytest.warns(RolloutDebugWarning, match="could not write the TensorBoard extras") as got:
        fit(batches, callback, logger)
    failed = [w for w in got if "TensorBoard extras" in str(w.message)]
    assert len(failed) == 1 and "no picture today" in str(failed[0].message)
    ea = accumulator(logger.log_dir)
    assert [event.step for event in ea.Scalars("training/rollout_tokens")] == [1, 3]
    assert [event.step for event in ea.Histograms("training/rollout_log_ratio_hist")] == [1, 3]
    assert ea.Tags()["images"] == []
