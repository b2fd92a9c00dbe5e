"""Trust: whether other users could change a file, and which programs may run.

The kernel cache (:mod:`.cache`) loads only what no other user can change, and its
compiler (:mod:`.toolchain`) runs only programs that no other user can change. Both
follow the rules here:

* a folder is open to others through its mode, a group another user belongs to, or an
  access control list (:func:`open_to_others`); a group-writable folder is closed only
  when its group is the user's own private group;
* a folder above a trusted file belongs to the user or root and is closed to others, or
  is sticky (:func:`above_problem`);
* a program is trusted when it, every link on the way to it and their folders are closed
  to others, and so is a script's ``#!`` interpreter (:func:`trusted_program`); it is
  looked up only in the absolute ``PATH`` folders closed to others (:func:`trusted_path`).

:class:`KernelUnavailable` is what the cache and the compiler raise where the kernel
cannot be had.

Example:
    >>> import sys
    >>> trusted_program(sys.executable) in (None, os.path.abspath(sys.executable))
    True
"""

from __future__ import annotations

import functools
import os
import stat
from pathlib import Path

_SCRIPT_DEPTH = 4  # interpreters of interpreters followed (as the kernel's own limit)


class KernelUnavailable(RuntimeError):
    """The kernel cannot be built or loaded here; the message says why and what to do."""


def trusted_path(variable: str = "PATH", default: str = os.defpath) -> list[str]:
    """The folders of ``$variable`` to take programs (or libraries) from.

    Those that are absolute and closed to other users (:func:`closed_folder`).
    """
    entries = []
    for entry in os.environ.get(variable, default).split(os.pathsep):
        if os.path.isabs(entry) and entry not in entries and closed_folder(Path(entry)):
            entries.append(entry)
    return entries


def trusted_program(program: str, depth: int = 0) -> str | None:
    """``program``'s absolute path if nobody but the user or root can change what it runs.

    The file it names and every link on the way there must sit in folders closed to
    others (:func:`closed_folder`), and the file must be writable by its owner alone; a
    script's interpreter (its ``#!`` line) must be trusted in the same way. The path
    itself is returned, links and all: a compiler wrapper such as ccache tells by the
    name it was called with which compiler it stands for.
    """
    current = Path(program).absolute()
    for _ in range(40):  # as the kernel's own limit on links followed
        if not closed_folder(current.parent):
            return None
        if not current.is_symlink():
            break
        current = current.parent / os.readlink(current)
    else:
        return None
    try:
        info = os.stat(current)
    except OSError:
        return None
    if (
        not stat.S_ISREG(info.st_mode)
        or info.st_uid not in (0, os.geteuid())
        or open_to_others(current, info)
    ):
        return None
    interpreter = _interpreter(current)
    if interpreter is not None and (
        depth >= _SCRIPT_DEPTH or not trusted_program(interpreter, depth + 1)
    ):
        return None
    return str(Path(program).absolute())


def _interpreter(path: Path) -> str | None:
    """The program a script's ``#!`` line names; ``None`` for a binary."""
    try:
        with open(path, "rb") as handle:
            head = handle.read(256)
    except OSError:  # not readable: no interpreter could read it either
        return None
    if not head.startswith(b"#!"):
        return None
    words = head[2:].split(b"\n", 1)[0].split()
    return os.fsdecode(words[0]) if words else ""


def closed_folder(folder: Path) -> bool:
    """Whether nobody but the user and root can add or replace a file in ``folder``.

    The folder itself must not be open to others at all (a sticky folder still lets
    them add files); the folders above it may be, when sticky.
    """
    try:
        real = Path(os.path.realpath(folder))
        info = os.stat(real)
        if info.st_uid not in (0, os.geteuid()) or open_to_others(real, info):
            return False
        return all(above_problem(parent) is None for parent in real.parents)
    except OSError:
        return False


def above_problem(folder: Path) -> str | None:
    """Why other users could change what is in ``folder``, a folder above a trusted file.

    ``None`` where it belongs to the user or root and no other user may write in it, or
    where it is sticky (as ``/tmp``): then nobody else can rename what is in it.
    """
    user = os.geteuid()
    info = os.stat(folder)
    if info.st_uid not in (0, user):
        return f"belongs to user {info.st_uid}, not to you ({user}) or root"
    if open_to_others(folder, info) and not info.st_mode & stat.S_ISVTX:
        acl = ", an access control list" if has_acl(folder) else ""
        return (
            f"is open to other users (group {info.st_gid}, mode {stat.filemode(info.st_mode)}{acl})"
        )
    return None


def open_to_others(path: Path, info: os.stat_result) -> bool:
    """Whether users other than this one may write in ``path`` (its mode, group, ACL).

    Group write is closed to others only for the user's own private group and without an
    access control list, whose named entries the mode's group bits do not show.
    """
    if info.st_mode & stat.S_IWOTH:
        return True
    if not info.st_mode & stat.S_IWGRP:
        return False  # the group bits bound every ACL entry but the owner's
    return _group_has_others(info.st_gid) or has_acl(path)


def has_acl(path: Path) -> bool:
    """Whether ``path`` has an access control list (whose entries its mode does not show)."""
    try:
        return "system.posix_acl_access" in os.listxattr(path)
    except (OSError, AttributeError):  # no extended attributes here (macOS has no listxattr)
        return False


@functools.cache
def _group_has_others(gid: int) -> bool:
    """Whether a user other than this one may belong to group ``gid``.

    A group-writable folder is closed to others only when its group is the user's own,
    as the private group of a user created with ``useradd`` (often with umask 002) is:
    named after the user, no other member, and the primary group of no other user. A
    group this process cannot look up counts as shared.
    """
    import grp  # POSIX only, as the kernel is
    import pwd

    user = os.geteuid()
    try:
        group = grp.getgrgid(gid)
        name = pwd.getpwuid(user).pw_name
    except KeyError:
        return True
    if group.gr_name != name or any(member != name for member in group.gr_mem):
        return True
    return any(entry.pw_gid == gid and entry.pw_uid != user for entry in pwd.getpwall())
