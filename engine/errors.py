"""Typed errors of the engine. The server returns ValidationError's message
verbatim as a 400 (with `param` naming the field); the offline API raises it."""

from __future__ import annotations


class ValidationError(ValueError):
    """Bad request parameters. `param` names the offending field (OpenAI's error body)."""

    def __init__(self, message: str, param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        self.code = code


class CheckpointError(ValueError):
    """A model directory that cannot be loaded; the message says what is wrong."""


class EngineDeadError(RuntimeError):
    """The engine loop has stopped; no request can be served."""
