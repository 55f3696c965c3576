"""Keep the model names a user gives inside the model folders they are looked up in.

A loader node receives a name relative to one of ComfyUI's model folders (models/diffusers, models/vae, ...). From
the node's dropdown it is one of the listed names; linked from another node it can be any string, so it is checked
here before anything on disk is touched:

- the name must be relative: no absolute path, no drive, no UNC share (on any OS: a workflow travels);
- no component may be `..`: lexically `a/../b` stays inside, but when `a` is a symlink the OS resolves `..` from the
  link's target, outside the folder, so normalising the name is not enough (ComfyUI's own lists never contain `..`);
- the name is joined to each configured folder, and the first existing match wins. Symlinks that live inside a model
  folder are followed, as ComfyUI does: linking a download folder into models/ is the user's choice.

A refused name gets one message whatever the path is: it never says whether something exists outside the folders.
This module is plain path logic (no ComfyUI imports), shared by the loader nodes and the pack's web routes.
"""

from __future__ import annotations

import ntpath
import os
import re
from typing import Iterable

from ..errors import InputError, KVGraphError

_ANY_SEPARATOR = re.compile(r"[\\/]")
_SEPARATOR = _ANY_SEPARATOR if os.sep == "\\" else re.compile("/")


class OutsideModelFolder(InputError):
    """A model name that would leave its model folder. The message names the input and the folder, never the path."""

    def __init__(self, input_name: str, folder: str):
        self.name, self.value, self.folder = input_name, None, folder
        self.expected = (f"a name inside ComfyUI's models/{folder} folder, relative to it (an absolute path or a "
                         "'..' is refused)")
        # Not InputError's message: that one repeats the value, and the value is the path this must not echo.
        KVGraphError.__init__(self, f"{input_name}: this name is refused: expected {self.expected}.")


def name_parts(name) -> tuple[str, ...] | None:
    """The components of a relative model name, or None when it is absolute, has a drive or a `..` component, or is
    not a plain string. Empty and `.` components are dropped (`a//b`, `./a` name the same file as ComfyUI's list).
    A backslash separates components on Windows only, but `..` between backslashes is refused everywhere."""
    if not isinstance(name, str) or "\x00" in name:
        return None
    if name.startswith(("/", "\\")) or ntpath.splitdrive(name)[0]:  # absolute, a drive or a UNC share
        return None
    if ".." in _ANY_SEPARATOR.split(name):
        return None
    return tuple(p for p in _SEPARATOR.split(name) if p not in ("", "."))


def find_in_folders(roots: Iterable[str | os.PathLike], name, *, input_name: str, folder: str,
                    directory: bool = False) -> str | None:
    """The first `root/name` that is an existing file (or, with `directory`, folder) under one of `roots`, or None
    when the name is inside but nothing matches. Raises OutsideModelFolder for a name that would leave the roots."""
    parts = name_parts(name)
    if parts is None:
        raise OutsideModelFolder(input_name, folder)
    exists = os.path.isdir if directory else os.path.isfile
    for root in roots:
        candidate = os.path.join(os.fspath(root), *parts)
        if exists(candidate):
            return candidate
    return None
