"""The C++ compiler: which command may run, what it is, and running it apart.

:func:`command` is ``$CXX`` (programs only, as ``ccache g++``; no options) or the first
of ``c++``, ``g++`` and ``clang++`` on the trusted ``PATH`` (:mod:`.trust`);
:func:`identity` names the files of its programs, for the cache's key; :func:`link`
compiles a source given on the compiler's input into a shared library, through
:func:`run`: in a session and an environment of its own, in a private folder, killed
with everything it started on a timeout or an interruption.

Example:
    >>> identity(["/no/such/compiler"])
    [b'/no/such/compiler']
"""

from __future__ import annotations

import os
import shlex
import shutil
import signal
import subprocess
import tempfile
from collections.abc import Sequence
from contextlib import suppress
from pathlib import Path

from lightning_rollout_debug.native import trust
from lightning_rollout_debug.native.trust import KernelUnavailable

COMPILE_TIMEOUT_S = 300.0
"""A compiler that runs longer is killed, with everything it started."""


def command() -> list[str]:
    """The compiler command: ``$CXX`` (programs, as in ``ccache g++``), else the first found.

    Each program is looked up only in the ``PATH`` folders that no other user can write
    (:func:`trust.trusted_path`), and must itself be writable by nobody but its owner, the
    user or root (:func:`trust.trusted_program`). ``$CXX`` holds no options: the kernel's
    flags are its own, and an option such as ``-B`` or ``@file`` could name a folder
    that another user can write.
    """
    chosen = os.environ.get("CXX", "").strip()
    if not chosen:
        for name in ("c++", "g++", "clang++"):
            found = program(name)
            if found:
                return [found]
        raise KernelUnavailable(
            "no C++ compiler found in a folder of the PATH that only you or root can "
            "write; install one or set CXX"
        )
    fix = "set CXX to a C++ compiler command such as 'g++' or 'ccache g++'"
    try:
        words = shlex.split(chosen)
    except ValueError as error:
        raise KernelUnavailable(f"CXX={chosen!r} cannot be read ({error}); {fix}") from None
    command: list[str] = []
    for word in words:
        if word.startswith(("-", "@")) or "=" in word:
            raise KernelUnavailable(
                f"CXX={chosen!r}: {word!r} is not a program; CXX names the compiler and "
                f"any wrappers before it, without options (the kernel's flags are its own); "
                f"{fix}"
            )
        found = program(word)
        if not found:
            where = (
                f"{word} is missing, or other users can change it or a folder on its way"
                if os.sep in word
                else f"no {word} is in a folder of the PATH that only you or root can write"
            )
            raise KernelUnavailable(f"CXX={chosen!r}: {where}; {fix}")
        # The program itself, then as written: a wrapper finds the compiler it names.
        command.append(found if not command or os.sep in word else word)
    return command


def program(word: str) -> str | None:
    """The trusted program a command's ``word`` runs (a path, or a name on the PATH)."""
    if os.sep in word:
        return trust.trusted_program(word)
    found = shutil.which(word, path=os.pathsep.join(trust.trusted_path()))
    return found and trust.trusted_program(found)


def identity(command: Sequence[str]) -> list[bytes]:
    """What the programs of ``command`` are: each file's real path, size and time.

    An upgraded compiler (or a link pointed at another one) changes it.
    """
    parts = []
    for word in command:
        found = program(word)
        real = os.path.realpath(found) if found else word
        with suppress(OSError):
            info = os.stat(real)
            real = f"{real}:{info.st_size}:{info.st_mtime_ns}"
        parts.append(real.encode())
    return parts


def link(
    compiler: list[str], flags: Sequence[str], folder: Path, source: bytes, output: Path
) -> subprocess.CompletedProcess[str]:
    """Compile C++ ``source`` (given on the compiler's input) into the library ``output``."""
    return run([*compiler, *flags, "-x", "c++", "-", "-o", str(output)], folder, source)


def run(
    command: list[str], folder: Path, stdin: bytes | None = None
) -> subprocess.CompletedProcess[str]:
    """Run the compiler in a session of its own, in an environment of its own.

    Of the user's environment only ``HOME`` reaches it: its ``PATH`` (and
    ``LD_LIBRARY_PATH``, where a compiler module needs one) holds trusted folders only,
    it runs in a private folder inside the checked cache ``folder``, where its
    temporary files go too, and no variable names headers, programs or a compiler cache
    (``CPATH``, ``COMPILER_PATH``, ``CCACHE_DIR``, ...) that another user could write. On
    a timeout the whole session is killed, the programs the compiler started too.
    """
    with tempfile.TemporaryDirectory(prefix=".compiler-", dir=folder) as scratch:  # 0700
        libraries = trust.trusted_path("LD_LIBRARY_PATH", "")
        env = {
            "PATH": os.pathsep.join(trust.trusted_path()),
            "TMPDIR": scratch,
            "LC_ALL": "C",
            "CCACHE_DISABLE": "1",  # a wrapper such as ccache compiles, reads no cache
            **({"HOME": os.environ["HOME"]} if "HOME" in os.environ else {}),
            **({"LD_LIBRARY_PATH": os.pathsep.join(libraries)} if libraries else {}),
        }
        try:
            process = subprocess.Popen(
                command,
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                cwd=scratch,  # a relative name in what it is given means nothing outside
                env=env,
                start_new_session=True,
            )
        except OSError as error:
            name = shlex.join(command[:2])
            raise KernelUnavailable(f"{name} could not run ({error})") from error
        try:
            out, err = process.communicate(stdin, timeout=COMPILE_TIMEOUT_S)
        except subprocess.TimeoutExpired as error:
            _end_session(process)
            raise KernelUnavailable(
                f"{shlex.join(command[:2])} did not finish in {COMPILE_TIMEOUT_S:.0f} s"
            ) from error
        except BaseException:  # interrupted (Ctrl-C, a signal handler's SystemExit)
            _end_session(process)
            raise
    said = [part.decode(errors="replace") for part in (out, err)]
    return subprocess.CompletedProcess(command, process.returncode, *said)


def _end_session(process: subprocess.Popen[bytes]) -> None:
    """Kill the compiler's session (what it started too) while it runs, then reap it.

    Only while the compiler is not reaped: its process id, which names the session's
    group, cannot have been given to another process yet.
    """
    if process.returncode is None:
        with suppress(OSError):
            os.killpg(process.pid, signal.SIGKILL)
    for pipe in (process.stdin, process.stdout, process.stderr):
        if pipe is not None:
            with suppress(OSError):
                pipe.close()
    process.wait()
