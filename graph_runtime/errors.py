"""Errors a user can act on: each names the input at fault and what was expected."""

from __future__ import annotations

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


class KVGraphError(ValueError):
    """Base class for every error the runtime raises about its inputs."""


class CheckpointError(KVGraphError):
    """A model file or folder that cannot be loaded as the component it was given as.

    The message always starts with the path, so a user reading a ComfyUI error toast knows which file to replace.
    """

    def __init__(self, path: str | os.PathLike, problem: str, expected: str | None = None):
        self.path = os.fspath(path)
        self.problem = problem
        self.expected = expected
        message = f"{shorten(self.path)}: {problem}"
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
