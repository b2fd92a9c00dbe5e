"""The native kernel's cache: built once per machine and user, checked before it is loaded.

The cache is the user's own:

* it lives in :func:`cache_folder`: ``$LIGHTNING_ROLLOUT_DEBUG_CACHE``, else
  ``$XDG_CACHE_HOME/lightning-rollout-debug``, else ``~/.cache/lightning-rollout-debug``,
  created with mode 0700;
* the folder and every file read from it must belong to the current user and be
  writable by nobody else, and no folder above it may be open to other users, through
  its mode, a group with another member or an access control list (unless sticky, as
  ``/tmp`` is): the rules of :mod:`.trust`;
* a library is loaded only when its bytes match the SHA-256 digest written beside it
  after a successful build; anything else is rebuilt, never loaded;
* the compiler (and any wrapper named before it, as ``ccache``) comes only from
  folders no other user can write, as does a script's interpreter, and runs with a
  ``PATH`` of such folders only, on the very source bytes the key was made from
  (:mod:`.toolchain`);
* one build at a time (a lock in the folder, waited for at most ``_LOCK_WAIT_S``), into
  a unique temporary name that is renamed into place; a compiler that hangs, or whose
  build is interrupted (Ctrl-C, a signal handler's ``SystemExit``), is killed with
  everything it started.

A build's name is keyed by the source, the compiler command and the files it names
(an upgraded compiler builds anew), the flags and the CPU (``-march=native`` depends on
it, and is left out where the CPU cannot be told). Beside it, before the digest, an
origin record (``row_sums_<key>.origin``) holds a portable key, of the source and the
CPU alone, and the flags: where no compiler is left (an image that removed its build
tools after prebuilding) or ``$CXX`` is refused, a verified library of the same source
and CPU is used, by the flag sets' order, then the newest. Libraries without the record
(built by an earlier version) are used only where their compiler is, and then get one.
:func:`verified_build` returns the path of a verified library, found or built;
:mod:`lightning_rollout_debug.native` loads and checks it.

Example:
    >>> cache_folder().is_absolute()
    True
"""

from __future__ import annotations

import hashlib
import logging
import os
import platform
import shlex
import shutil
import stat
import tempfile
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager, suppress
from pathlib import Path

from lightning_rollout_debug.native import toolchain, trust
from lightning_rollout_debug.native.trust import KernelUnavailable

__all__ = [
    "CACHE_ENV",
    "SOURCE",
    "SWITCH_ENV",
    "KernelUnavailable",
    "cache_folder",
    "verified_build",
]

SOURCE = Path(__file__).with_name("row_sums.cpp")
"""The kernel's source, beside this module."""
CACHE_ENV = "LIGHTNING_ROLLOUT_DEBUG_CACHE"
"""Environment variable naming the cache folder (overrides the XDG location)."""
SWITCH_ENV = "LIGHTNING_ROLLOUT_DEBUG_NATIVE"
"""Environment variable: ``0`` (or ``false``, ``off``, ``no``) turns the kernel off."""

_FLAGS = (
    "-O3",
    "-fno-trapping-math",  # lets selects on floats vectorise; results are unchanged
    "-fno-math-errno",
    "-ffp-contract=fast",  # fused multiply-adds: one rounding instead of two
    "-std=c++17",
    "-shared",
    "-fPIC",
    "-pthread",
)
# Some compilers lack -march=native or OpenMP; the kernel then does without.
_FLAG_SETS = (
    ("-march=native", "-fopenmp", *_FLAGS),
    ("-fopenmp", *_FLAGS),
    ("-march=native", *_FLAGS),
    _FLAGS,
)
_PROBE_SOURCE = 'extern "C" int rollout_probe() { return 0; }\n'
_PROBE_BYTES = 8 << 20  # more than a build's temporary files and library (about 2.5 MB)
_RECORD_BYTES = 128  # a digest record is 65 bytes; more is not a record
_ORIGIN = ".origin"  # beside a library: what it was built from (see _origin)
_ORIGIN_BYTES = 1024  # an origin record is about 140 bytes; more is not a record
_LOCK_WAIT_S = 600.0  # longer than any build takes: a lock held longer is stuck
_LEFTOVER_AGE_S = _LOCK_WAIT_S + toolchain.COMPILE_TIMEOUT_S  # older partial files: a killed build

_LOG = logging.getLogger(__package__)  # the package's logger: lightning_rollout_debug.native
_LOG.setLevel(logging.INFO)
if not logging.getLogger().hasHandlers():  # as Lightning does: say it unless told otherwise
    _LOG.addHandler(logging.StreamHandler())
    _LOG.propagate = False


def cache_folder() -> Path:
    """Where the kernel is cached: the user's own folder, never a shared temporary one.

    ``$LIGHTNING_ROLLOUT_DEBUG_CACHE`` if set, else ``$XDG_CACHE_HOME/lightning-rollout-debug``
    (for an absolute ``$XDG_CACHE_HOME``), else ``~/.cache/lightning-rollout-debug``.

    Example:
        >>> folder = cache_folder()
        >>> folder.is_absolute(), folder == Path(os.environ.get(CACHE_ENV) or folder)
        (True, True)
    """
    chosen = os.environ.get(CACHE_ENV, "")
    if chosen:
        return Path(chosen).expanduser().absolute()
    xdg = os.environ.get("XDG_CACHE_HOME", "")
    if os.path.isabs(xdg):
        return Path(xdg) / "lightning-rollout-debug"
    home = Path.home()
    if not home.is_absolute():  # a relative HOME would put the cache wherever one runs
        raise RuntimeError(f"the home folder {str(home)!r} is not an absolute path")
    return home / ".cache" / "lightning-rollout-debug"


# ----------------------------------------------------------------- building
def verified_build() -> Path:
    """A verified kernel in the cache folder: found there, or built now.

    Raises:
        KernelUnavailable: it can be neither found nor built here; the message says why.
    """
    try:
        return _find_or_build()
    except OSError as error:  # a read-only or vanished folder, a file system error
        raise KernelUnavailable(
            f"the kernel cache cannot be used ({error}); set {CACHE_ENV} to a folder of "
            f"your own, or {SWITCH_ENV}=0"
        ) from error


def _find_or_build() -> Path:
    source = SOURCE.read_bytes()  # read once: the key and the compiler see these bytes
    cpu = _cpu_signature()
    # A CPU that cannot be told apart from others gets no -march=native build.
    flag_sets = [flags for flags in _FLAG_SETS if cpu or "-march=native" not in flags]
    try:
        compiler = toolchain.command()
    except KernelUnavailable as missing:  # no compiler left: a kernel built before, if any
        return _prebuilt(source, cpu, flag_sets, missing)
    folder = _private_folder()
    compiled_by = toolchain.identity(compiler)
    targets = [
        folder / f"row_sums_{_key(source, compiler, compiled_by, flags, cpu)}.so"
        for flags in flag_sets
    ]
    found = _first_verified(targets)
    if found is None:
        with _folder_lock(folder):  # concurrent processes: one builds, the others wait
            found = _first_verified(targets)
            if found is None:
                _remove_leftovers(folder)
                _check_writable(folder)
                problem = ""
                for flags, target in zip(flag_sets, targets, strict=True):
                    problem = _probe_problem(compiler, flags, folder)
                    if not problem:
                        return _compile(compiler, flags, folder, target, source, cpu)
                raise KernelUnavailable(
                    f"{shlex.join(compiler)} builds no shared library here ({problem})"
                )
    # A build of an earlier version has no origin record: it gets one, where it can.
    _note_origin(found, source, cpu, flag_sets[targets.index(found)])
    return found


def _prebuilt(
    source: bytes, cpu: bytes, flag_sets: Sequence[Sequence[str]], missing: KernelUnavailable
) -> Path:
    """A verified library built from ``source`` for this CPU, by whichever compiler.

    For a machine whose compiler is gone (an image that removed its build tools after
    prebuilding): the origin records (:func:`_origin`) name the source and the CPU each
    library was built for. Of those that match, the first flag set of ``flag_sets`` wins,
    then the newest library; each is checked as any library is (:func:`_verified`).

    Raises:
        KernelUnavailable: none matches; the message is ``missing``'s and says what to do.
    """
    try:
        where = cache_folder()
    except RuntimeError:  # no home folder: nothing prebuilt to be found
        raise missing from None
    if os.path.lexists(where):
        try:
            found = _first_prebuilt(source, cpu, flag_sets)
        except KernelUnavailable as refused:  # the folder or a file is open to others
            raise KernelUnavailable(f"{missing}; nor is the cache usable: {refused}") from None
        if found is not None:
            return found
    raise KernelUnavailable(
        f"{missing}; nor is a kernel built from this source for this CPU in {where}: "
        "build one there with `python -m lightning_rollout_debug.native` where a compiler "
        f"is (on this kind of CPU), or turn the kernel off with {SWITCH_ENV}=0"
    ) from None


def _first_prebuilt(source: bytes, cpu: bytes, flag_sets: Sequence[Sequence[str]]) -> Path | None:
    """The verified library of the cache that :func:`_prebuilt` takes; ``None`` if none."""
    folder = _private_folder()
    wanted = _portable_key(source, cpu)
    ranked = []
    for record in folder.glob(f"row_sums_*{_ORIGIN}"):
        flags = _origin_flags(record, wanted)
        if flags is None or flags not in flag_sets:
            continue  # another source, CPU or flag set: never loaded here
        target = record.with_suffix(".so")
        with suppress(OSError):
            newest_first = -target.lstat().st_mtime_ns
            ranked.append((flag_sets.index(flags), newest_first, target.name, target))
    for *_, target in sorted(ranked):
        if _verified(target):
            return target
    return None


def _first_verified(targets: Sequence[Path]) -> Path | None:
    """The first target that is complete (its digest matches); ``None`` if none is."""
    for target in targets:
        if os.path.lexists(target) and _verified(target):
            return target
    return None


def _verified(target: Path) -> bool:
    """Whether ``target`` is safe to load: the user's own, and its digest matches.

    Raises:
        KernelUnavailable: the file or its digest is open to other users.
    """
    record = _record(target)
    for path in (target, record):
        if os.path.lexists(path):
            _check_private(path, folder=False)
    try:
        with open(record, "rb") as handle:
            expected = handle.read(_RECORD_BYTES).strip()
    except OSError:
        return False  # not (yet) finished by a build: rebuilt, never loaded
    # Anything but the digest itself (damaged, binary, oversized) means a rebuild.
    return hashlib.sha256(target.read_bytes()).hexdigest().encode() == expected


def _record(target: Path) -> Path:
    return target.with_suffix(".sha256")


def _compile(
    compiler: list[str],
    flags: Sequence[str],
    folder: Path,
    target: Path,
    source: bytes,
    cpu: bytes,
) -> Path:
    """Build ``source`` (handed to the compiler on its input) into ``target``."""
    _LOG.info("lightning_rollout_debug: building the native CPU kernel into %s", folder)
    started = time.perf_counter()
    with _temporary(folder, ".so") as partial:
        result = toolchain.link(compiler, flags, folder, source, partial)
        if result.returncode != 0:
            raise KernelUnavailable(
                f"{shlex.join(compiler)} failed: {result.stderr.strip()[-2000:]}"
            )
        os.chmod(partial, 0o700)  # whatever the umask: writable by the user alone
        digest = hashlib.sha256(partial.read_bytes()).hexdigest()
        _fsync(partial)
        os.replace(partial, target)
    _write_record(folder, target.with_suffix(_ORIGIN), _origin(source, cpu, flags))
    _write_record(folder, _record(target), digest + "\n")  # last: it marks a whole build
    _LOG.info(
        "lightning_rollout_debug: built the native CPU kernel in %.1f s: %s",
        time.perf_counter() - started,
        target,
    )
    return target


def _write_record(folder: Path, path: Path, text: str) -> None:
    """Write ``text`` to ``path`` whole or not at all (a temporary file renamed into place)."""
    with _temporary(folder, path.suffix) as partial:  # mode 0600
        partial.write_text(text)
        _fsync(partial)
        os.replace(partial, path)


def _portable_key(source: bytes, cpu: bytes) -> str:
    """What a library is built from whatever the compiler: the source and the CPU."""
    parts = [hashlib.sha256(source).digest(), cpu, platform.machine().encode()]
    return hashlib.sha256(b"\0".join(parts)).hexdigest()[:24]


def _origin(source: bytes, cpu: bytes, flags: Sequence[str]) -> str:
    """The origin record of a library: its portable key, then its flags."""
    return f"{_portable_key(source, cpu)}\n{' '.join(flags)}\n"


def _origin_flags(record: Path, wanted: str) -> tuple[str, ...] | None:
    """The flags an origin record names if its portable key is ``wanted``, else ``None``.

    Raises:
        KernelUnavailable: the record matches, but is open to other users.
    """
    try:
        handle = os.open(record, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError:
        return None
    try:
        if not stat.S_ISREG(os.fstat(handle).st_mode):
            return None
        text = os.read(handle, _ORIGIN_BYTES + 1)
    except OSError:
        return None
    finally:
        os.close(handle)
    lines = text.decode(errors="replace").split("\n")
    if len(text) > _ORIGIN_BYTES or len(lines) != 3 or lines[0] != wanted or lines[2]:
        return None
    _check_private(record, folder=False)  # what it says counts from the user alone
    return tuple(lines[1].split())


def _note_origin(target: Path, source: bytes, cpu: bytes, flags: Sequence[str]) -> None:
    """Give the verified ``target`` its origin record if it lacks it (an earlier version's).

    Its name is its key, which holds the source and the CPU: the record says no more. A
    folder that cannot be written (an image's) keeps the library as it is.
    """
    record = target.with_suffix(_ORIGIN)
    with suppress(OSError, KernelUnavailable):  # a damaged or open record is replaced
        if _origin_flags(record, _portable_key(source, cpu)) == tuple(flags):
            return
    with suppress(OSError):
        _write_record(target.parent, record, _origin(source, cpu, flags))


def _probe_problem(compiler: list[str], flags: Sequence[str], folder: Path) -> str:
    """Why ``compiler`` links no trivial library with ``flags``: ``""`` if it does.

    A fraction of a second; the problem is the end of what the compiler said.
    """
    with _temporary(folder, ".so") as probe:
        result = toolchain.link(compiler, flags, folder, _PROBE_SOURCE.encode(), probe)
    if result.returncode == 0:
        return ""
    said = " ".join(result.stderr.split())
    return said[-500:] or f"exit status {result.returncode}"


@contextmanager
def _temporary(folder: Path, suffix: str) -> Iterator[Path]:
    """A fresh file name in ``folder``, unique to this call; removed unless renamed away."""
    handle, name = tempfile.mkstemp(prefix=".partial-", suffix=suffix, dir=folder)
    os.close(handle)
    path = Path(name)
    try:
        yield path
    finally:
        path.unlink(missing_ok=True)


def _fsync(path: Path) -> None:
    with open(path, "rb+") as handle:
        os.fsync(handle.fileno())


@contextmanager
def _folder_lock(folder: Path) -> Iterator[None]:
    """Hold ``build.lock`` in ``folder``: one build at a time for every process here.

    Where the file system cannot lock (some network file systems), builds go on without:
    unique temporary names and atomic renames keep concurrent builds correct, only
    repeated.
    """
    import fcntl  # POSIX only, as the kernel is

    lock = folder / "build.lock"
    handle = os.open(lock, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o600)
    try:
        _check_private(lock, folder=False)
        deadline = time.monotonic() + _LOCK_WAIT_S
        while True:
            try:
                fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:  # another process builds: wait for it, not forever
                if time.monotonic() > deadline:
                    raise KernelUnavailable(
                        f"{lock} has been held by another process for {_LOCK_WAIT_S:.0f} s; "
                        "a build that takes this long is stuck: end that process or remove "
                        f"{folder}"
                    ) from None
                time.sleep(0.05)
            except OSError:
                break  # no locking on this file system
        yield
    finally:
        os.close(handle)  # releases the lock


def _remove_leftovers(folder: Path) -> None:
    """Remove the partial files and compiler folders of builds killed long ago."""
    old = time.time() - _LEFTOVER_AGE_S
    for path in folder.glob(".*"):
        with suppress(OSError):
            info = path.lstat()
            if info.st_mtime > old:
                continue
            if path.name.startswith(".partial-") and stat.S_ISREG(info.st_mode):
                path.unlink()
            elif path.name.startswith(".compiler-") and stat.S_ISDIR(info.st_mode):
                shutil.rmtree(path)


def _check_writable(folder: Path) -> None:
    """Write (and remove) a file of a kernel's size first: a full disk fails here, at once."""
    try:
        with _temporary(folder, ".probe") as probe, open(probe, "wb") as handle:
            handle.write(bytes(_PROBE_BYTES))
            handle.flush()
            os.fsync(handle.fileno())
    except OSError as error:
        raise KernelUnavailable(
            f"the cache folder {folder} is not writable ({error.strerror or error}); set "
            f"{CACHE_ENV} to a folder of your own, or {SWITCH_ENV}=0"
        ) from error


def _key(
    source: bytes,
    compiler: Sequence[str],
    compiled_by: Sequence[bytes],
    flags: Sequence[str],
    cpu: bytes,
) -> str:
    words = [*map(str.encode, compiler), *compiled_by, *map(str.encode, flags)]
    parts = [source, *words, cpu, platform.machine().encode()]
    return hashlib.sha256(b"\0".join(parts)).hexdigest()[:24]


def _cpu_signature() -> bytes:
    """What ``-march=native`` depends on: the CPU's model and feature flags.

    Empty where ``/proc/cpuinfo`` cannot tell them (macOS, a container that hides it).
    """
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        lines = []
    wanted = [line for line in lines if line.startswith(("model name", "flags", "Features"))]
    return "\n".join(sorted(set(wanted))).encode()


# ------------------------------------------------------------------ trust
def _private_folder() -> Path:
    """The cache folder, created with mode 0700, once it is shown to be the user's alone."""
    try:
        folder = cache_folder()
    except RuntimeError as error:  # no home folder to be found
        raise KernelUnavailable(f"{error}; set {CACHE_ENV} to a folder of your own") from error
    try:
        # Nothing is made inside a folder that is not the user's or root's alone.
        existing = next(path for path in [folder, *folder.parents] if os.path.lexists(path))
        if existing != folder:
            real = Path(os.path.realpath(existing))
            for above in (real, *real.parents):
                _check_above(above)
        # Each missing folder with mode 0700, as XDG asks (a parent made by mkdir's
        # `parents` would take the umask's mode, 0777 under umask 000).
        for missing in reversed([folder, *folder.parents]):
            if not os.path.lexists(missing):
                with suppress(FileExistsError):
                    missing.mkdir(mode=0o700)
    except OSError as error:
        raise KernelUnavailable(
            f"the cache folder {folder} cannot be created ({error.strerror or error}); set "
            f"{CACHE_ENV} to a folder of your own, or {SWITCH_ENV}=0"
        ) from error
    # From here on the resolved folder: a link on the way, checked now, cannot be
    # pointed elsewhere between the checks and the load.
    real = Path(os.path.realpath(folder))
    _check_private(real, folder=True)
    return real


def _check_private(path: Path, *, folder: bool) -> None:
    """Raise unless ``path`` and every folder above it are closed to other users.

    ``path`` itself (no link) must belong to the current user and be writable by nobody
    else. A folder above it must belong to the user or to root, and may be writable by
    other users (:func:`trust.open_to_others`: its mode, a group with another member, an
    access control list) only when sticky (as ``/tmp``): then nobody else can rename
    what is in it.
    """
    user = os.geteuid()
    info = os.lstat(path)
    kind = stat.S_ISDIR if folder else stat.S_ISREG
    problem = None
    if not kind(info.st_mode):
        problem = f"is not a {'folder' if folder else 'regular file'}"
    elif info.st_uid != user:
        problem = f"belongs to user {info.st_uid}, not to you ({user})"
    elif info.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        problem = f"is writable by other users (mode {stat.filemode(info.st_mode)})"
    if problem is not None:
        where = path if folder else path.parent
        raise KernelUnavailable(
            f"{path} {problem}, so it is not trusted; remove {where} (it is rebuilt as a "
            f"folder of mode 0700) or set {CACHE_ENV} to a folder of your own"
        )
    _check_parents(Path(os.path.realpath(path)))


def _check_parents(path: Path) -> None:
    """Raise unless every folder above ``path`` is the user's or root's, closed to others.

    A folder above may be open to others when sticky: they cannot rename what is in it.
    """
    for parent in path.parents:
        _check_above(parent)


def _check_above(folder: Path) -> None:
    """Raise unless ``folder``, above the cache, is the user's or root's, closed to others."""
    problem = trust.above_problem(folder)
    if problem is not None:
        raise KernelUnavailable(
            f"{folder}, above the cache folder, {problem}; set {CACHE_ENV} to a folder of your own"
        )
