"""The Wan node type's kernel form without loading a model: its policy, validated when the plan is built; its
engine settings, the kernel's share key, which refuse settings invalid for the checkpoint; its request check."""

from __future__ import annotations

import json
import shutil

import pytest

from omni_kernel.core.errors import GraphError, InvalidParameter, ModelError
from omni_kernel.core.graph import NodeSpec
from omni_kernel.core.planner import node_policy
from omni_kernel.core.request import StageInput
from omni_wan.build import engine_settings
from omni_wan.layout import read_layout
from omni_wan.params import WanConfig, WanParams, WanPolicy
from omni_wan.plugin import NODE_TYPE, WanPlugin


@pytest.fixture(scope="module")
def node_type():
    registered = []
    WanPlugin().omni_register_node_types(registered.append)
    return registered[0]


def node(policy: dict, node_id: str = "wan", **kwargs) -> NodeSpec:
    return NodeSpec(node_id, NODE_TYPE, policy=policy, **kwargs)


def test_the_policy_is_a_declared_class_and_a_misspelt_key_is_refused(node_type):
    assert node_policy(node({"image": "none", "preset": "fast"}), node_type) == WanPolicy(image="none", preset="fast")
    with pytest.raises(GraphError, match="no policy key 'imgae'; valid keys: image, preset"):
        node_policy(node({"imgae": "none"}), node_type)
    with pytest.raises(GraphError, match="image"):
        node_policy(node({"image": "sometimes"}), node_type)
    with pytest.raises(GraphError, match="preset"):
        node_policy(node({"preset": "fastest"}), node_type)


def test_nodes_of_one_model_and_config_have_one_engine_whatever_their_id_and_image_policy(tiny_model):
    config = WanConfig(model=str(tiny_model), device="cpu")
    i2v = engine_settings(node({}), config, WanPolicy(image="required"))
    t2v = engine_settings(node({}, "video"), config, WanPolicy(image="none", preset="fast"))
    assert i2v == t2v and hash(i2v) == hash(t2v) and i2v.resources is None
    assert engine_settings(node({}), WanConfig(model=str(tiny_model), device="cpu", wan_max_batch=2),
                           WanPolicy()) != i2v


def test_a_parallel_engine_depends_on_its_ray_resources(tiny_model):
    config = WanConfig(model=str(tiny_model), device="cpu", wan_ulysses=2)
    one = engine_settings(node({}, resources={"CPU": 1}), config, WanPolicy())
    two = engine_settings(node({}, resources={"CPU": 2}), config, WanPolicy())
    assert one.resources == (("CPU", 1),) and one != two


def test_a_placements_rank_launcher_reaches_the_engine_through_its_settings(tiny_model):
    """The placement that builds the node hands its launcher on the node (NodeSpec.ranks); the engine settings
    carry it to the engine (no process-global), and it is not part of the share key or of the node's equality."""
    config = WanConfig(model=str(tiny_model), device="cpu", wan_ulysses=2)

    def launcher():
        raise AssertionError("not started here")

    placed = node({}, ranks=launcher)
    assert placed == node({})
    settings = engine_settings(placed, config, WanPolicy())
    assert settings.ranks is launcher and engine_settings(node({}), config, WanPolicy()).ranks is None
    assert settings == engine_settings(node({}), config, WanPolicy())


def test_the_ranks_start_where_the_launcher_the_build_passed_says():
    from omni_wan.rank_launch import PlacedRanks, ProcessRanks, launcher

    class Group:
        address = "10.0.0.7"

    assert isinstance(launcher(None), ProcessRanks)
    placed = launcher(Group)
    assert isinstance(placed, PlacedRanks) and placed.address == "10.0.0.7"


def test_engine_settings_refuse_a_ulysses_degree_that_does_not_divide_the_heads(tiny_model):
    with pytest.raises(InvalidParameter, match="wan_ulysses: 3 does not divide"):
        engine_settings(node({}), WanConfig(model=str(tiny_model), device="cpu", wan_ulysses=3), WanPolicy())


def test_the_request_check_refuses_an_image_against_the_policy_before_any_model_loads(node_type, tiny_model,
                                                                                        image_path, tmp_path):
    config = WanConfig(model=str(tiny_model), device="cpu")
    params = WanParams(output=str(tmp_path / "v.mp4"))

    def check(policy: WanPolicy, item: StageInput) -> None:
        node_type.check(node({}), config, policy, engine_settings(node({}), config, policy), item)

    with pytest.raises(InvalidParameter, match="image: this pipeline renders video from the prompt alone"):
        check(WanPolicy(image="none"), StageInput("r", "a cat", image=str(image_path), params=params))
    with pytest.raises(InvalidParameter, match="image: this pipeline needs an input image"):
        check(WanPolicy(image="required"), StageInput("r", "a cat", params=params))
    check(WanPolicy(image="optional"), StageInput("r", "a cat", params=params))
    assert list(tmp_path.iterdir()) == []


def test_the_layout_is_read_once_per_directory_until_its_files_change(tiny_model, tmp_path):
    """Every check and build asks for the layout: it is read from disk again only when what it is read from
    changes."""
    model = shutil.copytree(tiny_model, tmp_path / "model")
    first = read_layout(model)
    assert read_layout(model) is first and read_layout(str(model)) is first
    config = model / "transformer" / "config.json"
    body = json.loads(config.read_text(encoding="utf-8"))
    config.write_text(json.dumps({**body, "num_attention_heads": body["num_attention_heads"] * 2}), encoding="utf-8")
    assert read_layout(model).num_heads == first.num_heads * 2
    shutil.rmtree(model / "vae")
    with pytest.raises(ModelError, match="missing vae"):
        read_layout(model)
