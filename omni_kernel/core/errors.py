"""One exception hierarchy for the whole runtime.

UserError and its subclasses are mistakes the caller can fix: the CLI prints them as one line and exits 2,
a server answers them with a 4xx. Everything else that goes wrong inside a request is a RequestError.
Failures cross the event boundary as (kind, message, field) and `rebuild` turns them back into these types.
"""

from __future__ import annotations

from typing import Literal

ErrorKind = Literal["invalid_parameter", "bad_input", "model", "user", "runtime", "engine_dead", "unavailable",
                    "aborted"]
USER_KINDS = frozenset({"invalid_parameter", "bad_input", "model", "user"})


class OmniError(Exception):
    """Base of every error omni raises on purpose."""


class UserError(OmniError):
    """A mistake in what the user asked for (exit code 2, HTTP 4xx)."""


class InvalidParameter(UserError):
    """A parameter value outside its allowed range, or an unknown parameter."""

    def __init__(self, field: str, message: str):
        super().__init__(f"invalid {field}: {message}")
        self.field = field
        self.reason = message

    def named(self, name: str) -> str:
        """The error's text with the field called `name` (the CLI's flag for it)."""
        return f"invalid {name}: {self.reason}"


class UnknownPipeline(UserError):
    """The pipeline name is not registered."""


class GraphError(UserError):
    """A pipeline plan breaks a StageGraph rule; names the rule and the nodes."""

    def __init__(self, rule: str, nodes, message: str):
        nodes = tuple(nodes)
        super().__init__(f"invalid stage graph ({rule}): {message}")
        self.rule = rule
        self.nodes = nodes


class ModelError(UserError):
    """A model directory is missing or is not what the stage needs."""


class InputError(UserError):
    """A request input (prompt, image, ...) cannot be used."""


class PluginError(OmniError):
    """A plugin broke the plugin contract (e.g. registered a name that is already taken)."""


class DuplicateRegistration(PluginError):
    """Two plugins claimed the same name."""


class RequestError(OmniError):
    """A failure inside one request; the engine and the other requests go on."""


class StageUnavailable(RequestError):
    """A stage cannot take requests for now but will again (its worker is restarting): retry later."""

    def __init__(self, message: str, retry_after: float | None = None):
        super().__init__(message)
        self.retry_after = retry_after  # seconds until it likely can, when known (a server's Retry-After)


class RequestAborted(RequestError):
    """The request was aborted before it finished."""


class EngineDead(RequestError):
    """A stage's engine hit an error that left it inconsistent; it takes no more requests."""


KINDS: dict[ErrorKind, type] = {"invalid_parameter": InvalidParameter, "bad_input": InputError, "model": ModelError,
                                "user": UserError, "engine_dead": EngineDead, "unavailable": StageUnavailable,
                                "aborted": RequestAborted}


def classify(exc: BaseException) -> tuple[ErrorKind, str, str | None]:
    """(kind, one-line message, field) of an exception, for a StageFailed / RequestFailed event."""
    kind: ErrorKind = next((k for k, cls in KINDS.items() if isinstance(exc, cls)), "runtime")
    text = " ".join(str(exc).split())
    message = text if kind != "runtime" else _plain(exc, text)
    return kind, message, getattr(exc, "field", None)


def _plain(exc: BaseException, text: str) -> str:
    """A runtime failure in words: omni's own errors and the system's (a read-only disk) say what happened; only
    an unexpected exception keeps its type name, which is what tells its reader where it came from."""
    if isinstance(exc, OmniError) and text:
        return text
    if isinstance(exc, OSError) and exc.strerror:
        where = f": {exc.filename}" if exc.filename else ""
        return f"{exc.strerror[:1].lower()}{exc.strerror[1:]}{where}"
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


def rebuild(kind: str, message: str, field: str | None = None) -> OmniError:
    """The typed exception for a failure that crossed the event boundary as (kind, message, field)."""
    cls = KINDS.get(kind, RequestError)
    exc = cls.__new__(cls)  # InvalidParameter's __init__ would prefix the message again
    Exception.__init__(exc, message)
    exc.field = field  # only InvalidParameter's is read
    if isinstance(exc, InvalidParameter):  # its text is "invalid <field>: <reason>" (InvalidParameter.__init__)
        exc.reason = message.removeprefix(f"invalid {field}: ")
    return exc
