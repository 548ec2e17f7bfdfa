"""One exception hierarchy for the whole runtime.

UserError and its subclasses are mistakes the caller can fix: the CLI prints them as one line and exits 2,
a server answers them with a 4xx. Everything else that goes wrong inside a request is a RequestError.
"""


class OmniError(Exception):
    """Base of every error omni raises on purpose."""


class UserError(OmniError):
    """A mistake in what the user asked for (exit code 2, HTTP 4xx)."""

    exit_code = 2


class InvalidParameter(UserError):
    """A parameter value outside its allowed range."""

    def __init__(self, field: str, message: str):
        super().__init__(f"invalid {field}: {message}")
        self.field = field


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


class RequestAborted(RequestError):
    """The request was aborted before it finished."""
