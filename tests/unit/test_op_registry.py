"""The Op registry (issue 54, models/ops/): every op is one file with one registration, carrying its request schema, its
check, its plan form and what a run file keeps of it; nothing outside models/ops/ asks an intervention for its name;
and docs/architecture.md's list of the files a new op touches is true."""
from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch
from pydantic import BaseModel, TypeAdapter, ValidationError

from app.ids import RUN_ID_PATTERN
from app.runfile import _decode, _Encoder
from app.schemas import InterventionIn, to_engine
from models.interventions import Intervention, plan_layer
from models.ops import OPS
from models.ops.base import RUN_ID_FORM, Op

ROOT = Path(__file__).resolve().parents[2]
RUN_ID = "abcd." + "0" * 32
# the fields an op's request item needs beside `op` (an op whose item needs more fails test_each_op_has_a_schema
# until it is listed here)
REQUIRED = {"temperature": {"beta": 0.5}, "mask_keys": {"tokens": [1]}, "patch_heads": {"source": RUN_ID},
            "patch_residual": {"source": RUN_ID}}
N_HEADS, N_KEYS = 2, 4


def item_of(name: str) -> BaseModel:
    return TypeAdapter(InterventionIn).validate_python({"op": name, **REQUIRED.get(name, {})})


def module_of(op: Op) -> str:
    return type(op).__module__.rpartition(".")[2]


@pytest.mark.parametrize("name", list(OPS))
def test_each_op_has_a_schema_the_request_union_takes(name):
    op = OPS[name]
    assert issubclass(op.schema, BaseModel) and op.name == name
    item = item_of(name)
    assert type(item) is op.schema and item.op == name
    with pytest.raises(ValidationError):  # the union is discriminated by the op's name
        TypeAdapter(InterventionIn).validate_python({"op": name + "_not", **REQUIRED.get(name, {})})


@pytest.mark.parametrize("name", list(OPS))
def test_each_op_has_a_check_a_plan_form_and_a_recording(name):
    op = OPS[name]
    iv = to_engine(item_of(name))  # the engine's item, through the op's check (Op.validate)
    assert op.tokens_index in ("keys", "rows") and op.patch_source in (None, "heads", "residual")
    assert op.scoped or op.unscoped_why, f"{name}: an op without a scope says why (the 422's message)"
    # its form in a layer's run: a part in the plan (short runs and the atlas), on the head outputs, on the residual
    # stream, or before any layer
    plan, plain = (plan_layer(ivs, 0, N_HEADS, N_KEYS, 0.125) for ivs in ((iv,), ()))
    planned = (not torch.equal(plan.beta, plain.beta) or bool(plan.key_mask.any()) or bool(plan.causal.any())
               or bool(plan.ablate.any()) or bool(plan.key_perturbations) or bool(plan.query_perturbations))
    assert planned or op.touches_outputs(iv) or op.patches_residual or not op.scoped, f"{name} does nothing"
    # what a run file keeps: its op, scope and own fields, made again into the same item
    kept = op.record(iv)
    assert kept["op"] == name and set(op.fields) <= set(kept)
    assert Intervention(**kept) == iv
    assert _decode(_Encoder().value(iv, "iv"), {}) == iv


def test_an_ops_check_refuses_what_cannot_run():
    with pytest.raises(ValueError, match="temperature needs a finite beta"):
        Intervention("temperature", beta=float("nan"))
    with pytest.raises(ValueError, match="positions needs a mode"):
        Intervention("positions", mode="off", layers=(0,))
    with pytest.raises(ValueError, match="unknown intervention op"):
        Intervention("no_such_op")


def test_the_run_id_form_is_app_ids():
    assert RUN_ID_FORM == RUN_ID_PATTERN.pattern


def test_each_op_is_one_file_with_one_registration():
    init = (ROOT / "models/ops/__init__.py").read_text()
    files = {p.stem for p in (ROOT / "models/ops").glob("*.py")} - {"__init__", "base"}
    registered = {module_of(op) for op in OPS.values()}
    assert registered == files, "every file under models/ops/ is one registered op"
    for name, op in OPS.items():
        assert module_of(op) == name, f"op {name} lives in models/ops/{name}.py"
        assert len(re.findall(rf"^\s*{name}\.OP,$", init, re.M)) == 1, f"{name}: one registration line"


NAME_DISPATCH = re.compile(r"""\bop\s*(==|!=)\s*["']|["']\s*(==|!=)\s*\w*\.?op\b|\bop\s+(not\s+)?in\s*[(\[{]\s*["']""")


def name_dispatch(source: str) -> list[str]:
    return [line.strip() for line in source.splitlines() if NAME_DISPATCH.search(line)]


def test_the_name_dispatch_check_sees_an_if_chain():
    assert name_dispatch('    if iv.op == "temperature":\n        pass\n    elif item.op in ("a", "b"):\n')
    assert name_dispatch('if op != "patch_heads": pass\n') and name_dispatch('if "causal" == iv.op: pass\n')
    assert not name_dispatch("if OPS[iv.op].patches_residual:\n    op = OPS[item.op]\n")


# where naming ops is a table, not dispatch: the ops themselves, and a family's list of the ops it offers (models/
# families/, like app/interventions.py's refused_ops)
NAMES_ALLOWED = ("models/ops", "models/families")


def test_no_if_chain_on_op_names_outside_models_ops():
    found = {}
    for package in ("models", "app"):
        for path in sorted((ROOT / package).rglob("*.py")):
            if any(path.is_relative_to(ROOT / allowed) for allowed in NAMES_ALLOWED):
                continue
            try:
                hits = name_dispatch(path.read_text())
            except FileNotFoundError:  # removed meanwhile (another edit under way)
                continue
            if hits:
                found[path.relative_to(ROOT).as_posix()] = hits
    assert not found, f"dispatch on op names outside models/ops/ (ask the op, OPS[iv.op]): {found}"


def new_op_section() -> str:
    text = (ROOT / "docs/architecture.md").read_text()
    start = text.index("**An intervention op**")
    return text[start:text.index("\n**", start + 1)]


def test_the_architecture_docs_list_of_a_new_ops_files_is_true():
    section = new_op_section()
    listed = re.findall(r"^\d\. `([^`]+)`", section, re.M)  # the numbered list of the files of code a new op touches
    assert len(listed) <= 4 and re.search(rf"\b{len(listed)} files of code\b", section), listed
    assert listed[0] == "models/ops/<op>.py" and all((ROOT / path).is_file() for path in listed[1:])
    # each file has the registration point the doc names: the registry's line, the page's form table, the client's
    # class table
    points = {"models/ops/__init__.py": "OPS: dict[str, Op] = registry(", "static/js/lab/interventions.js":
              "export const OP_FORMS = {", "attnlab/interventions.py": "OPS: dict[str, type[Intervention]] = {"}
    for path in listed[1:]:
        assert points[path] in (ROOT / path).read_text(), f"{path} lost its registration point"
    # positions, the op re-homed through the registry, is what the count was made on: one file of its own
    assert "models/ops/positions.py" in section and (ROOT / "models/ops/positions.py").is_file()
    assert "positions" in OPS and "positions" in (ROOT / "static/js/lab/interventions.js").read_text()
