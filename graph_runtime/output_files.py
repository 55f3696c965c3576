"""Writing the command line's outputs without losing what was there.

Every target is checked before any model runs (its folder can be made and written to, its name fits, an existing
file is replaced only when asked), and each file is written to a temporary file beside it and renamed over the
target only once it is complete: a full disk or a failed write leaves the old file as it was and no partial file.
`write_new_file` is the same for a file that must get a name no file has yet (ComfyUI's numbered outputs).
"""

from __future__ import annotations

import errno
import os
import secrets
from pathlib import Path
from typing import BinaryIO, Callable, Iterable

from .errors import InputError, OutputWriteError
from .png_writer import COMFYUI_COMPRESS_LEVEL, write_png

# The temporary file's own name: short, so any name that fits the folder's limit also leaves room for it.
TEMP_PREFIX = ".kvgraph-"
TEMP_SUFFIX = ".partial"


def _existing_ancestor(path: Path) -> Path:
    """The nearest part of `path`'s folder chain that exists (the folders below it are made when writing)."""
    parent = path.parent
    while not os.path.lexists(parent) and parent != parent.parent:
        parent = parent.parent
    return parent


def _name_max(folder: Path) -> int:
    try:
        return os.pathconf(folder, "PC_NAME_MAX")
    except (OSError, ValueError, AttributeError):  # no pathconf (Windows) or no answer: the common limit
        return 255


def check_target(flag: str, path: str | os.PathLike, overwrite: bool, replace_hint: str,
                 folder: bool = False) -> None:
    """Refuse, naming `flag`, a target that cannot be written: a folder in the place of a file (a file in the place
    of a `folder`), a file in the place of one of its parent folders, a folder that is not writable, a name too long
    for its file system, or an existing file when not `overwrite` (`replace_hint` says how to allow it)."""
    target = Path(os.path.abspath(os.path.expanduser(os.fspath(path))))
    shown = os.fspath(path)
    ancestor = _existing_ancestor(target)
    if not os.path.isdir(ancestor):
        raise InputError(flag, shown, f"a path inside a folder: {ancestor} is a file")
    limit = _name_max(ancestor)
    for part in target.relative_to(ancestor).parts:
        if len(os.fsencode(part)) > limit:
            raise InputError(flag, shown, f"names of at most {limit} bytes ({part[:40]}... has "
                                          f"{len(os.fsencode(part))})")
    if folder and os.path.lexists(target) and not os.path.isdir(target):
        raise InputError(flag, shown, "a folder, not a file")
    if not folder and os.path.isdir(target):
        raise InputError(flag, shown, "a file name, not a folder")
    writable = target if folder and os.path.isdir(target) else ancestor
    if not os.access(writable, os.W_OK | os.X_OK):
        raise InputError(flag, shown, f"a path in a folder you can write to: {writable} is not writable")
    if os.path.lexists(target) and not overwrite and not folder:
        raise InputError(flag, shown, f"a file that does not exist yet: it would be replaced ({replace_hint})")


def _write_temp(folder: Path, write: Callable[[BinaryIO], None]) -> Path:
    """`write(file)` into a new hidden file in `folder` (made if missing), flushed to disk; returns its path. On any
    failure (an OSError, an encoder's error, Ctrl-C, SIGTERM) the file is removed and the error raised."""
    temp = folder / f"{TEMP_PREFIX}{secrets.token_hex(4)}{TEMP_SUFFIX}"
    try:
        folder.mkdir(parents=True, exist_ok=True)
        # O_EXCL: a name collision fails rather than writing into someone's file; 0o666 lets the umask decide the
        # mode, as for any file the user creates.
        fd = os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_BINARY", 0), 0o666)
        with os.fdopen(fd, "wb") as file:
            write(file)
            file.flush()
            os.fsync(file.fileno())
    except BaseException:
        _remove_quietly(temp)
        raise
    return temp


def _write_error(exc: OSError, target: Path, existed: bool) -> OutputWriteError:
    kept = "the existing file is unchanged" if existed else "nothing was written"
    reason = (exc.strerror or os.strerror(exc.errno)) if exc.errno else str(exc)
    if exc.errno == errno.ENOSPC:
        reason = "the disk is full"
    return OutputWriteError(target, f"{reason} ({kept})")


def _absolute(path: str | os.PathLike) -> Path:
    return Path(os.path.abspath(os.path.expanduser(os.fspath(path))))


def write_atomically(path: str | os.PathLike, write: Callable[[BinaryIO], None]) -> None:
    """`write(file)` into a new file beside `path`, then rename it over `path`: the target is never seen half
    written. On any failure the temporary file is removed and OutputWriteError names `path` (an existing file is
    left as it was)."""
    target = _absolute(path)
    existed = os.path.lexists(target)
    temp = None
    try:
        temp = _write_temp(target.parent, write)
        os.replace(temp, target)
    except OSError as exc:
        if temp is not None:
            _remove_quietly(temp)
        raise _write_error(exc, target, existed) from None


# Where a file system has no hard links, a new name is given by rename after checking it is free.
_NO_HARD_LINKS = {errno.EPERM, errno.EACCES, errno.EXDEV, errno.EMLINK, errno.ENOSYS,
                  getattr(errno, "ENOTSUP", errno.EPERM), getattr(errno, "EOPNOTSUPP", errno.EPERM)}


def _take_name(temp: Path, target: Path) -> bool:
    """Give the complete file `temp` the name `target` unless a file has that name: True when done. A hard link
    fails on an existing name, so nothing is ever replaced, not even by a writer racing this one."""
    try:
        os.link(temp, target)
    except FileExistsError:
        return False
    except OSError as exc:
        if exc.errno not in _NO_HARD_LINKS:
            raise
        if os.path.lexists(target):
            return False
        os.rename(temp, target)  # Windows refuses an existing target; elsewhere the check above guards it
        return True
    _remove_quietly(temp)
    return True


def write_new_file(paths: Iterable[str | os.PathLike], write: Callable[[BinaryIO], None]) -> Path:
    """`write(file)` into a temporary file beside the first of `paths`, which then takes the first of `paths` (all
    in one folder) that no file has: an existing file is never replaced, and no name is ever seen half written.
    Returns the name taken. On any failure the temporary file is removed and OutputWriteError names the path."""
    paths = iter(paths)
    target = _absolute(next(paths))
    temp = None
    try:
        temp = _write_temp(target.parent, write)
        while not _take_name(temp, target):
            target = _absolute(next(paths))
        return target
    except OSError as exc:
        raise _write_error(exc, target, False) from None
    finally:
        if temp is not None:
            _remove_quietly(temp)  # already gone once a name was taken


def save_image(file: BinaryIO, image, image_format: str) -> None:
    """`image` in PIL format name `image_format` into the open binary `file`: PNG through the threaded writer at
    ComfyUI's SaveImage compression level (a file the command line writes is compressed as a ComfyUI workflow saves
    it); other formats through PIL with its defaults."""
    if image_format == "PNG":
        write_png(file, image, COMFYUI_COMPRESS_LEVEL)
    else:
        image.save(file, format=image_format)


def _remove_quietly(path: Path) -> None:
    try:
        os.unlink(path)
    except OSError:
        pass
