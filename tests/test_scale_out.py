"""Exact totals beyond ``ddp_spawn``: FSDP2 on two CPU processes, and two simulated nodes.

Both layouts run ``tests/scale_out_script.py`` in processes of their own, with gloo:

- **FSDP2**: one process running a Trainer with ``ModelParallelStrategy`` on ``devices=2``
  whose ``configure_model`` applies ``fully_shard``. Lightning's subprocess launcher
  starts rank 1 by running the script again, which is why the Trainer cannot run inside
  pytest (the launcher would re-run pytest itself).
- **Two nodes**: two processes launched here, one per simulated node, with ``NODE_RANK``
  0 and 1, ``LOCAL_RANK=0``, ``WORLD_SIZE=2`` and a shared ``MASTER_ADDR``/``MASTER_PORT``;
  the Trainer has ``num_nodes=2, devices=1, strategy="ddp"``. Each node writes its logs
  and records to a folder of its own.

The test saves the batches of both ranks to a file the processes load, and computes the
reference from the same tensors. The ranks see batches of different sizes, widths and
dtypes; in one window rank 0 has no tokens. What rank 0 writes to TensorBoard (read
back with TensorBoard's own reader) must equal the float64 reference over the tokens of
*both* ranks in each window, and every rank's ``callback_metrics`` must be the same, bit
for bit.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import pytest
import torch
from lightning_helpers import make_batch, read_scalars
from reference import Reference, assert_metrics_close, reference_metrics
from scale_out_script import LOG_EVERY, PREFIX, WORLD, interleave, load_batches

from lightning_rollout_debug import METRIC_NAMES

pytestmark = pytest.mark.skipif(
    not torch.distributed.is_available() or not torch.distributed.is_gloo_available(),
    reason="needs torch.distributed with the gloo backend",
)

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = Path(__file__).resolve().with_name("scale_out_script.py")
TIMEOUT_S = 300
"""Wall-clock limit of one layout's processes (a hung collective waits 30 minutes)."""
GROUPS = ("seed", "log_space", "kl", "importance_ratio", "sequence", "health")
NAMES = tuple(name for group in GROUPS for name in METRIC_NAMES[group])
CLUSTER_VARIABLES = (
    "LOCAL_RANK",
    "NODE_RANK",
    "GROUP_RANK",
    "RANK",
    "WORLD_SIZE",
    "LOCAL_WORLD_SIZE",
    "MASTER_ADDR",
    "MASTER_PORT",
    "PL_GLOBAL_SEED",
    "PL_TRAINER_GPUS",
)
CLUSTER_PREFIXES = ("SLURM_", "TORCHELASTIC_", "LSB_", "JSM_", "OMPI_", "PMI_")
"""What would make Lightning pick another cluster environment or rank than the test says."""

Batch = dict[str, torch.Tensor]


# ---------------------------------------------------------------------- data
# Windows of LOG_EVERY batches per rank, then a last one-batch window that on_train_end
# logs. (rows, width, mask, dtype) per batch; the widths differ between the ranks.
SCHEDULE: tuple[tuple[tuple[tuple[int, int, str, torch.dtype], ...], ...], ...] = (
    # both ranks hold tokens
    (
        ((3, 7, "random", torch.float32), (2, 5, "random", torch.float32)),
        ((4, 11, "random", torch.float32), (1, 3, "ones", torch.float64)),
    ),
    # rank 1 is empty for one of its batches
    (
        ((2, 9, "random", torch.float32), (5, 4, "ones", torch.bfloat16)),
        ((3, 6, "zeros", torch.float32), (2, 13, "random", torch.float32)),
    ),
    # rank 0 is empty for the whole window
    (
        ((2, 4, "zeros", torch.float32), (1, 6, "zeros", torch.float32)),
        ((6, 10, "random", torch.float32), (2, 12, "random", torch.float16)),
    ),
    # the window that on_train_end logs
    (
        ((2, 2, "random", torch.float32),),
        ((3, 6, "random", torch.float32),),
    ),
)


def batch_index(rank: int, position: int) -> int:
    """The ``index`` of a rank's batch: unique over both ranks."""
    return 100 * rank + position


def rank_batches(rank: int) -> list[Batch]:
    """Every batch of ``rank``, in training order."""
    batches = []
    for window in SCHEDULE:
        for rows, width, mask, dtype in window[rank]:
            index = batch_index(rank, len(batches))
            batches.append(
                make_batch(rows, width, seed=7919 + index, index=index, mask=mask, dtype=dtype)
            )
    return batches


def windows(per_rank: Sequence[Sequence[Batch]]) -> list[list[Batch]]:
    """``[window]``: the batches of both ranks that each logged window covers."""
    out = []
    start = 0
    for window in SCHEDULE:
        size = len(window[0])
        out.append([batch for batches in per_rank for batch in batches[start : start + size]])
        start += size
    return out


def save_batches(path: Path) -> list[list[Batch]]:
    """``[rank][batch]``, saved to ``path`` for the processes (which train on exactly these)."""
    per_rank = [rank_batches(rank) for rank in range(WORLD)]
    torch.save(per_rank, path)
    return per_rank


# ---------------------------------------------------------------------- processes
def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def clean_env(**variables: str) -> dict[str, str]:
    """This process's environment without cluster variables, plus ``variables``."""
    env = {
        key: value
        for key, value in os.environ.items()
        if key not in CLUSTER_VARIABLES and not key.startswith(CLUSTER_PREFIXES)
    }
    paths = [str(ROOT), *filter(None, env.get("PYTHONPATH", "").split(os.pathsep))]
    env["PYTHONPATH"] = os.pathsep.join(paths)
    env["OMP_NUM_THREADS"] = "1"  # two ranks on a 2-core machine
    env.update(variables)
    return env


def _kill_group(process: subprocess.Popen) -> None:
    """End a process started here and every process it started (its own session)."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(process.pid, signal.SIGKILL)
    process.wait()


def run_processes(launches: Sequence[tuple[Path, dict[str, str], Sequence[str]]]) -> None:
    """Run ``(log_file, env, args)`` of the script at once; fail with their logs unless all exit 0.

    One process that fails ends the others at once (they would wait in the next collective
    for the backend's timeout); so does the :data:`TIMEOUT_S` limit.
    """
    processes = []
    try:
        for log_file, env, args in launches:
            with open(log_file, "wb") as log:
                processes.append(
                    subprocess.Popen(
                        [sys.executable, str(SCRIPT), *args],
                        cwd=ROOT,
                        env=env,
                        stdin=subprocess.DEVNULL,
                        stdout=log,
                        stderr=subprocess.STDOUT,
                        start_new_session=True,
                    )
                )
        deadline = time.monotonic() + TIMEOUT_S
        while time.monotonic() < deadline:
            codes = [process.poll() for process in processes]
            if all(code == 0 for code in codes) or any(code not in (None, 0) for code in codes):
                break
            time.sleep(0.1)
    finally:
        codes = [process.poll() for process in processes]
        passed = len(codes) == len(launches) and all(code == 0 for code in codes)
        if not passed:
            # Also the ranks a failed launcher started, which would wait in a collective.
            for process in processes:
                _kill_group(process)
    if passed:
        return
    report = []
    for (log_file, env, args), code in zip(launches, codes, strict=False):
        status = f"killed after {TIMEOUT_S} s or another's failure" if code is None else code
        ranks = {key: env[key] for key in ("NODE_RANK", "LOCAL_RANK") if key in env}
        tail = log_file.read_text(errors="replace")[-6000:] if log_file.exists() else ""
        report.append(f"--- {' '.join(args)} {ranks} exit {status}:\n{tail}")
    pytest.fail("scale-out processes failed:\n" + "\n".join(report), pytrace=False)


def read_records(folders: Sequence[Path]) -> list[dict[str, Any]]:
    """``[global_rank]``: the record each rank wrote, wherever it wrote it."""
    found = {}
    for folder in folders:
        for path in sorted((folder / "records").glob("rank*.json")):
            record = json.loads(path.read_text())
            assert record["global_rank"] not in found, f"two records of rank {path}"
            found[record["global_rank"]] = record
    assert sorted(found) == list(range(WORLD)), sorted(found)
    return [found[rank] for rank in range(WORLD)]


# ---------------------------------------------------------------------- the reference
def reference(batches: Sequence[Batch]) -> Reference:
    """The float64 reference over the concatenation of ``batches`` (``NAMES`` only)."""
    return reference_metrics(
        [b["rollout_log_probs"] for b in batches],
        [b["old_log_probs"] for b in batches],
        [b["response_mask"] for b in batches],
    ).select(NAMES)


def logged_at(scalars: Mapping[str, Mapping[int, float]], step: int) -> dict[str, float]:
    """Every metric name at ``step``, NaN where the callback left it out."""
    return {
        PREFIX + name: float(scalars.get(PREFIX + name, {}).get(step, math.nan)) for name in NAMES
    }


def complete(metrics: Mapping[str, float]) -> dict[str, float]:
    """``callback_metrics`` of our names, NaN where left out."""
    return {PREFIX + name: float(metrics.get(PREFIX + name, math.nan)) for name in NAMES}


def assert_exact_totals(run: Mapping[str, Any]) -> None:
    """Rank 0's TensorBoard and every rank's ``callback_metrics`` equal the merged reference."""
    scalars, records, per_rank = run["scalars"], run["records"], run["per_rank"]
    want = [reference(batches) for batches in windows(per_rank)]
    steps = sorted(scalars[PREFIX + "rollout_tokens"])
    assert len(steps) == len(want), steps
    assert steps[:-1] == [1, 3, 5], steps  # every second batch; the last window at the end
    for step, reference_values in zip(steps, want, strict=True):
        assert_metrics_close(logged_at(scalars, step), reference_values, prefix=PREFIX)

    # The windows are what the schedule promises, and merged, not rank 0's own.
    tokens = [scalars[PREFIX + "rollout_tokens"][step] for step in steps]
    assert all(count > 1 for count in tokens), tokens
    rank0_window2 = per_rank[0][2 * LOG_EVERY : 3 * LOG_EVERY]
    assert reference(rank0_window2)["rollout_tokens"] == 0  # rank 0 had nothing there
    rank0_window0 = reference(per_rank[0][:LOG_EVERY])["rollout_tokens"]
    assert tokens[0] > rank0_window0

    # callback_metrics: the same on both ranks, bit for bit, and the reference values.
    first, second = records
    assert first["logged"] == second["logged"]
    assert first["final"] == second["final"]
    batch_ends = [str(LOG_EVERY * (w + 1) - 1) for w in range(len(want) - 1)]
    assert sorted(first["logged"], key=int) == batch_ends
    finals = [first["logged"][key] for key in batch_ends] + [first["final"]]
    for metrics, reference_values in zip(finals, want, strict=True):
        assert_metrics_close(complete(metrics), reference_values, prefix=PREFIX)


def assert_ranks_saw_their_batches(run: Mapping[str, Any]) -> None:
    records, per_rank = run["records"], run["per_rank"]
    for rank, (record, batches) in enumerate(zip(records, per_rank, strict=True)):
        assert record["world_size"] == WORLD == record["distributed_world_size"]
        assert record["backend"] == "gloo"
        assert record["seen"] == [batch_index(rank, i) for i in range(len(batches))]
    # Different processes, and batches of different widths on the two ranks.
    assert records[0]["pid"] != records[1]["pid"]
    widths = [[b["response_mask"].shape[1] for b in batches] for batches in per_rank]
    assert all(left != right for left, right in zip(*widths, strict=True)), widths


def test_schedule_is_dealt_as_intended(tmp_path: Path) -> None:
    """The data alone: per-rank lists, windows over both ranks, the saved copy (no processes)."""
    per_rank = save_batches(tmp_path / "batches.pt")
    assert [len(b) for b in per_rank] == [sum(len(w[r]) for w in SCHEDULE) for r in range(WORLD)]
    assert sum(len(window) for window in windows(per_rank)) == sum(len(b) for b in per_rank)
    dtypes = {b["rollout_log_probs"].dtype for batches in per_rank for b in batches}
    assert {torch.float32, torch.float64, torch.bfloat16, torch.float16} <= dtypes
    loaded = load_batches(tmp_path / "batches.pt")
    for got, want in zip(interleave(loaded), interleave(per_rank), strict=True):
        assert sorted(got) == sorted(want)
        assert all(torch.equal(got[key], want[key]) for key in want)
        assert all(got[key].dtype == want[key].dtype for key in want)


# ---------------------------------------------------------------------- FSDP2
@pytest.fixture(scope="module")
def fsdp2_run(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    out = tmp_path_factory.mktemp("fsdp2")
    per_rank = save_batches(out / "batches.pt")
    env = clean_env(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    run_processes([(out / "launcher.log", env, ["fsdp2", str(out / "batches.pt"), str(out)])])
    return {
        "per_rank": per_rank,
        "scalars": read_scalars(out / "tb" / "version_0"),
        "records": read_records([out]),
    }


def test_fsdp2_runs_two_ranks_with_sharded_parameters(fsdp2_run: dict[str, Any]) -> None:
    records = fsdp2_run["records"]
    assert_ranks_saw_their_batches(fsdp2_run)
    assert [r["local_rank"] for r in records] == [0, 1]
    assert [r["node_rank"] for r in records] == [0, 0]
    assert {r["strategy"] for r in records} == {"ModelParallelStrategy"}
    # fully_shard made every parameter a DTensor sharded over both ranks: each rank holds
    # half of it (the model's first dimensions are even).
    names = set(records[0]["parameters"])
    assert names == set(records[1]["parameters"]) and len(names) == 4, names
    for name in names:
        sides = [record["parameters"][name] for record in records]
        assert {side["type"] for side in sides} == {"DTensor"}, sides
        assert all(side["placements"] == ["S(0)"] and side["mesh_size"] == WORLD for side in sides)
        whole = math.prod(sides[0]["shape"])
        assert sum(math.prod(side["local_shape"]) for side in sides) == whole, sides
        assert [math.prod(side["local_shape"]) * WORLD for side in sides] == [whole] * WORLD


def test_fsdp2_logs_exact_totals_over_both_ranks(fsdp2_run: dict[str, Any]) -> None:
    assert_exact_totals(fsdp2_run)


# ---------------------------------------------------------------------- two nodes
@pytest.fixture(scope="module")
def nodes_run(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    base = tmp_path_factory.mktemp("nodes")
    per_rank = save_batches(base / "batches.pt")
    shared = {
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(free_port()),
        "WORLD_SIZE": str(WORLD),
        "LOCAL_RANK": "0",
    }
    folders = [base / f"node{node}" for node in range(WORLD)]
    launches = []
    for node, folder in enumerate(folders):
        folder.mkdir()
        env = clean_env(NODE_RANK=str(node), **shared)
        args = ["nodes", str(base / "batches.pt"), str(folder)]
        launches.append((base / f"node{node}.log", env, args))
    run_processes(launches)
    return {
        "per_rank": per_rank,
        "folders": folders,
        "scalars": read_scalars(folders[0] / "tb" / "version_0"),
        "records": read_records(folders),
    }


def test_two_nodes_are_two_ranks_of_one_world(nodes_run: dict[str, Any]) -> None:
    records = nodes_run["records"]
    assert_ranks_saw_their_batches(nodes_run)
    assert [r["node_rank"] for r in records] == [0, 1]
    assert [r["local_rank"] for r in records] == [0, 0]
    assert {r["strategy"] for r in records} == {"DDPStrategy"}
    # Each node wrote its own record, and only node 0 wrote TensorBoard events.
    folders = nodes_run["folders"]
    assert [p.name for p in (folders[1] / "records").iterdir()] == ["rank1.json"]
    assert list(folders[0].rglob("events.out.tfevents*"))
    assert not list(folders[1].rglob("events.out.tfevents*"))


def test_two_nodes_log_exact_totals_over_both_ranks(nodes_run: dict[str, Any]) -> None:
    assert_exact_totals(nodes_run)
