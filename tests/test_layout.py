"""The state layout and the catalog: declarations from which the rest is derived."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from lightning_rollout_debug.metrics.catalog import (
    CATALOG,
    CATEGORIES,
    DASHBOARD,
    DEFAULT_ALERT_RANGES,
    GROUPS,
    METRIC_NAMES,
)
from lightning_rollout_debug.metrics.layout import STATE, Block, Layout


def moments_layout() -> Layout:
    return Layout(
        [
            Block("count", ("count",)),
            Block("mean", ("x", "y")),
            Block("comoment", ("x*x", "y*y", "x*y")),
            Block("sum", ("hits",), whole=True),
            Block("max", ("largest",)),
            Block("min", ("smallest",)),
            Block("top", ("key", "where"), k=3, empty=(-math.inf, -1.0)),
        ]
    )


def state_of(layout: Layout, x: np.ndarray, y: np.ndarray, where: np.ndarray) -> torch.Tensor:
    """A part's state straight from the definitions (float64 NumPy)."""
    values = {
        "count": len(x),
        "x": x.mean() if len(x) else 0.0,
        "y": y.mean() if len(y) else 0.0,
        "x*x": ((x - x.mean()) ** 2).sum() if len(x) else 0.0,
        "y*y": ((y - y.mean()) ** 2).sum() if len(y) else 0.0,
        "x*y": ((x - x.mean()) * (y - y.mean())).sum() if len(x) else 0.0,
        "hits": float((x > 0).sum()),
        "largest": x.max() if len(x) else -math.inf,
        "smallest": y.min() if len(y) else math.inf,
    }
    state = layout.pack({k: torch.tensor(float(v), dtype=torch.float64) for k, v in values.items()})
    order = np.argsort(-np.abs(x), kind="stable")[:3]
    top = [(abs(x[i]), where[i]) for i in order] + [(-math.inf, -1.0)] * (3 - len(order))
    state[layout.at["key"] :] = torch.tensor(top, dtype=torch.float64).flatten()
    return state


def test_the_merge_of_parts_is_the_state_of_their_union() -> None:
    layout = moments_layout()
    rng = np.random.default_rng(0)
    sizes = [5, 0, 1, 12, 3]
    xs = [rng.normal(3.0, 2.0, n) for n in sizes]
    ys = [rng.normal(-1.0, 0.5, n) for n in sizes]
    places = [rng.permutation(100)[:n].astype(float) + 1000 * i for i, n in enumerate(sizes)]
    parts = [state_of(layout, x, y, w) for x, y, w in zip(xs, ys, places, strict=True)]
    merged = layout.merge(torch.stack([*parts, layout.identity()]))
    whole = state_of(layout, np.concatenate(xs), np.concatenate(ys), np.concatenate(places))
    torch.testing.assert_close(merged, whole, rtol=1e-12, atol=1e-12)
    assert layout.problems(merged) == []


def test_the_identity_changes_nothing_and_merges_with_itself() -> None:
    for layout in (moments_layout(), STATE):
        empty = layout.identity()
        assert torch.equal(layout.merge(torch.stack([empty, empty])), empty)
        assert layout.problems(empty) == []


def test_a_top_block_breaks_ties_by_its_tie_fields_in_order() -> None:
    fields = ("key", "batch", "rank", "row", "position")
    empty = (-math.inf, 0.0, 0.0, 0.0, 0.0)
    layout = Layout([Block("top", fields, k=4, empty=empty, ties=fields[1:])])
    # Two states (say two ranks) of four candidates each, most of them tied at key 3.
    first = [(3, 1, 0, 0, 0), (3, 0, 0, 2, 9), (5, 7, 0, 0, 0), (-math.inf, 0, 0, 0, 0)]
    second = [(3, 0, 1, 0, 0), (3, 0, 0, 2, 8), (3, 0, 0, 1, 9), (1, 0, 0, 0, 0)]
    states = torch.tensor([sum(first, ()), sum(second, ())], dtype=torch.float64)
    merged = layout.merge(states).reshape(4, len(fields)).tolist()
    assert merged == [[5, 7, 0, 0, 0], [3, 0, 0, 1, 9], [3, 0, 0, 2, 8], [3, 0, 0, 2, 9]]


def test_checks_name_the_slot_and_the_problem() -> None:
    layout = moments_layout()
    state = layout.identity()
    state[layout.at["hits"]] = 1.5
    state[layout.at["largest"]] = math.nan
    assert layout.problems(state, "the window") == [
        "the count `hits` of the window is 1.5; expected a whole number >= 0",
        "the maximum `largest` of the window is NaN",
    ]
    state = layout.identity()
    state[layout.at["x"]] = 2.0  # a mean without tokens
    assert layout.problems(state) == [
        "the state holds no tokens but its other statistics are not empty"
    ]
    state = layout.identity()
    state[layout.at["count"]], state[layout.at["x*x"]] = 2.0, -1.0
    assert layout.problems(state) == ["the squared spread `x*x` of the state is negative"]
    assert layout.problems(torch.zeros(3)) == [
        "the state has dtype torch.float32; expected float64"
    ]


def test_sums_means_and_comoments_hold_no_infinity_or_nan() -> None:
    """A sum, a mean or a co-moment of real tokens is finite; only an extreme may be
    infinite (that of an empty window, or of overflowed probabilities)."""
    layout = Layout([*moments_layout().blocks[:3], Block("sum", ("total",)), Block("max", ("m",))])
    state = layout.identity()
    state[layout.at["count"]], state[layout.at["m"]] = 2.0, 0.5
    assert layout.problems(state) == []
    for name, value, kind in [
        ("x", math.nan, "mean"),
        ("y", -math.inf, "mean"),
        ("x*y", math.nan, "co-moment"),
        ("x*x", math.inf, "co-moment"),
        ("total", math.inf, "sum"),
        ("total", math.nan, "sum"),
    ]:
        damaged = state.clone()
        damaged[layout.at[name]] = value
        assert layout.problems(damaged, "the window") == [
            f"the {kind} `{name}` of the window is {value!r}; expected a finite number"
        ]
    for value in (math.inf, -math.inf):
        extreme = state.clone()
        extreme[layout.at["m"]] = value
        assert layout.problems(extreme) == []
    empty = STATE.identity()  # every extreme of the statistics infinite
    assert not empty.isfinite().all() and STATE.problems(empty) == []


def test_bad_declarations_are_refused() -> None:
    with pytest.raises(ValueError, match="Unknown merge rule 'median'"):
        Layout([Block("median", ("x",))])
    with pytest.raises(ValueError, match="at most one count slot, and it comes first"):
        Layout([Block("sum", ("x",)), Block("count", ("n",))])


# ------------------------------------------------------------------------ catalog
def test_the_catalog_derives_names_groups_dashboard_and_alerts() -> None:
    names = [metric.name for metric in CATALOG]
    assert len(names) == len(set(names))
    assert [name for group in GROUPS for name in METRIC_NAMES[group]] == names
    charted = [name for _, charts in DASHBOARD for _, members in charts for name in members]
    assert sorted(charted) == sorted(names)  # every metric on exactly one chart
    assert [category for category, _ in DASHBOARD] == list(CATEGORIES)
    assert set(DEFAULT_ALERT_RANGES) <= set(names)
    for metric in CATALOG:
        assert metric.chart[0] in CATEGORIES
        if metric.alert is not None:
            low, high = metric.alert
            assert low is not None or high is not None
