"""The plugin API: hooks a plugin implements. Each receives a `register` callback."""

import pluggy

hookspec = pluggy.HookspecMarker("omni_kernel")
hookimpl = pluggy.HookimplMarker("omni_kernel")


@hookspec
def omni_register_node_types(register):
    """Register stage (node) types: register(NodeType(...))."""


@hookspec
def omni_register_connectors(register):
    """Register connectors: register(obj) with name, source_kind, target_kind and convert(output, request); one
    that can stream (a streaming edge's) also has splitter(request) (protocols.StreamConnector)."""


@hookspec
def omni_register_pipelines(register):
    """Register pipelines: register(PipelinePlan(...))."""


@hookspec
def omni_register_commands(register):
    """Register extra CLI commands: register(click.Command)."""


@hookspec
def omni_register_placements(register):
    """Register stage placements other than inproc: register(obj) with `name` and
    `build(nodes, settings, host_factory, workers) -> (stages by node id, workers)` (docs/plugins.md)."""


@hookspec
def omni_register_models(register):
    """Register models `omni models fetch` puts into the cache: register(FetchableModel(...))."""
