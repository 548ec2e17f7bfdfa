"""The omni-workers plugin: registers the placements `process` and `ray` (docs/distributed.md)."""

from omni_kernel import hookimpl

from .workers import Placement


class WorkersPlugin:
    @hookimpl
    def omni_register_placements(self, register):
        register(Placement("process"))
        register(Placement("ray"))
