"""Errors a user can act on: each names the input at fault and what was expected."""

from __future__ import annotations

import logging
import os

# Values and paths echoed in a message are cut to about this many characters: a linked input or a file name can be
# any length, and a message that repeats 5,000 characters hides what it says.
ECHO_LIMIT = 200


def shorten(text: str, limit: int = ECHO_LIMIT) -> str:
    """`text` as is when short; else its start and end around an ellipsis, with the full length, so that both a
    value's beginning and a path's file name stay readable."""
    if len(text) <= limit:
        return text
    head = limit * 2 // 3
    return f"{text[:head]}...{text[-(limit - head):]} ({len(text)} characters)"


def printable(text: str) -> str:
    """`text` with every character that cannot be written as UTF-8 shown as an escape: a lone surrogate from a JSON
    `\\ud800` escape as `\\ud800`, and a byte of a file name that is not UTF-8 (which Python holds as a surrogate
    from U+DC80 to U+DCFF) as `\\xff`. ComfyUI writes its log through a strict UTF-8 stream: a message holding such
    a character cannot be written, and the prompt worker that tried dies with it."""
    try:
        text.encode("utf-8")
        return text
    except UnicodeEncodeError:
        pass
    out = []
    for char in text:
        code = ord(char)
        if 0xDC80 <= code <= 0xDCFF:
            out.append(f"\\x{code - 0xDC00:02x}")
        elif 0xD800 <= code <= 0xDFFF:
            out.append(f"\\u{code:04x}")
        else:
            out.append(char)
    return "".join(out)


def describe_name(name) -> str:
    """A file name, path or other user-given text as an error message quotes it: printable and `shorten`ed."""
    return shorten(printable(os.fsdecode(name) if isinstance(name, (bytes, os.PathLike)) else str(name)))


class KVGraphError(ValueError):
    """Base class for every error the runtime raises about its inputs. Its message is made `printable`, whatever a
    subclass put in it, so no error of the pack can stop ComfyUI's prompt worker."""

    def __init__(self, *args):
        super().__init__(*(printable(a) if isinstance(a, str) else a for a in args))


class CheckpointError(KVGraphError):
    """A model file or folder that cannot be loaded as the component it was given as.

    The message always starts with the path, so a user reading a ComfyUI error toast knows which file to replace.
    """

    def __init__(self, path: str | os.PathLike, problem: str, expected: str | None = None):
        self.path = os.fspath(path)
        self.problem = problem
        self.expected = expected
        message = f"{describe_name(self.path)}: {problem}"
        if expected:
            message += f" Expected {expected}."
        super().__init__(message)


class InputError(KVGraphError):
    """A generation argument outside what the model accepts (size, steps, sigmas, images...)."""

    def __init__(self, name: str, value, expected: str):
        self.name, self.value, self.expected = name, value, expected
        super().__init__(f"{name}={shorten(repr(value))} is invalid: expected {expected}.")


class NonFiniteError(KVGraphError):
    """A run produced NaN or infinite values from finite inputs: the message names the step and the likely cause, so a
    black or unchanged image is never reported as a success."""

    def __init__(self, what: str, cause: str):
        self.what, self.cause = what, cause
        super().__init__(f"{what} holds NaN or infinite values: {cause}.")


class FlatOutputError(KVGraphError):
    """A decode produced an image of one flat colour from a latent that was checked: the message names the likely
    cause, so a grey or black square is never reported as a success."""

    def __init__(self, what: str, cause: str):
        self.what, self.cause = what, cause
        super().__init__(f"{what} is one flat colour: {cause}.")


class DependencyError(KVGraphError):
    """A feature that needs a newer version of a library than the one installed: names both versions and what to do
    instead."""


class OutputWriteError(KVGraphError):
    """A file the command line was asked to write could not be written; the message says what was kept."""

    def __init__(self, path: str | os.PathLike, problem: str):
        self.path, self.problem = os.fspath(path), problem
        super().__init__(f"{self.path} could not be written: {problem}.")


class PrintableRecords(logging.Filter):
    """Makes the pack's log lines `printable` (a loaded file's path may hold bytes that are not UTF-8)."""

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        if printable(message) is not message:
            record.msg, record.args = printable(message), ()
        return True


def _install_log_filter() -> None:
    logger = logging.getLogger("kvgraph")
    # Once per process, though tests load the pack more than once (each copy has its own class).
    if not any(type(f).__name__ == PrintableRecords.__name__ for f in logger.filters):
        logger.addFilter(PrintableRecords())


_install_log_filter()
