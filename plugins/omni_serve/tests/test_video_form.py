"""The video form's extra fields, checked against declared request options (no server, no model)."""

import pytest
from starlette.datastructures import FormData

from omni_kernel.core.errors import InvalidParameter
from omni_kernel.core.params import ARParams, options_of
from omni_serve.protocol import APIError
from omni_serve.routes_videos import declared_fields

OPTIONS = options_of(ARParams)


def test_fields_are_converted_by_their_declared_type_and_lists_collected():
    form = FormData([("prompt", "p"), ("size", "64x64"), ("max_tokens", "8"), ("temperature", "0.5"),
                     ("ignore_eos", "true"), ("stop[]", "a"), ("stop[]", "b"), ("seed", "")])
    assert declared_fields(form, OPTIONS, "m") == {"max_tokens": 8, "temperature": 0.5, "ignore_eos": True,
                                                   "stop": ("a", "b")}


@pytest.mark.parametrize("field, error, says", [
    ("steps", APIError, ("no field 'steps'; valid fields: frequency_penalty, ignore_eos, input_reference, max_tokens, "
                         "min_p, model, presence_penalty, prompt, repetition_penalty, seed, size, stop, temperature, "
                         "top_k, top_p$")),
    ("output", APIError, "set by the server"), ("max_tokens", InvalidParameter, "'x' is not a valid int")])
def test_a_field_no_node_declares_or_a_bad_value_is_refused_by_name(field, error, says):
    with pytest.raises(error, match=says) as info:
        declared_fields(FormData([(field, "x")]), OPTIONS, "m")
    assert getattr(info.value, "param", None) == field or getattr(info.value, "field", None) == field
