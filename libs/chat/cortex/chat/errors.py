"""The library's exceptions: every one is a client error (the engines answer HTTP 400)."""

from __future__ import annotations

__all__ = ["ChatError", "InvalidChatRequest", "TemplateError", "UnmodelledRequest"]


class ChatError(ValueError):
    """A chat request the engine would reject. ``param`` names the offending request field.

    Callers (the gateway, the simulated engine) answer it with a 400 and ``str(exc)``.
    """

    def __init__(self, message: str, param: str = "messages") -> None:
        super().__init__(message)
        self.param = param

    def __reduce__(self) -> tuple[type[ChatError], tuple[str, str]]:
        # keeps ``param`` across processes (the gateway renders huge requests in workers)
        return type(self), (str(self), self.param)


class InvalidChatRequest(ChatError):
    """The request body has a field of the wrong shape (``messages``, ``tools``, flags...)."""


class TemplateError(ChatError):
    """The chat template could not render these messages (``raise_exception``, bad types)."""


class UnmodelledRequest(Exception):
    """A valid request whose conversion to the engine's chat input is not modelled here
    (e.g. a Responses ``custom`` tool): not the client's fault. Callers forward it without
    computing its tokens (the gateway routes it by load)."""
