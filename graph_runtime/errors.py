"""Errors a user can act on: each names the input at fault and what was expected."""

from __future__ import annotations

import os


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
        message = f"{self.path}: {problem}"
        if expected:
            message += f" Expected {expected}."
        super().__init__(message)


class InputError(KVGraphError):
    """A generation argument outside what the model accepts (size, steps, sigmas, images...)."""

    def __init__(self, name: str, value, expected: str):
        self.name, self.value, self.expected = name, value, expected
        super().__init__(f"{name}={value!r} is invalid: expected {expected}.")


class NonFiniteError(KVGraphError):
    """A run produced NaN or infinite values from finite inputs: the message names the step and the likely cause, so a
    black or unchanged image is never reported as a success."""

    def __init__(self, what: str, cause: str):
        self.what, self.cause = what, cause
        super().__init__(f"{what} holds NaN or infinite values: {cause}.")
