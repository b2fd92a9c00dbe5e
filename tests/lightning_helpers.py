"""Shared helpers for the Trainer-based tests: a tiny model, a list-of-batches dataset, log readers.

Every batch is a dict of ``[batch, response_length]`` tensors under ``rollout_log_probs``,
``old_log_probs`` and ``response_mask``, plus ``x`` (``[batch, FEATURES]`` model input) and
``index`` (``[batch]``, the batch's position in the list, so a test can tell which batches
the model actually saw). The DataLoader yields the batches of the list one after another,
unchanged, so each batch can have its own size, width, dtype and mask.
"""

from __future__ import annotations

import csv
import importlib
import importlib.util
import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
from pytorch_lightning.utilities import rank_zero_only
from reference import ALL_NAMES
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from torch import Tensor, nn
from torch.utils.data import DataLoader, Dataset

FEATURES = 4
"""Width of the model input ``x`` of every batch."""

TRAINER_DEFAULTS: dict[str, Any] = {
    "accelerator": "cpu",
    "devices": 1,
    "enable_progress_bar": False,
    "enable_model_summary": False,
    "enable_checkpointing": False,
    "num_sanity_val_steps": 0,
}
"""Keyword arguments that keep a test Trainer small and quiet."""


# ---------------------------------------------------------------------- batches
def make_batch(
    batch_size: int = 3,
    width: int = 5,
    *,
    seed: int = 0,
    index: int = 0,
    mask: Tensor | str = "random",
    dtype: torch.dtype = torch.float32,
    noise: float = 0.05,
    independent: bool = False,
    token_ids: bool = False,
) -> dict[str, Tensor]:
    """One batch of rollout/trainer log-probs.

    ``rollout_log_probs`` are log-probabilities in roughly ``[-6, -0.01]``;
    ``old_log_probs`` are them plus Gaussian noise of scale ``noise`` (or drawn
    independently when ``independent``, which gives a correlation near 0). ``mask`` is a
    tensor, ``"random"`` (every row keeps at least its first token), ``"ones"`` or
    ``"zeros"``. ``token_ids`` adds ``rollout_token_ids`` and ``trainer_token_ids``
    (``[batch, response_length]`` int64, about one position in five differing).
    """
    generator = torch.Generator().manual_seed(seed)
    shape = (batch_size, width)

    def log_probs() -> Tensor:
        return torch.log(
            torch.rand(shape, generator=generator, dtype=torch.float64) * 0.99 + 0.0025
        )

    rollout = log_probs()
    if independent:
        old = log_probs()
    else:
        old = (
            rollout + noise * torch.randn(shape, generator=generator, dtype=torch.float64)
        ).clamp(max=0.0)
    if isinstance(mask, Tensor):
        response_mask = mask.clone()
    elif mask == "random":
        response_mask = (torch.rand(shape, generator=generator) < 0.7).to(torch.int64)
        if width:
            response_mask[:, 0] = 1
    elif mask == "ones":
        response_mask = torch.ones(shape, dtype=torch.int64)
    elif mask == "zeros":
        response_mask = torch.zeros(shape, dtype=torch.int64)
    else:
        raise ValueError(f"unknown mask {mask!r}")
    batch = {
        "rollout_log_probs": rollout.to(dtype),
        "old_log_probs": old.to(dtype),
        "response_mask": response_mask,
        "x": torch.randn((batch_size, FEATURES), generator=generator),
        "index": torch.full((batch_size,), index, dtype=torch.int64),
    }
    if token_ids:
        ids = torch.randint(0, 1000, shape, generator=generator)
        changed = torch.rand(shape, generator=generator) < 0.2
        batch["rollout_token_ids"] = ids
        batch["trainer_token_ids"] = torch.where(changed, (ids + 1) % 1000, ids)
    return batch


def make_batches(
    n: int,
    *,
    batch_size: int | Sequence[int] = 3,
    width: int | Sequence[int] = 5,
    seed: int = 0,
    **kwargs: Any,
) -> list[dict[str, Tensor]]:
    """``n`` batches; ``batch_size`` and ``width`` may be one value or one per batch."""
    sizes = [batch_size] * n if isinstance(batch_size, int) else list(batch_size)
    widths = [width] * n if isinstance(width, int) else list(width)
    return [
        make_batch(sizes[i], widths[i], seed=seed * 1000 + i, index=i, **kwargs) for i in range(n)
    ]


def clone_batches(batches: Iterable[Mapping[str, Tensor]]) -> list[dict[str, Tensor]]:
    """Deep copies of the batches, to check afterwards that nothing modified them."""
    return [{key: value.clone() for key, value in batch.items()} for batch in batches]


def assert_batches_equal(
    got: Sequence[Mapping[str, Tensor]], want: Sequence[Mapping[str, Tensor]]
) -> None:
    """Same keys, dtypes, shapes and values (NaN equal to NaN)."""
    assert len(got) == len(want)
    for i, (left, right) in enumerate(zip(got, want, strict=True)):
        assert sorted(left) == sorted(right), (i, sorted(left), sorted(right))
        for key in right:
            assert left[key].dtype == right[key].dtype, (i, key)
            assert left[key].shape == right[key].shape, (i, key)
            assert torch.equal(left[key].isnan(), right[key].isnan()), (i, key)
            assert torch.equal(left[key].nan_to_num(), right[key].nan_to_num()), (i, key)


class ListDataset(Dataset):
    """Yields the given (already batched) items in order."""

    def __init__(self, items: Sequence[Any]) -> None:
        self.items = list(items)

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, index: int) -> Any:
        return self.items[index]


def make_loader(
    batches: Sequence[Any], collate_fn: Callable[[Any], Any] | None = None
) -> DataLoader:
    """A DataLoader yielding ``batches`` one by one (``batch_size=None``: no re-collation)."""
    return DataLoader(ListDataset(batches), batch_size=None, shuffle=False, collate_fn=collate_fn)


class DataProtoLike:
    """An object whose ``.batch`` is the mapping of tensors, like verl's ``DataProto``."""

    def __init__(self, batch: Mapping[str, Any], meta_info: Mapping[str, Any] | None = None):
        self.batch = batch
        self.meta_info = dict(meta_info or {})


def tensors_of(batch: Any) -> Mapping[str, Any]:
    """The mapping of tensors of a batch: the batch itself, or its ``.batch``."""
    inner = getattr(batch, "batch", None)
    return batch if inner is None else inner


# ---------------------------------------------------------------------- model
# The bodies of the test classes; each package gets its own (see `_lightning` below).
class _RolloutModule:
    """A one-layer model trained on ``x``; the rollout tensors only travel alongside.

    Args:
        batches: the training batches (``train_dataloader`` yields them in order).
        collate_fn: applied to each batch by the DataLoader (e.g. wrap it in a TensorDict).
        outputs: ``{output_key: batch_key}``: ``training_step`` returns ``batch[batch_key]``
            under ``output_key`` besides the loss.
        manual_steps: ``> 0`` switches to manual optimization with that many optimizer
            steps per batch (PPO-style epochs over one rollout batch).
        log_loss: call ``self.log("loss", loss)`` in ``training_step``.
    """

    def __init__(
        self,
        batches: Sequence[Any] = (),
        *,
        collate_fn: Callable[[Any], Any] | None = None,
        outputs: Mapping[str, str] | None = None,
        manual_steps: int = 0,
        log_loss: bool = True,
    ) -> None:
        super().__init__()
        self.layer = nn.Linear(FEATURES, 1)
        self.batches = list(batches)
        self.collate_fn = collate_fn
        self.outputs = dict(outputs or {})
        self.manual_steps = manual_steps
        self.log_loss = log_loss
        self.automatic_optimization = manual_steps == 0
        self.seen: list[int] = []
        self.keys_at_batch_end: list[list[str]] = []

    def train_dataloader(self) -> DataLoader:
        return make_loader(self.batches, self.collate_fn)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.01)

    def _loss(self, data: Mapping[str, Any]) -> Tensor:
        return self.layer(data["x"].float()).pow(2).mean()

    def training_step(self, batch: Any, batch_idx: int) -> dict[str, Any]:
        data = tensors_of(batch)
        if "index" in data:
            self.seen.append(int(data["index"].reshape(-1)[0]))
        if self.automatic_optimization:
            loss = self._loss(data)
        else:
            optimizer = self.optimizers()
            for _ in range(self.manual_steps):
                loss = self._loss(data)
                optimizer.zero_grad()
                self.manual_backward(loss)
                optimizer.step()
        if self.log_loss:
            self.log("loss", loss)
        return {"loss": loss, **{out: data[key] for out, key in self.outputs.items()}}

    def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
        # Runs after the callbacks' hooks: the keys the batch holds once they are done.
        self.keys_at_batch_end.append(sorted(tensors_of(batch).keys()))


class _RolloutDataModule:
    """Random rollout batches from plain arguments (for LightningCLI configs)."""

    def __init__(
        self,
        n_batches: int = 4,
        batch_size: int = 3,
        width: int = 5,
        seed: int = 0,
        token_ids: bool = False,
    ) -> None:
        super().__init__()
        self.batches = make_batches(
            n_batches, batch_size=batch_size, width=width, seed=seed, token_ids=token_ids
        )

    def train_dataloader(self) -> DataLoader:
        return make_loader(self.batches)


class _TinyModel:
    """:class:`RolloutModule` without constructor arguments, for LightningCLI."""

    def __init__(self, learning_rate: float = 0.01) -> None:
        super().__init__()
        self.learning_rate = learning_rate

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=self.learning_rate)


# ---------------------------------------------------------------------- windows
def step_of_batches(n_batches: int, accumulate_grad_batches: int = 1) -> list[int]:
    """The ``self.log`` step of each batch in automatic optimization (one epoch)."""
    return [i // accumulate_grad_batches for i in range(n_batches)]


def split_windows(
    items: Sequence[Any], steps: Sequence[int], logged_steps: Iterable[int]
) -> dict[int, list[Any]]:
    """Group ``items`` (with the step of each) into the windows ending at ``logged_steps``.

    A window is every item since the previous logged step: the items whose step ``s``
    satisfies ``previous < s <= logged``.
    """
    windows: dict[int, list[Any]] = {}
    previous = -math.inf
    for logged in sorted(logged_steps):
        windows[logged] = [
            item for item, step in zip(items, steps, strict=True) if previous < step <= logged
        ]
        previous = logged
    return windows


# ---------------------------------------------------------------------- reading logs
def read_scalars(log_dir: str | Path) -> dict[str, dict[int, float]]:
    """Every scalar series under a TensorBoard log dir, as ``{tag: {step: value}}``."""
    accumulator = EventAccumulator(str(log_dir), size_guidance={"scalars": 0})
    accumulator.Reload()
    return {
        tag: {event.step: event.value for event in accumulator.Scalars(tag)}
        for tag in accumulator.Tags()["scalars"]
    }


def read_csv_metrics(metrics_csv: str | Path) -> dict[str, dict[int, float]]:
    """A CSVLogger ``metrics.csv`` as ``{name: {step: value}}`` (empty cells left out)."""
    series: dict[str, dict[int, float]] = {}
    with open(metrics_csv, newline="") as handle:
        for row in csv.DictReader(handle):
            step = int(row["step"])
            for name, value in row.items():
                if name != "step" and value not in ("", None):
                    series.setdefault(name, {})[step] = float(value)
    return series


def at_step(
    series: Mapping[str, Mapping[int, float]], step: int, prefix: str = ""
) -> dict[str, float]:
    """The values logged at ``step`` of the series named ``prefix...``, without the prefix."""
    return {
        name[len(prefix) :]: values[step]
        for name, values in series.items()
        if name.startswith(prefix) and step in values
    }


class _MemoryLogger:
    """Keeps every ``log_metrics`` call as ``{step: {name: value}}``, in full precision."""

    def __init__(self, prefix: str = "training/") -> None:
        super().__init__()
        self.prefix = prefix
        self.steps: dict[int, dict[str, float]] = {}

    @property
    def name(self) -> str:
        return "memory"

    @property
    def version(self) -> int:
        return 0

    @rank_zero_only
    def log_metrics(self, metrics: Mapping[str, float], step: int | None = None) -> None:
        self.steps.setdefault(int(step or 0), {}).update(metrics)

    @rank_zero_only
    def log_hyperparams(self, params: Any, *args: Any, **kwargs: Any) -> None:
        pass

    def catalog(self) -> dict[int, dict[str, float]]:
        """Each logging step's catalog metrics (``reference.ALL_NAMES``), unprefixed."""
        out = {}
        for step, metrics in self.steps.items():
            found = {
                name[len(self.prefix) :]: float(value)
                for name, value in metrics.items()
                if name.startswith(self.prefix) and name[len(self.prefix) :] in ALL_NAMES
            }
            if found:
                out[step] = found
        return out


class _ReleaseProcessGroups:
    """Destroys every process group at the end of a spawned fit, so their threads stop.

    gloo runs each collective on a worker thread of its group, and that thread drops the
    collective's tensors only after the caller has gone on. If the caller's Python tensor
    is gone by then, the thread takes the GIL to free it; if the process has started to
    exit meanwhile, Python ends the thread with a forced unwind that ``std::terminate``
    stops ("terminate called without an active exception", SIGABRT). Lightning destroys
    no gloo group. Destroying a group and dropping its last reference (the callbacks drop
    theirs in their own ``teardown``, which runs first) joins its threads while the
    interpreter still runs.
    """

    def teardown(self, trainer: Any, pl_module: Any, stage: str) -> None:
        if torch.distributed.is_available() and torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()


# ---------------------------------------------------------------------- both packages
@dataclass(frozen=True)
class Lightning:
    """One Lightning package (``pytorch_lightning`` or ``lightning``): its classes and ours.

    The test classes of this file (:class:`RolloutModule`, :class:`TinyModel`,
    :class:`RolloutDataModule`, :class:`MemoryLogger`, :class:`ReleaseProcessGroups`) are
    built on each package's base classes: a Trainer takes only its own package's modules.
    """

    name: str
    pytorch: Any
    """``pytorch_lightning`` or ``lightning.pytorch``."""
    fabric: Any
    """``lightning_fabric`` or ``lightning.fabric``."""
    LightningCLI: Any
    RolloutModule: Any
    TinyModel: Any
    RolloutDataModule: Any
    MemoryLogger: Any
    ReleaseProcessGroups: Any

    @property
    def Trainer(self) -> Any:
        return self.pytorch.Trainer

    @property
    def loggers(self) -> Any:
        """The package's ``loggers`` module (``TensorBoardLogger``, ``CSVLogger``)."""
        return self.pytorch.loggers

    @property
    def callbacks(self) -> Any:
        """The package's ``callbacks`` module (``ModelCheckpoint``, ``EarlyStopping``)."""
        return self.pytorch.callbacks

    def __repr__(self) -> str:
        return self.name


def _lightning(name: str, attribute: str) -> Lightning:
    """The package ``name`` with this file's classes on its bases, kept as ``attribute``.

    Each class's qualified name goes through ``attribute`` (``PYTORCH_LIGHTNING.RolloutModule``),
    so pickle finds it again in a spawned process.
    """
    pytorch = importlib.import_module(
        "pytorch_lightning" if name == "pytorch_lightning" else f"{name}.pytorch"
    )
    fabric = importlib.import_module(
        "lightning_fabric" if name == "pytorch_lightning" else f"{name}.fabric"
    )
    cli = importlib.import_module(f"{pytorch.__name__}.cli")

    def build(body: type, *bases: type) -> type:
        built = type(body.__name__[1:], (body, *bases), {"__doc__": body.__doc__})
        built.__module__ = __name__
        built.__qualname__ = f"{attribute}.{built.__name__}"
        return built

    rollout_module = build(_RolloutModule, pytorch.LightningModule)
    return Lightning(
        name=name,
        pytorch=pytorch,
        fabric=fabric,
        LightningCLI=cli.LightningCLI,
        RolloutModule=rollout_module,
        TinyModel=build(_TinyModel, rollout_module),
        RolloutDataModule=build(_RolloutDataModule, pytorch.LightningDataModule),
        MemoryLogger=build(_MemoryLogger, pytorch.loggers.Logger),
        ReleaseProcessGroups=build(_ReleaseProcessGroups, pytorch.Callback),
    )


PYTORCH_LIGHTNING = _lightning("pytorch_lightning", "PYTORCH_LIGHTNING")
"""``pytorch_lightning``, the package's declared dependency."""

LIGHTNING: Lightning | None = (
    _lightning("lightning", "LIGHTNING") if importlib.util.find_spec("lightning") else None
)
"""The unified ``lightning`` package (``import lightning as L``), where installed."""

NEEDS_LIGHTNING = pytest.mark.skipif(LIGHTNING is None, reason="needs the lightning package")

PACKAGES = [
    pytest.param(PYTORCH_LIGHTNING, id="pytorch_lightning"),
    pytest.param(LIGHTNING, id="lightning", marks=NEEDS_LIGHTNING),
]
"""Both packages, for ``@pytest.mark.parametrize("lit", PACKAGES)``."""

RolloutModule = PYTORCH_LIGHTNING.RolloutModule
TinyModel = PYTORCH_LIGHTNING.TinyModel
RolloutDataModule = PYTORCH_LIGHTNING.RolloutDataModule
MemoryLogger = PYTORCH_LIGHTNING.MemoryLogger
ReleaseProcessGroups = PYTORCH_LIGHTNING.ReleaseProcessGroups
