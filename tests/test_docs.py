"""Keep the documentation in step with the code.

- every metric name of ``METRIC_NAMES`` is documented in ``docs/metrics.md``, whose
  definition tables list them in the catalog's order;
- the dashboard table of ``docs/tensorboard.md`` lists the charts of ``DASHBOARD``;
- every constructor parameter of ``RolloutDebugCallback`` is in the argument table of
  ``docs/usage.md``, with the default the code has;
- the code blocks of ``docs/usage.md`` and ``docs/segments.md`` marked
  ``<!-- test: run -->`` run, and the YAML block of ``docs/usage.md`` marked
  ``<!-- test: lightningcli -->`` configures the callback through LightningCLI;
- the table of the metrics a segment can log in ``docs/metrics.md`` lists
  ``SEGMENT_METRIC_CHOICES`` and ``DEFAULT_SEGMENT_METRICS``;
- every page in ``docs/`` is in the ``mkdocs.yml`` navigation;
- the quick test subset the README documents (``pytest -m "not slow"``) exists: the
  marker is registered and the slow tables of ``tests/conftest.py`` name real tests.
"""

from __future__ import annotations

import ast
import inspect
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml

from lightning_rollout_debug import GROUPS, METRIC_NAMES, RolloutDebugCallback

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
MARKED_BLOCK = re.compile(
    r"<!-- test: (?P<kind>[\w-]+) -->\s*\n```(?P<lang>\w+)\n(?P<code>.*?)\n```", re.DOTALL
)
TABLE_ROW = re.compile(r"^\| `(?P<name>\w+)` \| (?P<type>[^|]+) \| (?P<default>[^|]+) \|", re.M)


def read(page: str) -> str:
    return (DOCS / page).read_text(encoding="utf-8")


def marked_blocks(page: str, kind: str) -> list[str]:
    return [m["code"] for m in MARKED_BLOCK.finditer(read(page)) if m["kind"] == kind]


def constructor_parameters() -> list[inspect.Parameter]:
    parameters = inspect.signature(RolloutDebugCallback.__init__).parameters.values()
    return [
        p
        for p in parameters
        if p.name != "self" and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)
    ]


ALL_METRICS = [name for group in GROUPS for name in METRIC_NAMES[group]]


@pytest.mark.parametrize("name", ALL_METRICS)
def test_metric_is_documented(name: str) -> None:
    assert f"`{name}`" in read("metrics.md"), f"docs/metrics.md does not mention `{name}`"


def test_the_definition_tables_follow_the_catalog_order() -> None:
    """``docs/metrics.md`` says ``METRIC_NAMES`` holds the names "in the order of this page"."""
    order: list[str] = []
    inside = False
    for row in read("metrics.md").splitlines():
        if not row.startswith("|"):
            inside = False
        elif row.startswith("| name | definition"):
            inside = True
        elif inside:
            order += [n for n in re.findall(r"`(\w+)`", row.split("|")[1]) if n not in order]
    assert [n for n in order if n in ALL_METRICS] == ALL_METRICS


def charts_of_the_dashboard_table() -> dict[str, list[tuple[str, ...]]]:
    """The rows of the dashboard table: category -> charts, each chart's names spelled out.

    A name written ``_suffix`` replaces the last ``_part`` of the full name before it
    (``rollout_is_ratio_mean``, ``_min`` is ``rollout_is_ratio_min``).
    """
    text = read("tensorboard.md")
    table = text[text.index("| category | charts |") :]
    table = table[: table.index("\n\n")]
    rows: dict[str, list[tuple[str, ...]]] = {}
    for row in table.splitlines()[2:]:
        category, charts = (cell.strip() for cell in row.strip("|").split("|"))
        spelled = []
        for chart in charts.split(";"):
            names, stem = [], ""
            for written in re.findall(r"`(\w+)`", chart):
                if written.startswith("_"):
                    names.append(stem + written)
                else:
                    names.append(written)
                    stem = written.rsplit("_", 1)[0]
            spelled.append(tuple(names))
        rows[category.strip("`").removeprefix("{prefix}")] = spelled
    return rows


def test_the_dashboard_table_lists_every_chart() -> None:
    from lightning_rollout_debug.metrics.catalog import DASHBOARD

    expected = {category: [names for _, names in charts] for category, charts in DASHBOARD}
    assert charts_of_the_dashboard_table() == expected


@pytest.mark.parametrize("group", GROUPS)
def test_group_is_documented(group: str) -> None:
    assert f"`{group}`" in read("metrics.md")
    assert f"`{group}`" in read("usage.md")


@pytest.mark.parametrize("parameter", constructor_parameters(), ids=lambda p: p.name)
def test_constructor_parameter_is_documented(parameter: inspect.Parameter) -> None:
    rows = {m["name"]: m for m in TABLE_ROW.finditer(read("usage.md"))}
    assert parameter.name in rows, (
        f"docs/usage.md has no row `| `{parameter.name}` | type | default | meaning |` in its "
        "table of constructor arguments"
    )
    documented = rows[parameter.name]["default"].strip().strip("`")
    try:
        value = ast.literal_eval(documented)
    except (ValueError, SyntaxError):
        return  # a default that is not a literal is only checked for presence
    assert value == parameter.default, (
        f"docs/usage.md gives `{parameter.name}` the default {documented}; "
        f"the code has {parameter.default!r}"
    )


def test_usage_has_runnable_blocks() -> None:
    assert len(marked_blocks("usage.md", "run")) >= 3


@pytest.mark.parametrize("index", range(len(marked_blocks("usage.md", "run"))))
def test_usage_block_runs(index: int, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    code = marked_blocks("usage.md", "run")[index]
    monkeypatch.chdir(tmp_path)  # the blocks may write logs to the working directory
    with torch.random.fork_rng():  # the blocks seed the global generator
        exec(compile(code, f"docs/usage.md (runnable block {index})", "exec"), {"__name__": "docs"})


@pytest.mark.parametrize("index", range(len(marked_blocks("segments.md", "run"))))
def test_segments_block_runs(index: int, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    code = marked_blocks("segments.md", "run")[index]
    monkeypatch.chdir(tmp_path)
    with torch.random.fork_rng():
        exec(
            compile(code, f"docs/segments.md (runnable block {index})", "exec"),
            {"__name__": "docs"},
        )


def test_the_per_segment_table_lists_the_choices() -> None:
    """``docs/metrics.md``'s table of the metrics a segment can log, and of its defaults."""
    from lightning_rollout_debug.metrics.segments import (
        DEFAULT_SEGMENT_METRICS,
        SEGMENT_METRIC_CHOICES,
    )

    text = read("metrics.md")
    table = text[text.index("| group | metrics a segment can log |") :]
    choices: list[str] = []
    defaults: list[str] = []
    for row in table[: table.index("\n\n")].splitlines()[2:]:
        _, can, default = (cell.strip() for cell in row.strip("|").split("|"))
        can = can.split("(not ")[0]  # what a segment cannot log is named after "not"
        choices += re.findall(r"`(\w+)`", can)
        defaults += re.findall(r"`(\w+)`", default)
    assert sorted(choices) == sorted(SEGMENT_METRIC_CHOICES)
    assert sorted(defaults) == sorted(DEFAULT_SEGMENT_METRICS)


def test_lightningcli_yaml_configures_the_callback() -> None:
    pytest.importorskip("jsonargparse")
    from pytorch_lightning.cli import LightningCLI
    from pytorch_lightning.demos.boring_classes import BoringModel

    (block,) = marked_blocks("usage.md", "lightningcli")
    config = yaml.safe_load(block)
    cli = LightningCLI(
        BoringModel,
        args=config,
        run=False,
        save_config_callback=None,
        seed_everything_default=False,
    )
    (callback,) = [c for c in cli.trainer.callbacks if isinstance(c, RolloutDebugCallback)]
    init_args = config["trainer"]["callbacks"][0]["init_args"]
    assert callback.config.prefix == init_args["prefix"]
    assert callback.log_every_n_steps == init_args["log_every_n_steps"]
    assert list(callback.config.groups) == init_args["groups"]


def test_every_page_is_in_the_navigation() -> None:
    config = yaml.safe_load((ROOT / "mkdocs.yml").read_text(encoding="utf-8"))
    in_nav = {page for entry in config["nav"] for page in entry.values()}
    for page in ("index.md", "usage.md", "metrics.md", "troubleshooting.md"):
        assert page in in_nav
    missing = sorted(p.name for p in DOCS.glob("*.md") if p.name not in in_nav)
    assert not missing, f"pages missing from the mkdocs.yml nav: {missing}"


def test_default_alerts_are_documented() -> None:
    from lightning_rollout_debug.checks.alerts import DEFAULT_ALERT_RANGES

    text = read("metrics.md")
    table = text[text.index("## Reference points at a glance") :]
    table = table[: table.index("\n\n", table.index("| metric |"))]
    cells = {
        row.split("|")[1].strip().strip("`"): row.split("|")[5].strip()
        for row in table.splitlines()
        if row.startswith("| `")
    }
    for name, (low, high) in DEFAULT_ALERT_RANGES.items():
        assert name in cells, f"`{name}` has a default alert but no row in docs/metrics.md"
        expected = [f"below {low:g}"] if low is not None else []
        expected += [f"above {high:g}"] if high is not None else []
        for part in expected:
            assert part in cells[name], f"docs/metrics.md: `{name}` alerts {part}"
    for name, cell in cells.items():
        if name not in DEFAULT_ALERT_RANGES:
            assert cell == "-", f"docs/metrics.md lists a default alert for `{name}`"


def test_the_site_builds_strictly(tmp_path: Path) -> None:
    """``mkdocs build --strict``: every page in the nav, every link and anchor resolves."""
    result = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=False,
    )
    assert result.returncode == 0, result.stderr


def test_the_quick_subset_is_documented_and_its_marker_registered(
    pytestconfig: pytest.Config,
) -> None:
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    assert 'pytest -m "not slow"' in readme
    assert any(marker.startswith("slow:") for marker in pytestconfig.getini("markers"))


def test_the_slow_tables_name_existing_tests() -> None:
    from conftest import SLOW_FIXTURES, SLOW_MODULES, SLOW_TESTS

    tests = ROOT / "tests"
    for module in SLOW_MODULES:
        assert (tests / module).is_file(), f"tests/conftest.py: no module {module}"
    for test in SLOW_TESTS:
        module, function = test.split("::")
        assert f"def {function}(" in (tests / module).read_text(encoding="utf-8"), test
    sources = [path.read_text(encoding="utf-8") for path in tests.glob("*.py")]
    for fixture in SLOW_FIXTURES:
        assert any(f"def {fixture}(" in source for source in sources), fixture


def test_cost_figures_live_on_the_performance_page_only() -> None:
    """One set of cost figures, from the benchmarks: the other pages link to it."""
    timing = re.compile(r"\b\d+(?:\.\d+)?\s?(?:ms|µs|us|ns)(?:/| per |\b)")
    pages = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
    quoted = {
        page.name: timing.findall(page.read_text(encoding="utf-8"))
        for page in pages
        if page.name != "performance.md"
    }
    assert not {name: found for name, found in quoted.items() if found}


def test_the_readme_s_numbers_are_the_package_s() -> None:
    """The README's counts come from their source: the example's steps, the pictures'
    period, the drift baseline's length, the ranges of the example's alerts."""
    import importlib.util

    from lightning_rollout_debug import RolloutDebugConfig

    readme = " ".join((ROOT / "README.md").read_text(encoding="utf-8").split())
    spec = importlib.util.spec_from_file_location(
        "grpo_mismatch", ROOT / "examples" / "grpo_mismatch.py"
    )
    assert spec is not None and spec.loader is not None
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    steps = re.search(r"(\d+) steps: \d+ seconds on two CPU cores", readme)
    assert steps and int(steps[1]) == example.parse_args([]).max_steps
    config = RolloutDebugConfig()
    assert f"every {config.profile_images_every_n_steps} steps three pictures" in readme
    words = {10: "ten"}
    assert f"median of its first {words[config.drift_baseline]}:" in readme
    sys.path.insert(0, str(ROOT / "tests"))
    from test_example import FIRST_KL_DRIFT, FIRST_PROBS_DRIFT, LOG_SPACE_GROWTH_AT_MOST

    for first in (FIRST_PROBS_DRIFT, FIRST_KL_DRIFT):
        assert f"first between steps {first.start} and {first.stop - 1}" in readme
    assert f"within {LOG_SPACE_GROWTH_AT_MOST}x its start" in readme


def test_the_performance_page_is_a_page_a_user_reads() -> None:
    """At most 250 lines: what holds now, with its command."""
    assert len(read("performance.md").splitlines()) <= 250


def test_no_page_holds_dated_entries() -> None:
    """The docs say what holds now; history is in the commit log."""
    months = "January|February|March|April|May|June|July|August|September|October|November"
    dated = re.compile(rf"\b20\d\d-\d\d-\d\d\b|\b(?:{months}|December) 20\d\d\b")
    pages = [ROOT / "README.md", *sorted(DOCS.glob("*.md"))]
    found = {page.name: dated.findall(page.read_text(encoding="utf-8")) for page in pages}
    assert not {name: hits for name, hits in found.items() if hits}


def _counted(pattern: str) -> list[int]:
    """Every number the docs and the README put before ``pattern``, as ints."""
    texts = [read(page.name) for page in sorted(DOCS.glob("*.md"))]
    texts.append((ROOT / "README.md").read_text(encoding="utf-8"))
    number = r"(?<![\w,.])(\d{1,3}(?:,\d{3})+|\d+) "  # 42, 5,930: not 4096, nor float64
    found = re.findall(number + pattern, "\n".join(texts))
    return [int(number.replace(",", "")) for number in found]


def test_the_counts_in_the_prose_are_the_packages() -> None:
    """ "42 scalars", the extras' "6,343 float64 slots", the profile's "5,930 slots": each
    count the prose gives is the one the package has."""
    from lightning_rollout_debug.metrics.profile import PROFILE_SIZE

    monitor = RolloutDebugCallback().monitor
    scalars = sum(len(METRIC_NAMES[group]) for group in monitor.config.groups)
    assert _counted("scalars") and set(_counted("scalars")) == {scalars}
    assert monitor._extras is not None
    assert _counted("float64 slots") == [monitor._extras.size]
    assert _counted("slots") == [PROFILE_SIZE]
