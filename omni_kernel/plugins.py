"""Plugin loading: pluggy hooks, entry points in the `omni_kernel` group, an allowlist in OMNI_PLUGINS."""

from __future__ import annotations

import importlib.metadata
import logging
import os
from collections.abc import Callable, Iterable
from typing import Any, Literal

import attrs
import pluggy

from omni_kernel.core import hookspecs
from omni_kernel.core.errors import DuplicateRegistration, PluginError
from omni_kernel.core.planner import GraphBuilder
from omni_kernel.core.registry import Registry
from omni_kernel.core.stage_scheduler import StageScheduler

ENTRY_POINT_GROUP = "omni_kernel"
ALLOWLIST_ENV = "OMNI_PLUGINS"
HOOKS = {
    "omni_register_node_types": Registry.add_node_type,
    "omni_register_connectors": Registry.add_connector,
    "omni_register_pipelines": Registry.add_pipeline,
    "omni_register_commands": Registry.add_command,
    "omni_register_placements": Registry.add_placement,
    "omni_register_models": Registry.add_model,
}
# The `omni` group's own commands; a plugin command of the same name would never be reachable.
BUILTIN_COMMANDS = frozenset({"run", "plugins", "pipelines", "models"})

log = logging.getLogger("omni")


@attrs.frozen
class PluginInfo:
    name: str
    version: str
    status: Literal["loaded", "failed", "skipped"]
    error: str | None = None


class PluginHost:
    """The loaded plugins and what they registered, plus the one GraphBuilder (and so the one set of engines) and
    the one StageScheduler that every Omni of this host uses. `rebuild`, where set, is a picklable callable that
    builds an equal host in another process (a placement's worker); None: the placement's default."""

    def __init__(self, reserved_commands: Iterable[str] = BUILTIN_COMMANDS, rebuild: Callable[[], Any] | None = None):
        self.pm = pluggy.PluginManager(ENTRY_POINT_GROUP)
        self.pm.add_hookspecs(hookspecs)
        self._registry = Registry()
        self.plugins: list[PluginInfo] = []
        self.reserved_commands = frozenset(reserved_commands)
        self.rebuild = rebuild
        self.builder = GraphBuilder(self._registry)
        self.scheduler = StageScheduler()

    @property
    def registry(self) -> Registry:
        return self._registry

    @registry.setter
    def registry(self, registry: Registry) -> None:
        """Plugins register into a copy (all or nothing); the builder sees the registry that was kept."""
        self._registry = registry
        self.builder.registry = registry

    def register(self, plugin: Any, name: str, version: str = "unknown") -> None:
        """Register a plugin object and everything its hooks register; all or nothing."""
        if self.pm.has_plugin(name):
            raise DuplicateRegistration(f"plugin {name!r} is already registered")
        if (other := self.pm.get_name(plugin)) is not None:
            raise DuplicateRegistration(f"plugin {name!r} is the object already registered as {other!r}")
        try:
            self.pm.register(plugin, name=name)
        except pluggy.PluginValidationError as exc:
            raise PluginError(" ".join(str(exc).split())) from None
        try:
            self._check_hooks(plugin, name)
            staged = self.registry.copy()
            for hook_name, add in HOOKS.items():
                self._call(plugin, hook_name, register=lambda item, add=add: add(staged, item, name))
            self._check_commands(staged, name)
        except BaseException:
            self.pm.unregister(name=name)
            raise
        self.registry = staged
        self.plugins.append(PluginInfo(name, version, "loaded"))

    def _check_hooks(self, plugin: Any, name: str) -> None:
        try:
            self.pm.check_pending()
        except pluggy.PluginValidationError:
            unknown = sorted(c.name for c in self.pm.get_hookcallers(plugin) or () if not c.has_spec())
            raise PluginError(f"plugin {name!r} implements unknown hook(s) {', '.join(unknown)}; "
                              f"the hooks are {', '.join(HOOKS)}") from None

    def _call(self, plugin: Any, hook_name: str, **kwargs: Any) -> None:
        """Call one plugin's implementations of a hook, passing only the arguments each declares (as pluggy does)."""
        for impl in getattr(self.pm.hook, hook_name).get_hookimpls():
            if impl.plugin is plugin:
                impl.function(*[kwargs[arg] for arg in impl.argnames])

    def _check_commands(self, staged: Registry, name: str) -> None:
        shadowing = sorted(set(staged.by_plugin(name)["commands"]) & self.reserved_commands)
        if shadowing:
            raise PluginError(f"command {shadowing[0]!r} of plugin {name!r} would shadow the built-in omni command")

    def load_entry_points(self, allowlist: str | None = None) -> None:
        """Load every installed plugin; one that fails is reported by name and version and skipped."""
        allow = allowlist if allowlist is not None else os.environ.get(ALLOWLIST_ENV)
        allowed = {n.strip() for n in allow.split(",") if n.strip()} if allow else None
        eps = sorted(importlib.metadata.entry_points(group=ENTRY_POINT_GROUP), key=lambda e: e.name)
        installed = sorted({ep.name for ep in eps} | {n for n, _ in self.pm.list_name_plugin()})
        if allowed is not None and (unknown := sorted(allowed - set(installed))):
            log.warning("%s names %s, which %s not installed; installed plugins: %s", ALLOWLIST_ENV,
                        ", ".join(unknown), "is" if len(unknown) == 1 else "are", ", ".join(installed) or "none")
        for ep in eps:
            version = getattr(ep.dist, "version", None) or "unknown"
            if allowed is not None and ep.name not in allowed:
                self.plugins.append(PluginInfo(ep.name, version, "skipped", f"not in {ALLOWLIST_ENV}"))
                continue
            try:
                obj = ep.load()
                self.register(obj() if isinstance(obj, type) else obj, ep.name, version)
            except Exception as exc:  # noqa: BLE001 - one broken plugin must not break the others
                error = f"{type(exc).__name__}: {exc}" if not isinstance(exc, PluginError) else str(exc)
                log.warning("plugin %s %s failed to load and was skipped: %s", ep.name, version, error)
                self.plugins.append(PluginInfo(ep.name, version, "failed", error))


def load_host(allowlist: str | None = None, reserved_commands: Iterable[str] = BUILTIN_COMMANDS) -> PluginHost:
    """A host with the kernel's own plugin and every installed plugin loaded."""
    from omni_kernel.builtin.echo import KernelPlugin

    host = PluginHost(reserved_commands)
    host.register(KernelPlugin(), "omni_kernel", _version("omni-kernel"))
    host.load_entry_points(allowlist)
    return host


def _version(dist: str) -> str:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return "unknown"
