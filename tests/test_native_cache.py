"""The native kernel's cache: the user's own, verified before loading, never a crash.

Whatever could crash or run someone else's code runs in a fresh process
(``native_probe.py``), which reports the statistics of one update, whether the kernel
served it, and its warnings; the statistics must equal the float64 reference whatever
happened to the cache. Fallbacks run with ``TORCH_COMPILE_DISABLE=1``, so they take the
eager path instead of compiling with inductor.
"""

from __future__ import annotations

import copy
import ctypes
import hashlib
import json
import os
import pickle
import platform
import re
import shlex
import shutil
import signal
import stat
import subprocess
import sys
import threading
import time
import warnings
from collections.abc import Callable
from contextlib import suppress
from pathlib import Path
from typing import Any

import pytest
import torch
from lightning_helpers import PYTORCH_LIGHTNING, make_batches
from native_probe import probe_batch
from reference import assert_metrics_close, reference_metrics

from lightning_rollout_debug import MismatchStats, RolloutDebugCallback, backends, native
from lightning_rollout_debug.extras import TokenExtras
from lightning_rollout_debug.rows import ROW_FIELDS

pytestmark = pytest.mark.skipif(
    shutil.which("c++") is None and shutil.which("g++") is None, reason="no C++ compiler here"
)

PROBE = Path(__file__).with_name("native_probe.py")
BATCH_KEYS = ("rollout_log_probs", "old_log_probs", "response_mask")
SETTINGS = (native.CACHE_ENV, native.SWITCH_ENV, "CXX", "XDG_CACHE_HOME")


class EveryPassFailed(dict):
    """Every pass marked failed to compile: where the kernel falls back, nothing compiles."""

    def __contains__(self, plan: object) -> bool:
        return True


def child_env(cache: Path, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in SETTINGS}
    return {**env, native.CACHE_ENV: str(cache), "TORCH_COMPILE_DISABLE": "1", **extra}


def run_probes(
    caches: list[Path], *, group: int | None = None, cwd: Path | None = None, **extra: str
) -> list[dict[str, Any]]:
    """One update per cache folder in a fresh process (``PLANTED_MARKER``: ``<cache>.marker``),
    run with the group id ``group`` (root only) and in the folder ``cwd`` when given."""
    result = subprocess.run(
        [sys.executable, str(PROBE), *map(str, caches)],
        env=child_env(caches[0], **extra),
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
        group=group,
        cwd=cwd,
    )
    assert result.returncode == 0, (result.returncode, result.stderr[-3000:])
    return [{**report, "stderr": result.stderr} for report in json.loads(result.stdout)]


def run_probe(cache: Path, **extra: str) -> dict[str, Any]:
    """One update in a fresh process with ``cache`` as the kernel cache."""
    (report,) = run_probes([cache], **extra)
    return report


def assert_reference(report: dict[str, Any]) -> None:
    rollout, old, mask = probe_batch()
    assert_metrics_close(report["metrics"], reference_metrics([rollout], [old], [mask]))


def kernel_warnings(report: dict[str, Any]) -> list[str]:
    return [message for message in report["warnings"] if "native CPU kernel" in message]


def prebuild(cache: Path, **extra: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "lightning_rollout_debug.native"],
        env=child_env(cache, **extra),
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )


def compile_library(source: str, target: Path) -> Path:
    """A shared library from C++ ``source`` (the test's own, never the kernel)."""
    code = target.with_suffix(".cpp")
    code.write_text(source)
    subprocess.run(
        ["c++", "-shared", "-fPIC", "-o", str(target), str(code)], check=True, timeout=300
    )
    return target


def plant(library: Path, folder: Path, name: str, *, mode: int = 0o700) -> Path:
    """``library`` under the kernel's name in ``folder``, with a matching digest record."""
    target = folder / name
    shutil.copyfile(library, target)
    target.chmod(mode)
    record = target.with_suffix(".sha256")
    record.write_text(hashlib.sha256(target.read_bytes()).hexdigest() + "\n")
    record.chmod(0o600)
    return target


def private_folder(path: Path) -> Path:
    path.mkdir(parents=True)
    path.chmod(0o700)
    return path


# A library whose constructor leaves a mark: loading it runs code.
PLANTED = """
#include <cstdio>
#include <cstdlib>
__attribute__((constructor)) static void planted() {
  if (const char* path = std::getenv("PLANTED_MARKER")) {
    if (FILE* file = std::fopen(path, "w")) { std::fputs("loaded", file); std::fclose(file); }
  }
}
"""

# A library with the kernel's entry points whose columns differ from the Python side's.
OTHER_COLUMNS = """
#include <cstdint>
static const char* kColumns[] = {%s};
extern "C" const char* rollout_row_column(int i) {
  return i >= 0 && i < int(sizeof kColumns / sizeof *kColumns) ? kColumns[i] : nullptr;
}
extern "C" int rollout_row_sums(const void*, const void*, const void*, int, int, int64_t,
                                int64_t, int, float, float, int, double*) { return 0; }
"""


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A kernel built by the prebuild command into a private folder; returns its path."""
    cache = tmp_path_factory.mktemp("built") / "cache"
    result = prebuild(cache)
    assert result.returncode == 0, result.stderr
    return Path(result.stdout.strip())


@pytest.fixture(scope="module")
def planted_library(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return compile_library(PLANTED, tmp_path_factory.mktemp("planted") / "planted.so")


@pytest.fixture
def fresh_kernel(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Path:
    """This process forgets its kernel and uses an empty cache of its own; returns it."""
    cache = tmp_path / "cache"
    monkeypatch.setattr(native, "_kernel", {"function": None, "problem": None, "columns": ()})
    for name in SETTINGS:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv(native.CACHE_ENV, str(cache))
    monkeypatch.setitem(backends._compiling, "failed", EveryPassFailed())
    return cache


def count_calls(monkeypatch: pytest.MonkeyPatch, name: str) -> list[Any]:
    """Records each call of ``native.toolchain.<name>`` (which still runs)."""
    calls: list[Any] = []
    original = getattr(native.toolchain, name)

    def spy(*args: Any, **kwargs: Any) -> Any:
        calls.append(args)
        return original(*args, **kwargs)

    monkeypatch.setattr(native.toolchain, name, spy)
    return calls


# ------------------------------------------------------------------------ where
def test_the_cache_is_the_users_own_folder(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    for name in SETTINGS:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert native.cache_folder() == tmp_path / "home" / ".cache" / "lightning-rollout-debug"
    monkeypatch.setenv("XDG_CACHE_HOME", "relative/ignored")  # the XDG rule: absolute only
    assert native.cache_folder() == tmp_path / "home" / ".cache" / "lightning-rollout-debug"
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert native.cache_folder() == tmp_path / "xdg" / "lightning-rollout-debug"
    monkeypatch.setenv(native.CACHE_ENV, str(tmp_path / "mine"))
    assert native.cache_folder() == tmp_path / "mine"


def test_the_prebuild_command_builds_once_and_later_processes_load_it(tmp_path: Path) -> None:
    cache = tmp_path / "deep" / "cache"
    result = prebuild(cache)
    assert result.returncode == 0, result.stderr
    library = Path(result.stdout.strip())
    assert library.parent == cache and library.suffix == ".so"
    # The first build says so: one line when it starts, one with how long it took.
    assert f"building the native CPU kernel into {cache}" in result.stderr
    assert "built the native CPU kernel in" in result.stderr
    assert stat.S_IMODE(cache.stat().st_mode) == 0o700
    assert library.stat().st_mode & 0o022 == 0
    digest = hashlib.sha256(library.read_bytes()).hexdigest()
    assert library.with_suffix(".sha256").read_text().strip() == digest
    assert stat.S_IMODE(library.with_suffix(".origin").stat().st_mode) == 0o600
    built_at = library.stat().st_mtime_ns
    report = run_probe(cache)
    assert report["native"] and report["warnings"] == []
    assert "building" not in report["stderr"]
    assert library.stat().st_mtime_ns == built_at
    assert sorted(p.name for p in cache.iterdir()) == sorted(
        [library.name, *(library.with_suffix(s).name for s in (".sha256", ".origin")), "build.lock"]
    )
    assert_reference(report)


# ------------------------------------------------------------------------ trust
# Each place gets a library under the kernel's name with a matching digest record, as an
# attacker can compute both: only ownership and modes may stop it.
def _open_folder(root: Path, planted: Path, name: str) -> Path:
    folder = root / "shared"
    folder.mkdir()
    folder.chmod(0o777)  # as a folder another user created first, or made under umask 000
    plant(planted, folder, name)
    return folder


def _writable_file(root: Path, planted: Path, name: str) -> Path:
    folder = private_folder(root / "cache")
    plant(planted, folder, name, mode=0o666)
    return folder


def _link(root: Path, planted: Path, name: str) -> Path:
    folder = private_folder(root / "cache")
    target = plant(planted, folder, name)
    target.rename(root / "elsewhere.so")
    target.symlink_to(root / "elsewhere.so")
    return folder


def _open_parent(root: Path, planted: Path, name: str) -> Path:
    parent = root / "open"
    parent.mkdir()
    parent.chmod(0o777)  # not sticky: anyone may rename the cache folder in it
    folder = private_folder(parent / "cache")
    plant(planted, folder, name)
    return folder


def _other_owner(root: Path, planted: Path, name: str) -> Path:
    folder = private_folder(root / "cache")
    plant(planted, folder, name)
    for path in (folder, *folder.iterdir()):
        os.chown(path, 65534, 65534)
    return folder


def _own_folder(root: Path, planted: Path, name: str) -> Path:
    folder = private_folder(root / "cache")
    plant(planted, folder, name)
    return folder


PLACES: dict[str, tuple[Callable[[Path, Path, str], Path], str]] = {
    "folder-others-can-write": (_open_folder, "is writable by other users"),
    "file-others-can-write": (_writable_file, "is writable by other users"),
    "symlink": (_link, "is not a regular file"),
    "parent-others-can-write": (_open_parent, "is open to other users"),
    "folder-of-another-user": (_other_owner, "belongs to user 65534"),
}
"""Untrusted places, and what the warning says of each."""


@pytest.fixture(scope="module")
def planted(tmp_path_factory: pytest.TempPathFactory, built: Path) -> dict[str, Any]:
    """Libraries planted in every place, and in the user's own folder (the control, and
    kernels with other columns), each tried by a process that has not loaded one yet."""
    root = tmp_path_factory.mktemp("plant")
    evil = compile_library(PLANTED, root / "planted.so")
    folders = {}
    for place, (make, _) in PLACES.items():
        if place == "folder-of-another-user" and os.geteuid() != 0:
            continue  # giving a folder away needs root
        folders[place] = make(private_folder(root / place), evil, built.name)
    folders["own-folder"] = _own_folder(private_folder(root / "own"), evil, built.name)
    for change in ("reordered", "fewer"):
        names = list(ROW_FIELDS)
        if change == "reordered":
            names[-2], names[-1] = names[-1], names[-2]  # the same count, another order
        else:
            names.pop()
        source = OTHER_COLUMNS % ", ".join(f'"{name}"' for name in names)
        library = compile_library(source, root / f"{change}.so")
        folders[change] = _own_folder(private_folder(root / change), library, built.name)
    reports = run_probes(list(folders.values()))
    return {
        name: {**report, "marked": Path(f"{folder}.marker").exists()}
        for (name, folder), report in zip(folders.items(), reports, strict=True)
    }


@pytest.mark.parametrize("place", list(PLACES))
def test_a_library_planted_where_others_can_write_is_never_loaded(
    planted: dict[str, Any], place: str
) -> None:
    if place not in planted:
        pytest.skip("giving a folder to another user needs root")
    report = planted[place]
    assert not report["marked"], "the planted library was loaded"
    assert not report["native"]
    (message,) = kernel_warnings(report)
    assert PLACES[place][1] in message, message
    assert native.CACHE_ENV in message  # the fix
    assert_reference(report)


def _group_shared_with(user: int) -> tuple[int | None, int | None]:
    """``(shared, private)``: a group another user belongs to, and one only ``user`` does."""
    import grp  # POSIX only, as the kernel is
    import pwd

    entries = pwd.getpwall()
    groups = {group.gr_gid: group for group in grp.getgrall()}

    def others(gid: int) -> bool:
        members = groups[gid].gr_mem if gid in groups else []
        return bool(members) or any(e.pw_gid == gid and e.pw_uid != user for e in entries)

    gids = sorted({entry.pw_gid for entry in entries} & set(groups))
    shared = next((gid for gid in gids if others(gid)), None)
    private = next((gid for gid in gids if not others(gid)), None)
    return shared, private


@pytest.mark.skipif(os.geteuid() != 0, reason="running a process as another group needs root")
def test_a_parent_that_a_shared_group_can_write_is_not_trusted(
    tmp_path: Path, planted_library: Path, built: Path
) -> None:
    """A group-writable folder above the cache is closed to others only when its group is
    the user's own (a private group, as with umask 002): with a group that another user
    belongs to, they could rename the cache folder, and the planted library is refused."""
    shared, private = _group_shared_with(os.geteuid())
    assert shared is not None, "this system has no group that another user belongs to"
    folders = {}
    for kind, gid in (("shared", shared), ("private", private)):
        if gid is None:
            continue
        parent = tmp_path / kind
        parent.mkdir()
        os.chown(parent, -1, gid)
        parent.chmod(0o775)  # group-writable, not sticky
        folder = private_folder(parent / "cache")
        plant(planted_library, folder, built.name)
        folders[kind] = folder
    shared_report = run_probe(folders["shared"], group=shared)
    assert not Path(f"{folders['shared']}.marker").exists(), "the planted library was loaded"
    (message,) = kernel_warnings(shared_report)
    assert "is open to other users" in message and f"group {shared}" in message, message
    assert_reference(shared_report)
    if private is not None:  # the control: the same folder, with the user's own group
        run_probe(folders["private"], group=private)
        assert Path(f"{folders['private']}.marker").exists()


def _grant_write_by_acl(folder: Path, uid: int) -> None:
    """An access control list on ``folder`` that lets user ``uid`` write in it."""
    import struct

    undefined = 0xFFFFFFFF  # (tag, permissions, id): owner, named user, group, mask, other
    entries = [(0x01, 7, undefined), (0x02, 7, uid), (0x04, 5, undefined)]
    entries += [(0x10, 7, undefined), (0x20, 5, undefined)]
    blob = struct.pack("<I", 2) + b"".join(struct.pack("<HHI", *entry) for entry in entries)
    try:
        os.setxattr(folder, "system.posix_acl_access", blob)
    except OSError as error:
        pytest.skip(f"this file system keeps no access control lists ({error})")


@pytest.mark.skipif(os.geteuid() != 0, reason="links and lists for another user need root")
def test_links_and_access_lists_of_other_users_do_not_open_the_cache(
    tmp_path: Path, planted_library: Path, built: Path
) -> None:
    """A folder above the cache whose access control list lets another user write is open
    to them though its mode does not say so; and a cache path through another user's link
    is used as the folder the link pointed to when checked, so that turning the link
    elsewhere afterwards changes nothing."""
    listed = tmp_path / "listed"
    listed.mkdir(mode=0o775)
    _, private = _group_shared_with(os.geteuid())
    if private is not None:
        os.chown(listed, -1, private)  # its group bits alone would not open it
    _grant_write_by_acl(listed, 65534)
    folder = private_folder(listed / "cache")
    plant(planted_library, folder, built.name)
    report = run_probe(folder)
    assert not Path(f"{folder}.marker").exists(), "the planted library was loaded"
    (message,) = kernel_warnings(report)
    assert "is open to other users" in message and "an access control list" in message
    sticky = tmp_path / "sticky"
    sticky.mkdir()
    sticky.chmod(0o1777)
    real = private_folder(tmp_path / "real")
    link = sticky / "link"
    link.symlink_to(real)
    os.lchown(link, 65534, 65534)  # the link is another user's: they may replace it
    result = prebuild(link / "cache")
    assert result.returncode == 0, result.stderr
    assert Path(result.stdout.strip()).parent == real / "cache"


def test_the_planted_library_does_run_code_when_loaded(planted: dict[str, Any]) -> None:
    """The control for the test above, and a kernel without its entry points: in the
    user's own folder with a matching record the library loads (its mark appears), the
    missing entry points are found, and the update falls back with the same numbers."""
    report = planted["own-folder"]
    assert report["marked"] and not report["native"]
    (message,) = kernel_warnings(report)
    assert "lacks the kernel's entry points" in message
    assert_reference(report)


@pytest.mark.parametrize("change", ["reordered", "fewer"])
def test_the_columns_are_checked_by_name(planted: dict[str, Any], change: str) -> None:
    report = planted[change]
    assert not report["native"]
    (message,) = kernel_warnings(report)
    assert "computes the columns" in message and "'ratio_low'" in message
    assert_reference(report)


# ------------------------------------------------------------------ integrity
def _truncate(library: Path) -> None:
    library.write_bytes(library.read_bytes()[: library.stat().st_size // 2])


def _flip(library: Path) -> None:
    data = bytearray(library.read_bytes())
    data[len(data) // 2] ^= 0xFF
    library.write_bytes(bytes(data))


def _unrecorded(library: Path) -> None:
    library.with_suffix(".sha256").unlink()  # a build that died before its record


DAMAGES = {"truncated": _truncate, "flipped": _flip, "unrecorded": _unrecorded}


@pytest.fixture(scope="module")
def damaged(tmp_path_factory: pytest.TempPathFactory, built: Path) -> dict[str, Any]:
    """Copies of a built cache, each damaged one way, tried by one fresh process."""
    root = tmp_path_factory.mktemp("damaged")
    folders = {}
    for name, damage in DAMAGES.items():
        folders[name] = root / name
        shutil.copytree(built.parent, folders[name])
        damage(folders[name] / built.name)
    reports = run_probes(list(folders.values()))
    return {name: (folders[name], report) for name, report in zip(folders, reports, strict=True)}


@pytest.mark.parametrize("damage", list(DAMAGES))
def test_a_damaged_library_is_rebuilt_never_loaded(
    damaged: dict[str, Any], built: Path, damage: str
) -> None:
    """dlopen of a truncated library dies of SIGBUS: the digest check must come first."""
    folder, report = damaged[damage]
    assert report["native"] and kernel_warnings(report) == []
    assert f"building the native CPU kernel into {folder}" in report["stderr"]
    library = folder / built.name
    digest = hashlib.sha256(library.read_bytes()).hexdigest()
    assert library.with_suffix(".sha256").read_text().strip() == digest
    assert library.read_bytes() == built.read_bytes()
    assert_reference(report)


# ----------------------------------------------------------------- concurrency
THREADS = """
import threading, warnings
from lightning_rollout_debug import native
builds = []
original = native.cache._compile
native.cache._compile = lambda *args: builds.append(args) or original(*args)
results = []
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    check = lambda: results.append(native.available())
    threads = [threading.Thread(target=check) for _ in range(4)]
    for thread in threads: thread.start()
    for thread in threads: thread.join()
print(len(builds), results, [str(w.message) for w in caught])
"""


def test_threads_building_at_once_build_once(tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    result = subprocess.run(
        [sys.executable, "-c", THREADS],
        env=child_env(cache),
        capture_output=True,
        text=True,
        timeout=300,
        check=True,
    )
    assert result.stdout.strip() == "1 [True, True, True, True] []", result.stderr
    names = sorted(path.suffix or path.name for path in cache.iterdir())
    assert names == [".lock", ".origin", ".sha256", ".so"]  # no partial file left behind


def test_processes_building_at_once_leave_one_kernel(tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    probes = [
        subprocess.Popen(
            [sys.executable, str(PROBE)],
            env=child_env(cache),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for _ in range(2)
    ]
    reports = [json.loads(probe.communicate(timeout=300)[0])[0] for probe in probes]
    assert [probe.returncode for probe in probes] == [0, 0]
    for report in reports:
        assert report["native"] and report["warnings"] == []
        assert_reference(report)
    (library,) = cache.glob("*.so")
    assert sorted(path.name for path in cache.iterdir()) == sorted(
        [library.name, *(library.with_suffix(s).name for s in (".sha256", ".origin")), "build.lock"]
    )


# ------------------------------------------------------------ no compiler left
# A container image that prebuilt the kernel and then removed its build tools: the
# compiler-keyed name cannot be computed, and the origin records find the library.
NO_COMPILER = """
import json
import torch
from lightning_rollout_debug import GROUPS, native
from lightning_rollout_debug.rows import ROW_FIELDS, row_sums, rows_for
try:
    native.toolchain.command()
    hidden = False
except native.KernelUnavailable:
    hidden = True
generator = torch.Generator().manual_seed(1)
rollout = torch.log(torch.rand(16, 300, generator=generator) * 0.99 + 0.005)
old = (rollout + 0.05 * torch.randn(16, 300, generator=generator)).clamp(max=0.0)
mask = torch.rand(16, 300, generator=generator) < 0.8
groups = frozenset(GROUPS)
got = native.row_sums(rollout, old, mask, rows_for(groups), 2.0, ROW_FIELDS)
want = row_sums(rollout, old, mask, groups, 2.0)
same = got is not None and all(
    torch.allclose(got[name], value.double(), rtol=3e-6, atol=1e-9)
    for name, value in want.items()
)
print(json.dumps({"hidden": hidden, "available": native.available(),
                  "path": str(native.build()), "same": same}))
"""


def bare_path(root: Path) -> str:
    """A ``PATH`` of one private, empty folder: no compiler can be found on it."""
    return str(private_folder(root / "bare-bin"))


def portable_key(source: bytes, cpu: bytes) -> str:
    """What an origin record names a build by: its source and CPU (and machine type)."""
    parts = [hashlib.sha256(source).digest(), cpu, platform.machine().encode()]
    return hashlib.sha256(b"\0".join(parts)).hexdigest()[:24]


def write_origin(library: Path, source: bytes, cpu: bytes, flags: tuple[str, ...]) -> None:
    """The origin record of ``library``, saying it was built from ``source`` for ``cpu``."""
    record = library.with_suffix(".origin")
    record.write_text(f"{portable_key(source, cpu)}\n{' '.join(flags)}\n")
    record.chmod(0o600)


def test_a_prebuilt_kernel_is_used_where_no_compiler_is_left(tmp_path: Path, built: Path) -> None:
    """Built with a compiler, then used by a process that finds none: the same library,
    the same row sums as the torch arithmetic, and the prebuild command prints it."""
    cache = tmp_path / "cache"
    shutil.copytree(built.parent, cache)
    env = child_env(cache, PATH=bare_path(tmp_path))
    result = subprocess.run(
        [sys.executable, "-c", NO_COMPILER],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads(result.stdout)
    want = {"hidden": True, "available": True, "path": str(cache / built.name), "same": True}
    assert report == want, result.stderr[-3000:]
    assert "building" not in result.stderr
    origin = (cache / built.name).with_suffix(".origin").read_text()
    assert origin.split("\n")[0] == portable_key(SOURCE_BYTES, CPU)  # an image's format
    again = prebuild(cache, PATH=env["PATH"])
    assert again.returncode == 0, again.stderr
    assert again.stdout.strip() == str(cache / built.name)


def _prebuilt(folder: Path) -> None:
    """As built: the control."""


def _earlier_version(folder: Path) -> None:
    """A build of an earlier version: a digest record only."""
    for record in folder.glob("*.origin"):
        record.unlink()


def _origin_of(source: bytes, cpu: bytes) -> Callable[[Path], None]:
    def rewrite(folder: Path) -> None:
        (library,) = folder.glob("*.so")
        write_origin(library, source, cpu, FLAGS)  # flags this CPU may take, another origin

    return rewrite


def _library_open_to_others(folder: Path) -> None:
    (library,) = folder.glob("*.so")
    library.chmod(0o777)


def _origin_open_to_others(folder: Path) -> None:
    (library,) = folder.glob("*.so")
    write_origin(library, SOURCE_BYTES, CPU, FLAGS)  # as built, but open
    library.with_suffix(".origin").chmod(0o666)


def _wrong_digest(folder: Path) -> None:
    (library,) = folder.glob("*.so")
    _flip(library)


SOURCE_BYTES = native.SOURCE.read_bytes()
CPU = native.cache._cpu_signature()
FLAGS = next(f for f in native.cache._FLAG_SETS if CPU or "-march=native" not in f)
NOT_FOUND = "nor is a kernel built from this source for this CPU in"
WITHOUT_COMPILER: dict[str, tuple[Callable[[Path], None], str | None]] = {
    "prebuilt": (_prebuilt, None),
    "earlier-version": (_earlier_version, NOT_FOUND),
    "other-source": (_origin_of(SOURCE_BYTES + b"// edited\n", CPU), NOT_FOUND),
    "other-cpu": (_origin_of(SOURCE_BYTES, CPU + b"\nmodel name\t: another"), NOT_FOUND),
    "wrong-digest": (_wrong_digest, NOT_FOUND),
    "library-open-to-others": (_library_open_to_others, "is writable by other users"),
    "origin-open-to-others": (_origin_open_to_others, "is writable by other users"),
}
"""Caches tried without a compiler, and what the warning says (``None``: no warning)."""


@pytest.fixture(scope="module")
def without_compiler(tmp_path_factory: pytest.TempPathFactory, built: Path) -> dict[str, Any]:
    """Copies of a built cache, each changed one way, tried by one process with no compiler."""
    root = tmp_path_factory.mktemp("without-compiler")
    folders = {}
    for name, (change, _) in WITHOUT_COMPILER.items():
        folders[name] = root / name
        shutil.copytree(built.parent, folders[name])
        change(folders[name])
    reports = run_probes(list(folders.values()), PATH=bare_path(root))
    return {name: (folders[name], report) for name, report in zip(folders, reports, strict=True)}


@pytest.mark.parametrize("case", list(WITHOUT_COMPILER))
def test_without_a_compiler_only_a_verified_kernel_of_this_source_and_cpu_loads(
    without_compiler: dict[str, Any], case: str
) -> None:
    """A library of another source or CPU (by its origin record), one an earlier version
    built (no origin record) and one that fails the usual checks are not loaded; the
    warning names the compiler that is missing and what was looked for."""
    folder, report = without_compiler[case]
    said = WITHOUT_COMPILER[case][1]
    assert_reference(report)
    if said is None:
        assert report["native"] and report["warnings"] == []
        return
    assert not report["native"]
    (message,) = kernel_warnings(report)
    assert "no C++ compiler found in a folder of the PATH" in message, message
    assert said in message, message
    if said == NOT_FOUND:
        assert f"{NOT_FOUND} {folder}" in message, message
        assert "python -m lightning_rollout_debug.native" in message, message
        assert f"{native.SWITCH_ENV}=0" in message, message
    assert not list(folder.glob(".*")), "something was built or left behind"


def test_without_a_compiler_the_first_flag_set_and_then_the_newest_build_is_taken(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, built: Path
) -> None:
    """Of the matching libraries, the flag sets' order decides, then the newest; a CPU
    that cannot be told never takes a ``-march=native`` build; a refused ``$CXX`` counts
    as no compiler. Nothing here is loaded: only the choice is checked."""
    cache = private_folder(tmp_path / "cache")
    monkeypatch.setenv(native.CACHE_ENV, str(cache))
    with_compiler = os.environ["PATH"]
    monkeypatch.setenv("PATH", bare_path(tmp_path))
    monkeypatch.delenv("CXX", raising=False)
    cpu = b"model name\t: a CPU of the test"
    monkeypatch.setattr(native.cache, "_cpu_signature", lambda: cpu)
    native_set, portable_set = native.cache._FLAG_SETS[:2]
    assert "-march=native" in native_set and "-march=native" not in portable_set
    now = time.time()

    def build(
        name: str, flags: tuple[str, ...], age: float, cpu: bytes = cpu, folder: Path = cache
    ) -> Path:
        library = plant(built, folder, f"row_sums_{name}.so")
        write_origin(library, SOURCE_BYTES, cpu, flags)
        os.utime(library, (now - age, now - age))
        return library

    build("portable-newest", portable_set, age=0)
    older = build("native-older", native_set, age=200)
    newer = build("native-newer", native_set, age=100)
    assert native.cache.verified_build() == newer
    newer.with_suffix(".sha256").unlink()  # unfinished: not verified, never loaded
    assert native.cache.verified_build() == older
    monkeypatch.setenv("PATH", with_compiler)
    assert native.toolchain.command()  # found: the choice below is the refused CXX's
    monkeypatch.setenv("CXX", "c++ -O2")
    assert native.cache.verified_build() == older  # refused: as if none were found

    unknown = private_folder(tmp_path / "unknown-cpu")
    monkeypatch.setenv(native.CACHE_ENV, str(unknown))
    monkeypatch.setattr(native.cache, "_cpu_signature", lambda: b"")
    build("native", native_set, age=0, cpu=b"", folder=unknown)  # no build writes this
    with pytest.raises(native.KernelUnavailable, match=NOT_FOUND):
        native.cache.verified_build()
    portable = build("portable", portable_set, age=100, cpu=b"", folder=unknown)
    assert native.cache.verified_build() == portable


# ----------------------------------------------------------------- operations
def test_an_unusable_cache_is_found_before_compiling(
    fresh_kernel: Path, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    compiles = count_calls(monkeypatch, "run")
    blocker = tmp_path / "a-file"
    blocker.write_text("not a folder")
    monkeypatch.setenv(native.CACHE_ENV, str(blocker / "cache"))
    with pytest.warns(RuntimeWarning, match="cannot be created") as caught:
        assert not native.available()
    assert native.CACHE_ENV in str(caught[0].message)
    assert compiles == []


def test_a_full_disk_is_found_before_compiling(
    fresh_kernel: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    compiles = count_calls(monkeypatch, "run")
    real_fsync = os.fsync

    def full(descriptor: int) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "fsync", full)
    rollout, old, mask = probe_batch()
    stats = MismatchStats(compile=True)
    with pytest.warns(RuntimeWarning, match="is not writable \\(No space left on device\\)"):
        stats.update(rollout, old, mask)
    monkeypatch.setattr(os, "fsync", real_fsync)
    assert compiles == []
    assert [path.name for path in fresh_kernel.iterdir()] == ["build.lock"]  # no probe left
    assert_metrics_close(stats.compute(), reference_metrics([rollout], [old], [mask]))


@pytest.mark.parametrize("value", ["0", "false", "OFF", "no"])
def test_the_switch_turns_the_kernel_off_silently(
    fresh_kernel: Path, monkeypatch: pytest.MonkeyPatch, value: str
) -> None:
    compiles = count_calls(monkeypatch, "run")
    monkeypatch.setenv(native.SWITCH_ENV, value)
    rollout, old, mask = probe_batch()
    stats = MismatchStats(compile=True)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        stats.update(rollout, old, mask)
    assert not native.available() and compiles == [] and not fresh_kernel.exists()
    assert_metrics_close(stats.compute(), reference_metrics([rollout], [old], [mask]))


def test_an_unknown_switch_value_is_named(
    fresh_kernel: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(native.SWITCH_ENV, "maybe")
    with pytest.warns(RuntimeWarning, match="'maybe' is not one of 0, false, off, no"):
        assert not native.available()


def test_a_compiler_command_with_arguments_works(tmp_path: Path, built: Path) -> None:
    report = run_probe(tmp_path / "cache", CXX=f"env {shutil.which('c++') or 'g++'}")
    assert report["native"] and report["warnings"] == []
    (library,) = (tmp_path / "cache").glob("*.so")
    assert library.name != built.name  # another compiler command, another kernel
    assert_reference(report)


def test_a_compiler_that_does_not_exist_is_named(tmp_path: Path) -> None:
    report = run_probe(tmp_path / "cache", CXX="no-such-c++ -O2")
    (message,) = kernel_warnings(report)
    assert "CXX='no-such-c++ -O2': no no-such-c++ is in a folder of the PATH" in message
    assert not list((tmp_path / "cache").glob("*.so"))
    assert_reference(report)


MARKING_COMPILER = """#!/bin/sh
echo ran > "$0.marker"
exec %s "$@"
"""


def marking_compiler(folder: Path, name: str = "c++") -> Path:
    """A compiler wrapper in ``folder`` that leaves ``<wrapper>.marker`` when it runs."""
    wrapper = folder / name
    wrapper.write_text(MARKING_COMPILER % (shutil.which("c++") or shutil.which("g++")))
    wrapper.chmod(0o755)
    return wrapper


def test_a_compiler_in_a_folder_others_can_write_is_never_run(tmp_path: Path) -> None:
    """Named by CXX or found on the PATH (a relative entry, a folder open to others): a
    compiler that another user could have put there is not run; one found further on the
    PATH builds the kernel."""
    open_folder = tmp_path / "open"
    open_folder.mkdir()
    open_folder.chmod(0o777)
    planted = marking_compiler(open_folder)
    named = run_probe(tmp_path / "named", CXX=str(planted))
    (message,) = kernel_warnings(named)
    assert f"{planted} is missing, or other users can change it" in message
    assert not named["native"]
    assert_reference(named)
    (tmp_path / "here").mkdir()
    marking_compiler(tmp_path / "here")
    path = os.pathsep.join(["here", str(open_folder), os.environ["PATH"]])
    found = run_probes([tmp_path / "found"], cwd=tmp_path, PATH=path)
    assert found[0]["native"] and kernel_warnings(found[0]) == []
    assert not list(tmp_path.rglob("*.marker")), "a compiler others could plant was run"
    assert_reference(found[0])


# A header that wraps the real one and adds a constructor: a library built with it runs
# code when loaded.
PLANTED_HEADER = """#include_next <algorithm>
#include <cstdio>
#include <cstdlib>
__attribute__((constructor)) static void planted_header() {
  if (const char* path = std::getenv("PLANTED_MARKER")) {
    if (FILE* file = std::fopen(path, "w")) { std::fputs("loaded", file); std::fclose(file); }
  }
}
"""


@pytest.fixture
def shared_toolchain(tmp_path: Path) -> Path:
    """A folder open to others with a planted ``<algorithm>`` and a marking assembler."""
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o777)
    (shared / "algorithm").write_text(PLANTED_HEADER)
    assembler = shared / "as"
    assembler.write_text(MARKING_COMPILER % shutil.which("as"))
    assembler.chmod(0o755)
    return shared


@pytest.mark.parametrize("variable", ["CPLUS_INCLUDE_PATH", "CPATH", "COMPILER_PATH"])
def test_variables_that_point_the_compiler_elsewhere_do_not_reach_it(
    tmp_path: Path, shared_toolchain: Path, variable: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Headers and programs that the user's environment finds in a folder others can write
    are not used: the kernel builds from the system's own and loads clean."""
    control = tmp_path / "control"
    control.mkdir()
    source = control / "uses_algorithm.cpp"
    source.write_text("#include <algorithm>\nint most(int a, int b) { return std::max(a, b); }\n")
    env = {**os.environ, variable: str(shared_toolchain)}
    command = ["c++", "-shared", "-fPIC", str(source), "-o", str(control / "control.so")]
    subprocess.run(command, env=env, check=True, timeout=300)
    monkeypatch.setenv("PLANTED_MARKER", str(control / "control.marker"))
    ctypes.CDLL(str(control / "control.so"))
    assert list(tmp_path.rglob("*.marker")), f"{variable} does not reach a plain compiler here"
    for marker in tmp_path.rglob("*.marker"):
        marker.unlink()

    report = run_probe(tmp_path / "cache", **{variable: str(shared_toolchain)})
    assert report["native"] and kernel_warnings(report) == []
    assert not list(tmp_path.rglob("*.marker")), f"{variable} reached the kernel's compiler"
    assert [p.name for p in (tmp_path / "cache").iterdir() if p.name.startswith(".")] == []
    assert_reference(report)


def test_a_held_lock_ends_in_a_warning_not_a_hang(
    fresh_kernel: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A build lock that another process holds past the wait (a build stuck or suspended)
    means the torch path, with a warning that names the lock."""
    import fcntl

    fresh_kernel.mkdir(mode=0o700)
    holder = os.open(fresh_kernel / "build.lock", os.O_RDWR | os.O_CREAT, 0o600)
    fcntl.flock(holder, fcntl.LOCK_EX)  # another open file: a lock of another process
    monkeypatch.setattr(native.cache, "_LOCK_WAIT_S", 0.3)
    try:
        with pytest.warns(RuntimeWarning, match="build.lock has been held by another process"):
            assert not native.available()
    finally:
        os.close(holder)


def test_a_compiler_that_hangs_is_killed_with_what_it_started(
    fresh_kernel: Path, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """On the compile timeout the compiler's whole session ends, its children included."""
    hanging = tmp_path / "hanging-c++"
    hanging.write_text('#!/bin/sh\nsleep 1000 &\necho $! > "$0.child"\nwait\n')
    hanging.chmod(0o755)
    monkeypatch.setenv("CXX", str(hanging))
    monkeypatch.setattr(native.toolchain, "COMPILE_TIMEOUT_S", 1.0)
    with pytest.warns(RuntimeWarning, match="did not finish in 1 s"):
        assert not native.available()
    child = Path(f"/proc/{Path(f'{hanging}.child').read_text().strip()}")
    deadline = time.monotonic() + 5
    while child.exists() and time.monotonic() < deadline:
        time.sleep(0.05)  # killed, then reaped by whoever inherited it
    with suppress(FileNotFoundError):
        state = (child / "stat").read_text().split()[2]
        assert state == "Z", f"the compiler's child {child.name} still runs ({state})"


INTERRUPTED = """
import signal, sys
signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # as a training script may
from lightning_rollout_debug.native import cache
cache.verified_build()
"""


def test_a_build_ended_by_a_signal_ends_its_compiler(tmp_path: Path) -> None:
    """A build interrupted by an exception (here a SIGTERM handler's ``SystemExit``) kills
    the compiler's session, which runs apart from the building process's own group."""
    hanging = tmp_path / "hanging-c++"
    hanging.write_text('#!/bin/sh\nsleep 1000 &\necho "$$ $!" > "$0.pids.partial"\n'
                       'mv "$0.pids.partial" "$0.pids"\nwait\n')  # fmt: skip
    hanging.chmod(0o755)
    pids = Path(f"{hanging}.pids")
    building = subprocess.Popen(
        [sys.executable, "-c", INTERRUPTED],
        env=child_env(tmp_path / "cache", CXX=str(hanging)),
        stderr=subprocess.PIPE,
        text=True,
    )
    started: list[int] = []
    try:
        deadline = time.monotonic() + 120
        while not pids.exists() and building.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        assert pids.exists(), "the compiler did not start"
        started = [int(pid) for pid in pids.read_text().split()]
        building.send_signal(signal.SIGTERM)
        assert building.wait(timeout=60) == 143, building.stderr.read()
        deadline = time.monotonic() + 5
        running = started
        while running and time.monotonic() < deadline:
            time.sleep(0.05)  # killed, then reaped by whoever inherited them
            running = [pid for pid in started if _runs(pid)]
        assert not running, f"the compiler's processes {running} still run"
    finally:
        if building.poll() is None:
            building.kill()
            building.wait()
        for pid in started:
            if _runs(pid):
                os.kill(pid, signal.SIGKILL)


def _runs(pid: int) -> bool:
    """Whether process ``pid`` exists and is not a zombie."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (FileNotFoundError, ProcessLookupError):
        return False


@pytest.mark.parametrize("damage", ["binary", "oversized"])
def test_a_damaged_digest_record_means_a_rebuild(tmp_path: Path, built: Path, damage: str) -> None:
    cache = tmp_path / "cache"
    shutil.copytree(built.parent, cache)
    record = cache / built.with_suffix(".sha256").name
    if damage == "binary":
        record.write_bytes(b"\xff\xfe" + bytes(range(256)))
    else:
        with open(record, "wb") as handle:
            handle.truncate(1 << 30)  # sparse: a gigabyte of zeros that is never read
    report = run_probe(cache)
    assert report["native"] and kernel_warnings(report) == []
    assert "building" in report["stderr"]
    digest = hashlib.sha256((cache / built.name).read_bytes()).hexdigest()
    assert record.read_text().strip() == digest
    assert_reference(report)


def test_missing_folders_of_the_cache_are_made_private(tmp_path: Path, built: Path) -> None:
    """Under umask 000 too, every folder made for the cache has mode 0700, as XDG asks."""
    home = tmp_path / "home"
    home.mkdir(mode=0o700)
    result = subprocess.run(
        [
            sys.executable,
            "-c",
            "import os; os.umask(0); import runpy; "
            "runpy.run_module('lightning_rollout_debug.native', run_name='__main__')",
        ],
        env={**child_env(home / "unused"), "HOME": str(home), native.CACHE_ENV: ""},
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    for folder in (home / ".cache", home / ".cache" / "lightning-rollout-debug"):
        assert stat.S_IMODE(folder.stat().st_mode) == 0o700, folder


@pytest.mark.parametrize("owner", ["open-to-others", "another-user"])
def test_nothing_is_made_inside_a_folder_that_is_not_the_users(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, owner: str
) -> None:
    """A home folder that another user owns or can write (``sudo -E``, a shared home) is
    refused before anything is made in it: no ``.cache`` of the wrong owner is left."""
    if owner == "another-user" and os.geteuid() != 0:
        pytest.skip("a folder of another user needs root")
    home = tmp_path / "home"
    home.mkdir()
    if owner == "another-user":
        os.chown(home, 65534, 65534)
        home.chmod(0o755)
        problem = "belongs to user 65534, not to you"
    else:
        home.chmod(0o777)
        problem = "is open to other users"
    for name in SETTINGS:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("HOME", str(home))
    wanted = re.escape(f"{home}, above the cache folder, {problem}")
    with pytest.raises(native.KernelUnavailable, match=wanted):
        native.cache.verified_build()
    assert list(home.iterdir()) == []


def test_a_relative_home_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in SETTINGS:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("HOME", "relative-home")
    with pytest.raises(native.KernelUnavailable, match="'relative-home' is not an absolute path"):
        native.cache.verified_build()
    assert not os.path.lexists("relative-home")


@pytest.mark.parametrize(
    "words",
    [["-B{shared}"], ["@{shared}/options"], ["-specs={shared}/specs"], ["-Bhere"]],
    ids=["B", "file", "specs", "relative"],
)
def test_options_in_cxx_are_refused(
    tmp_path: Path, shared_toolchain: Path, words: list[str]
) -> None:
    """``$CXX`` names programs only: an option could send the compiler to programs,
    options or files another user can write (here a planted ``as``)."""
    (shared_toolchain / "options").write_text(f"-B{shared_toolchain}\n")
    (shared_toolchain / "specs").write_text("")
    options = [word.format(shared=shared_toolchain) for word in words]
    compiler = shutil.which("c++") or "g++"
    report = run_probe(tmp_path / "cache", CXX=shlex.join([compiler, *options]))
    (message,) = kernel_warnings(report)
    assert f"{options[0]!r} is not a program" in message, message
    assert not report["native"] and not list(tmp_path.rglob("*.marker"))
    assert_reference(report)


def test_a_wrapper_that_sets_variables_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CXX", "env LD_PRELOAD=/tmp/planted.so c++")
    with pytest.raises(native.KernelUnavailable, match=r"'LD_PRELOAD=/tmp/planted\.so' is not a"):
        native.toolchain.command()


def test_a_cxx_that_cannot_be_read_is_named(tmp_path: Path) -> None:
    result = prebuild(tmp_path / "cache", CXX="g++ -DX='1")
    assert result.returncode == 1 and "Traceback" not in result.stderr, result.stderr
    assert 'CXX="g++ -DX=\'1" cannot be read (No closing quotation)' in result.stderr


def test_a_script_compiler_needs_a_trusted_interpreter(tmp_path: Path) -> None:
    """A compiler script in a folder of the user's own runs only if its ``#!``
    interpreter (and that one's) is closed to others too."""
    open_folder = tmp_path / "open"
    open_folder.mkdir()
    open_folder.chmod(0o777)
    shutil.copy(shutil.which("sh") or "/bin/sh", open_folder / "sh")
    tools = private_folder(tmp_path / "tools")
    compiler = shutil.which("c++") or shutil.which("g++")
    planted, system = tools / "planted-c++", tools / "system-c++"
    planted.write_text(f'#!{open_folder / "sh"}\nexec {compiler} "$@"\n')
    system.write_text(f'#!{shutil.which("sh")}\nexec {compiler} "$@"\n')
    inner = tools / "inner-c++"  # a script whose interpreter is the planted script
    inner.write_text(f"#!{planted}\n")
    for script in (planted, system, inner):
        script.chmod(0o755)
    assert native.trust.trusted_program(str(system)) == str(system)
    assert native.trust.trusted_program(str(planted)) is None
    assert native.trust.trusted_program(str(inner)) is None


def test_the_compiler_reads_the_source_the_key_was_made_from(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """The source is read once: an edit between the key and the compile cannot reach the
    library stored under the unedited source's key."""
    source = tmp_path / "row_sums.cpp"
    source.write_bytes(native.cache.SOURCE.read_bytes())
    monkeypatch.setattr(native.cache, "SOURCE", source)
    monkeypatch.setenv(native.CACHE_ENV, str(tmp_path / "cache"))
    monkeypatch.delenv("CXX", raising=False)
    original = native.cache._private_folder

    def edit_then_continue() -> Path:  # after the source was read for the key
        with open(source, "a") as handle:
            handle.write('\n#error "edited after the key was made"\n')
        return original()

    monkeypatch.setattr(native.cache, "_private_folder", edit_then_continue)
    built = native.cache.verified_build()
    assert built.exists() and built.with_suffix(".sha256").exists()


def test_a_cpu_that_cannot_be_told_gets_no_native_build_and_failures_say_why(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """Without the CPU's model and flags no ``-march=native`` build is tried (its library
    would be keyed like any other CPU's); when no build works the message ends with what
    the compiler said; and partial files of builds killed long ago are removed."""
    cache = private_folder(tmp_path / "cache")
    old, recent = cache / ".partial-old.so", cache / ".partial-recent.so"
    stale = cache / ".compiler-old"
    for path in (old, recent):
        path.write_bytes(b"partial")
    stale.mkdir()
    (stale / "cc1plus.s").write_text("")
    long_ago = time.time() - native.cache._LEFTOVER_AGE_S - 60
    for path in (old, stale):
        os.utime(path, (long_ago, long_ago))
    commands: list[list[str]] = []

    def failing(command: list[str], folder: Path, stdin: bytes | None = None) -> Any:
        commands.append(command)
        return subprocess.CompletedProcess(command, 1, "", "c++: error: some reason\n")

    monkeypatch.setenv(native.CACHE_ENV, str(cache))
    monkeypatch.delenv("CXX", raising=False)
    monkeypatch.setattr(native.cache, "_cpu_signature", lambda: b"")
    monkeypatch.setattr(native.toolchain, "run", failing)
    with pytest.raises(native.KernelUnavailable, match=r"here \(c\+\+: error: some reason\)"):
        native.cache.verified_build()
    assert len(commands) == 2 and all("-march=native" not in c for c in commands), commands
    assert not old.exists() and not stale.exists() and recent.exists()


def test_an_upgraded_compiler_builds_anew(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """The key holds what the compiler command's files are, not only their names."""
    tools = private_folder(tmp_path / "tools")
    compiler = tools / "c++"
    names: list[list[str]] = []

    def names_of(targets: list[Path]) -> None:
        names.append([target.name for target in targets])
        raise native.KernelUnavailable("stop before building")

    monkeypatch.setenv(native.CACHE_ENV, str(private_folder(tmp_path / "cache")))
    monkeypatch.setenv("CXX", str(compiler))
    monkeypatch.setattr(native.cache, "_first_verified", names_of)
    for version in ("12", "13.1"):
        compiler.write_text(f'#!/bin/sh\n# version {version}\nexec c++ "$@"\n')
        compiler.chmod(0o755)
        with pytest.raises(native.KernelUnavailable, match="stop before building"):
            native.cache.verified_build()
    assert len(names) == 2 and not set(names[0]) & set(names[1])


def test_the_compiler_runs_in_a_private_folder_with_trusted_libraries(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """Of ``LD_LIBRARY_PATH`` (a compiler module's) only absolute folders closed to others
    reach the compiler, and relative names it is given resolve in its private folder."""
    cache = private_folder(tmp_path / "cache")
    mine = private_folder(tmp_path / "lib")
    open_folder = tmp_path / "open-lib"
    open_folder.mkdir()
    open_folder.chmod(0o777)
    monkeypatch.setenv("LD_LIBRARY_PATH", os.pathsep.join(["", str(open_folder), str(mine)]))
    env = shutil.which("env") or "/usr/bin/env"
    result = native.toolchain.run([env, "sh", "-c", 'pwd; echo "[$LD_LIBRARY_PATH]"'], cache)
    where, libraries = result.stdout.split()
    assert Path(where).parent == cache and Path(where).name.startswith(".compiler-")
    assert libraries == f"[{mine}]"


def test_a_kernel_that_rejects_its_arguments_falls_back(monkeypatch: pytest.MonkeyPatch) -> None:
    rejecting = {"function": lambda *args: 3, "problem": None, "columns": ROW_FIELDS}
    monkeypatch.setattr(native, "_kernel", rejecting)
    monkeypatch.setitem(backends._compiling, "failed", EveryPassFailed())
    rollout, old, mask = probe_batch()
    stats = MismatchStats(compile=True)
    with pytest.warns(RuntimeWarning, match=r"rejected its arguments \(status 3\)"):
        stats.update(rollout, old, mask)
    stats.update(rollout, old, mask)  # silent from now on
    want = reference_metrics([rollout] * 2, [old] * 2, [mask] * 2)
    assert_metrics_close(stats.compute(), want)


# -------------------------------------------------------------------- threads
def test_updates_from_several_threads_are_all_counted() -> None:
    """Each thread adds batches to one window: no update is lost, the result is exact."""
    generator = torch.Generator().manual_seed(4)
    batches = [
        (
            torch.log(torch.rand(8, 50 + i, generator=generator) * 0.9 + 0.05),
            torch.log(torch.rand(8, 50 + i, generator=generator) * 0.9 + 0.05),
            torch.rand(8, 50 + i, generator=generator) < 0.7,
        )
        for i in range(24)
    ]
    stats, extras = MismatchStats(compile=False), TokenExtras(compile=False)
    barrier = threading.Barrier(6)

    def feed(part: int) -> None:
        barrier.wait()
        for batch in batches[part::6]:
            for _ in range(20):
                stats.update(*batch)
                extras.update(*batch)

    threads = [threading.Thread(target=feed, args=(part,)) for part in range(6)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    rollout, old, mask = ([b[i] for b in batches for _ in range(20)] for i in range(3))
    got = stats.compute()
    assert got["rollout_tokens"] == sum(int(m.sum()) for m in mask)
    assert_metrics_close(got, reference_metrics(rollout, old, mask))
    for histogram in extras.summary(extras.state).histograms.values():
        assert histogram.num == got["rollout_tokens"]
    # A copy or a pickle gets a lock of its own and the same window.
    assert pickle.loads(pickle.dumps(stats)).compute() == got
    copied = copy.deepcopy(stats)
    copied.update(*batches[0])
    assert stats.compute() == got


# ------------------------------------------------------------------ prepared ahead
def test_the_callback_builds_the_kernel_while_the_first_batch_is_made(
    fresh_kernel: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The build starts at the Trainer's setup, on a thread of its own.

    The first training step waits for the kernel, as a rollout being sampled would take
    its time: it finds the kernel loaded, though no update has run yet (without the early
    start the build would only begin at the first update, and this step would wait in
    vain). The updates then use it, and the logged window is exact.
    """
    lit = PYTORCH_LIGHTNING
    found: list[bool] = []

    class SlowFirstBatch(lit.RolloutModule):  # type: ignore[name-defined, misc]
        def training_step(self, batch: Any, batch_idx: int) -> Any:
            deadline = time.monotonic() + 300
            while not found and time.monotonic() < deadline:
                if native._kernel["function"] is not None or native._kernel["problem"]:
                    break
                time.sleep(0.05)
            found.append(native._kernel["function"] is not None)
            return super().training_step(batch, batch_idx)

    batches = make_batches(3, batch_size=4, width=9, seed=5)
    callback = RolloutDebugCallback(log_every_n_steps=3)
    passes: list[bool] = []
    original = native._pass

    def spy(*args: Any, **kwargs: Any) -> Any:
        done = original(*args, **kwargs)
        passes.append(done is not None)
        return done

    monkeypatch.setattr(native, "_pass", spy)
    trainer = lit.Trainer(
        max_steps=3,
        callbacks=[callback],
        logger=lit.loggers.CSVLogger(tmp_path),
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)  # no fallback to the torch path
        trainer.fit(SlowFirstBatch(batches))
    assert found[0], "the kernel was not ready at the first training step"
    assert sorted(path.suffix for path in fresh_kernel.glob("row_sums_*")) == [
        ".origin",
        ".sha256",
        ".so",
    ]
    assert passes == [True, True, True]  # every update went through the kernel
    want = reference_metrics(*([b[key] for b in batches] for key in BATCH_KEYS))
    logged = trainer.callback_metrics
    assert float(logged["training/rollout_tokens"]) == want["rollout_tokens"]
    got = float(logged["training/rollout_probs_diff_mean"])
    assert got == pytest.approx(want["rollout_probs_diff_mean"], rel=1e-6)


def test_a_problem_found_in_the_background_is_warned_by_the_first_update(
    fresh_kernel: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    blocker = tmp_path / "a-file"
    blocker.write_text("not a folder")
    monkeypatch.setenv(native.CACHE_ENV, str(blocker / "cache"))
    with warnings.catch_warnings(record=True) as on_the_thread:
        warnings.simplefilter("always")
        assert native.prepare()
        native._preparing["thread"].join(timeout=300)
    assert on_the_thread == []  # a thread's warning would reach no one who can act on it
    assert native._kernel["problem"] is not None and not native.prepare()
    rollout, old, mask = probe_batch()
    stats = MismatchStats()
    with pytest.warns(RuntimeWarning, match="cannot be created") as caught:
        stats.update(rollout, old, mask)
    assert len(caught) == 1 and caught[0].filename != native.__file__
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # said once
        stats.update(rollout, old, mask)
    assert_metrics_close(stats.compute(), reference_metrics([rollout] * 2, [old] * 2, [mask] * 2))


def test_a_kernel_turned_off_or_not_wanted_is_not_built_in_the_background(
    fresh_kernel: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    assert not backends.prepare_native(compile=False)  # the torch path only: nothing to build
    monkeypatch.setenv(native.SWITCH_ENV, "0")
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the user's choice: said nowhere
        assert native.prepare()  # it starts, and finds the kernel turned off
        native._preparing["thread"].join(timeout=300)
        assert not native.prepare() and not native.available()
    assert not fresh_kernel.exists()
