"""One road for a batch: an update enters each module of the package once.

An entry is a call into a module of the package whose nearest caller in the package is
in another module (a call from outside the package, or back from torch, counts by its
nearest caller in the package). One update of a :class:`RolloutDebugMonitor` on the CPU,
its kernel loaded and its plans made by the updates before, must enter no module twice:
the batch is read and checked once (``metrics.batch``, ``metrics.inputs``), added to the
window, its token ids compared and its pad tokens counted, by one call
(``metrics.backends.add_batch``) that chooses the road once, and the windows are added
to by one call (``metrics.packed_window``); the kernel's pass asks the loaded build for
what it needs once (``metrics.native.kernel``). The update that folds the windows'
waiting batches (one in :data:`PENDING`) enters no module twice either: both windows
fold together, the rows of their pass sums read once (``metrics.finish``), the extras
finished from those rows (``metrics.finish_extras``), and every packed state merged by
one call (``metrics.layout``).
"""

from __future__ import annotations

import sys
import warnings
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from types import FrameType
from typing import Any

import pytest
import torch
from conftest import kernel_skip_reason

import lightning_rollout_debug
from lightning_rollout_debug import GROUPS, RolloutDebugMonitor, RolloutDebugWarning
from lightning_rollout_debug.metrics.packed_window import PENDING

PACKAGE = Path(lightning_rollout_debug.__file__).resolve().parent

SCALARS_ONLY = {
    "histograms": False,
    "worst_tokens_k": 0,
    "profile_images": False,
    "groups": [group for group in GROUPS if group not in ("quantiles", "token_ids")],
}
"""A monitor without extras: every group of the statistics, no histograms, worst tokens,
pictures or quantiles."""

CHECKED_IDS = {
    "token_ids_keys": ("rollout_token_ids", "trainer_token_ids"),
    "pad_token_id": 0,
}
"""A monitor that compares the token ids and counts the pad tokens."""

KERNEL_SKIP = kernel_skip_reason()
NEEDS_KERNEL = pytest.mark.skipif(KERNEL_SKIP is not None, reason=str(KERNEL_SKIP))


STOPS = ("metrics.native", "metrics.torch_pass")
"""The folders of ``metrics`` that are one stop of the road each: the kernel, the torch pass
(modules split by what they hold, one unit of work that an update enters once)."""


def module_of(frame: FrameType | None) -> str | None:
    """The dotted module of the package a frame runs in (``None``: outside the package);
    a module of a folder of :data:`STOPS`, that folder."""
    if frame is None:
        return None
    path = Path(frame.f_code.co_filename)
    if not path.is_relative_to(PACKAGE):
        return None
    dotted = ".".join(path.relative_to(PACKAGE).with_suffix("").parts)
    return next((stop for stop in STOPS if dotted.startswith(f"{stop}.")), dotted)


def entries(call: Callable[[], Any]) -> list[tuple[str, str]]:
    """The entries ``call`` makes into the package's modules, in order: module, function."""
    found: list[tuple[str, str]] = []

    def profile(frame: FrameType, event: str, arg: object) -> None:
        if event != "call":
            return
        module = module_of(frame)
        if module is None:
            return
        caller = frame.f_back
        while caller is not None and module_of(caller) is None:
            caller = caller.f_back
        if module_of(caller) != module:
            found.append((module, frame.f_code.co_name))

    previous = sys.getprofile()
    sys.setprofile(profile)
    try:
        call()
    finally:
        sys.setprofile(previous)
    return found


def batch() -> dict[str, torch.Tensor]:
    """A float32 CPU batch of 8 rows of up to 256 tokens, rows padded, with token ids."""
    generator = torch.Generator().manual_seed(0)
    rollout = torch.rand(8, 256, generator=generator).clamp_min(1e-6).log()
    old = (rollout + 0.01 * torch.randn(8, 256, generator=generator)).clamp(max=0.0)
    lengths = torch.randint(64, 257, (8, 1), generator=generator)
    mask = (torch.arange(256) < lengths).to(torch.int64)
    ids = torch.randint(0, 50, (8, 256), generator=generator)
    return {
        "rollout_log_probs": rollout,
        "old_log_probs": old,
        "response_mask": mask,
        "rollout_token_ids": ids,
        "trainer_token_ids": ids.clone(),
    }


def road_of(settings: dict[str, Any]) -> list[tuple[str, str]]:
    """The entries of a monitor's third update (the first two load and plan)."""
    monitor = RolloutDebugMonitor(alert_ranges={}, **settings)
    given = batch()
    with warnings.catch_warnings():  # a skipped batch, or a kernel not used, fails
        warnings.simplefilter("error", RolloutDebugWarning)
        warnings.simplefilter("error", RuntimeWarning)
        monitor.update(given)
        monitor.update(given)
        return entries(lambda: monitor.update(given))


def folding_road(settings: dict[str, Any]) -> tuple[int, list[tuple[str, str]]]:
    """The first update of a monitor that folds its windows: its number and entries.

    Every update adds to the statistics' waiting batches, so the update that leaves none
    waiting is the one that folded them; each update is probed until then.
    """
    monitor = RolloutDebugMonitor(alert_ranges={}, **settings)
    given = batch()
    with warnings.catch_warnings():  # a skipped batch, or a kernel not used, fails
        warnings.simplefilter("error", RolloutDebugWarning)
        warnings.simplefilter("error", RuntimeWarning)
        for update in range(1, 2 * PENDING + 1):
            found = entries(lambda: monitor.update(given))
            if not monitor._stats._pending:
                assert monitor._stats._state is not None
                extras = monitor._extras
                if extras is not None:  # folded with the statistics: nothing waits
                    assert not extras._pending, f"the extras did not fold: {found}"
                    block = extras._in_place
                    assert block is None or len(block.heads) <= 1, "an in-place block's heads wait"
                return update, found
    raise AssertionError(f"none of {2 * PENDING} updates folded the window")


def assert_entered_once(road: list[tuple[str, str]]) -> None:
    """Fail where a module is entered twice."""
    counts = Counter(module for module, _ in road)
    twice = {module: [f for m, f in road if m == module] for module in counts if counts[module] > 1}
    shown = " -> ".join(f"{module}.{function}" for module, function in road)
    assert not twice, f"entered more than once: {twice}; the road: {shown}"


@pytest.mark.parametrize(
    ("settings", "road"),
    [
        pytest.param({}, "native", marks=NEEDS_KERNEL, id="native"),
        pytest.param(SCALARS_ONLY, "native", marks=NEEDS_KERNEL, id="native-scalars-only"),
        pytest.param(CHECKED_IDS, "native", marks=NEEDS_KERNEL, id="native-ids-and-pads"),
        pytest.param({"compile": False}, "eager", id="eager"),
        pytest.param({**SCALARS_ONLY, "compile": False}, "eager", id="eager-scalars-only"),
        pytest.param({**CHECKED_IDS, "compile": False}, "eager", id="eager-ids-and-pads"),
    ],
)
def test_an_update_enters_each_module_once(settings: dict[str, Any], road: str) -> None:
    found = road_of(settings)
    modules = [module for module, _ in found]
    assert modules[:3] == ["loop.monitor", "loop.batch_updates", "metrics.batch"], found
    assert "metrics.inputs" in modules and "metrics.backends" in modules, found
    taken = "metrics.native" if road == "native" else "metrics.torch_pass"
    assert taken in modules, f"the {road} road was not taken: {found}"
    assert_entered_once(found)


@pytest.mark.parametrize(
    ("settings", "road"),
    [
        pytest.param({}, "native", marks=NEEDS_KERNEL, id="native"),
        pytest.param(SCALARS_ONLY, "native", marks=NEEDS_KERNEL, id="native-scalars-only"),
        pytest.param(CHECKED_IDS, "native", marks=NEEDS_KERNEL, id="native-ids-and-pads"),
        pytest.param({"compile": False}, "eager", id="eager"),
        pytest.param({**SCALARS_ONLY, "compile": False}, "eager", id="eager-scalars-only"),
        pytest.param({**CHECKED_IDS, "compile": False}, "eager", id="eager-ids-and-pads"),
    ],
)
def test_the_update_that_folds_enters_each_module_once(settings: dict[str, Any], road: str) -> None:
    """The update that folds finishes and merges both windows in one go."""
    update, found = folding_road(settings)
    modules = [module for module, _ in found]
    assert update <= PENDING, f"the window folded at update {update}, past {PENDING}"
    assert modules[:3] == ["loop.monitor", "loop.batch_updates", "metrics.batch"], found
    taken = "metrics.native" if road == "native" else "metrics.torch_pass"
    assert taken in modules, f"the {road} road was not taken: {found}"
    assert "metrics.layout" in modules, f"no merge: {found}"
    if road == "eager":  # the pass sums are finished, the extras' where there are extras
        assert "metrics.finish" in modules, found
        extras = settings.get("histograms", True)  # off in SCALARS_ONLY alone
        assert ("metrics.finish_extras" in modules) == extras, found
    assert_entered_once(found)


def test_a_module_entered_twice_is_found() -> None:
    """The probe sees a second entry: a module called again after another one."""
    from lightning_rollout_debug.metrics import layout, rows

    found = entries(lambda: (rows.rows_for(frozenset({"seed"})), layout.filled((1.0,))))
    found += entries(lambda: rows.rows_for(frozenset({"kl"})))
    assert [module for module, _ in found] == ["metrics.rows", "metrics.layout", "metrics.rows"]
    with pytest.raises(AssertionError, match="entered more than once"):
        assert_entered_once(found)
