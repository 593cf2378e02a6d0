"""The notebook client's pieces that need no server: every op the API takes has a dataclass whose JSON the API's own
schema accepts as that op, and maps decode to the numbers they encode (attnlab/interventions.py, attnlab/results.py)."""
from __future__ import annotations

import base64
import typing

import numpy as np
import pytest
from pydantic import TypeAdapter

import attnlab
from app import schemas
from attnlab.interventions import OPS, to_items
from attnlab.results import decode

EXAMPLES = [
    attnlab.Temperature(0.5, layers=[10]),
    attnlab.Temperature(2.0, heads=(1, 2), kind="cross"),
    attnlab.MaskKeys([0, 3], layers=[1], heads=[2]),
    attnlab.Causal(layers=[0]),
    attnlab.AblateHeads(layers=[1], heads=[0]),
    attnlab.AblateHeads(mode="mean"),
    attnlab.PerturbKeys(tokens=[2], noise_std=0.5, scale=0.9, seed=3),
    attnlab.PerturbQueries(noise_std=1.0),
    attnlab.PatchHeads("rep0.0123456789abcdef0123456789abcdef", layers=[2], heads=[4]),  # a run id: <replica>.<hex>
    attnlab.PatchResidual("rep0.0123456789abcdef0123456789abcdef", layers=[5], tokens=[3]),
]


def _schema_ops() -> set[str]:
    union = typing.get_args(schemas.InterventionIn)[0]
    return {typing.get_args(member.model_fields["op"].annotation)[0] for member in typing.get_args(union)}


def test_every_api_op_has_a_client_class():
    assert _schema_ops() == set(OPS), "an op was added to app/schemas.py: give it a class in attnlab/interventions.py"
    assert {cls.__name__ for cls in OPS.values()} <= set(attnlab.__all__)


@pytest.mark.parametrize("item", EXAMPLES, ids=lambda item: item.op)
def test_the_json_is_what_the_api_schema_accepts_for_that_op(item):
    as_json = item.to_json()
    parsed = TypeAdapter(schemas.InterventionIn).validate_python(as_json)  # the server's own validation
    assert parsed.op == item.op
    dumped = parsed.model_dump()
    for name, value in as_json.items():  # every field the client sends arrives as sent
        assert dumped[name] == value, name


def test_items_mix_dataclasses_and_dicts_and_refuse_anything_else():
    assert to_items([attnlab.MaskKeys([1]), {"op": "causal"}]) == [{"op": "mask_keys", "tokens": [1]}, {"op": "causal"}]
    with pytest.raises(TypeError, match=r"interventions\[1\]"):
        to_items([attnlab.Causal(), "temperature"])


@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_base64_maps_decode_to_the_numbers_they_hold(dtype):
    values = np.random.default_rng(0).random((2, 3, 4, 4)).astype(dtype)
    field = {"dtype": dtype, "shape": list(values.shape), "data": base64.b64encode(values.tobytes()).decode()}
    decoded = decode(field)
    assert decoded.shape == values.shape and decoded.dtype == np.float32
    np.testing.assert_array_equal(decoded, values.astype(np.float32))


def test_nested_lists_decode_with_null_as_nan_and_kinds_decode_per_kind():
    assert np.isnan(decode([[0.5, None]])[0, 1]) and decode([[0.5, None]])[0, 0] == 0.5
    by_kind = decode({"encoder": [[1.0]], "cross": [[0.25]]})
    assert by_kind["cross"][0, 0] == 0.25 and decode(None) is None


def test_lab_error_names_the_field_of_a_validation_error():
    error = attnlab.LabError(422, [{"loc": ["body", "interventions", 0, "tokens"], "msg": "token [99] out of range"}],
                             "/api/text/attention")
    assert str(error) == "422 /api/text/attention: body.interventions.0.tokens: token [99] out of range"
    assert error.status == 422 and error.detail[0]["loc"][-1] == "tokens"


def test_importing_the_client_loads_neither_torch_nor_the_server():
    import subprocess
    import sys

    code = ("import sys, attnlab; from attnlab import Lab, Temperature; "
            "print(sorted(m for m in ('torch', 'transformers', 'fastapi', 'app', 'models', 'httpx') if m in sys.modules))")
    loaded = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip()
    assert loaded == "[]"
