"""Entry point of the omni_serve plugin: registers `omni serve`. Imports neither torch nor fastapi: the
server's modules load when the command runs."""

from omni_kernel import hookimpl


class ServePlugin:
    @hookimpl
    def omni_register_commands(self, register):
        from .command import serve_command

        register(serve_command())
