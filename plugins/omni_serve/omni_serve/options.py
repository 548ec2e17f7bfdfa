"""What a client may send a pipeline, as JSON for its model card (GET /v1/models/{model}): the request options
its node types declare (name, type, default, choices, range, help) and whether it takes an image. The web page
builds its form from this; the server checks every request against the same declarations."""

from __future__ import annotations

from typing import Any

import attrs

from omni_kernel.core.params import OptionInfo, options_of

from .protocol import SERVER_OWNED

IMAGE_POLICIES = ("required", "optional", "none")


def option_cards(graph) -> list[dict[str, Any]]:
    """Every declared request option a request may set (the server's own, such as `output`, left out), in the
    order the node types declare them; an option two nodes declare (`seed`) is listed once."""
    cards: dict[str, dict[str, Any]] = {}
    for node_type in graph.node_types.values():
        params = getattr(node_type, "params", None)
        for name, info in options_of(params).items():
            if name not in SERVER_OWNED and name not in cards:
                cards[name] = _card(name, info, _default(params, name))
    return list(cards.values())


def _card(name: str, info: OptionInfo, default: Any) -> dict[str, Any]:
    return {"name": name, "type": info.type.__name__, "default": default, "help": info.help,
            "choices": list(info.choices) if info.choices else None, "multiple": info.multiple,
            "minimum": info.minimum, "maximum": info.maximum, "exclusive_minimum": info.above}


def image_input(graph) -> str:
    """Whether a request brings an image (`input_reference`): "required", "optional" or "none", from the node
    that takes one (its type lists "image" among its inputs) and that node's `image` policy."""
    for node in graph.plan.nodes:
        node_type = graph.node_types.get(node.id)
        if "image" not in (getattr(node_type, "inputs", None) or ()):
            continue
        policy = node.policy.get("image", _default(getattr(node_type, "policy", None), "image"))
        return policy if policy in IMAGE_POLICIES else "optional"
    return "none"


def _default(cls: type | None, name: str) -> Any:
    field = attrs.fields_dict(cls).get(name) if cls is not None else None
    if field is None or field.default is attrs.NOTHING:
        return None
    default = field.default.factory() if isinstance(field.default, attrs.Factory) else field.default
    return list(default) if isinstance(default, tuple) else default
