"""The family registry stays whole and its guide true (issue 54): every family registered in models/families/ has
each part (recognition, loader, description, adapter, ops, job, view) and is the one that recognises its configs;
its ops are what the server's intervention validator offers it; and every file docs/architecture.md's "A model
family" exercise names exists and holds the registration point it is named for."""
from __future__ import annotations

import re
from pathlib import Path

import pytest

from models.families import FAMILIES, UnknownFamily, family_named, family_of
from models.interventions import OPS

ROOT = Path(__file__).resolve().parents[2]
DOC = ROOT / "docs" / "architecture.md"
PATH = re.compile(r"\b((?:app|models|attnlab|static|tests|docs)/[\w./-]*\.(?:py|js|md)|attnlab_prepare\.py)")

# what each file the exercise names must hold: the registration point (or the interface) it is named for
REGISTRATION_POINTS = {
    "models/families/__init__.py": r"^FAMILIES: tuple\[Family, \.\.\.\] = \(",
    "models/families/base.py": r"^class Family\b",
    "models/families/distilbert.py": r"^FAMILY = Family\(",
    "models/families/encoder.py": r"^FAMILY = Family\(",
    "models/listing.py": r"^def describe_\w+\(",
    "models/anatomy.py": r"output_projection_names\(\)",
    "app/pipeline/job.py": r"^JOB_BUILDERS: .* = \{",
    "app/pipeline/views.py": r"^VIEWS = \{",
    "app/pipeline/maps.py": r"^class \w+Maps\b",
    "app/pipeline/text.py": r"^def text_work\(",
    "app/runtime.py": r"^class Runtime\b",
    "app/runtime_models.py": r"^class ModelCatalog\b",
    "models/adapters/base.py": r"^class AttentionAdapter\b",
    "models/adapters/bert.py": r"^class \w+\(AttentionAdapter\)",
    "models/adapters/causal_lm.py": r"^class \w+\(AttentionAdapter\)",
    "models/adapters/seq2seq.py": r"^class \w+\(AttentionAdapter\)",
    "models/adapters/vit.py": r"^class \w+\(AttentionAdapter\)",
    "models/adapters/whisper.py": r"^class \w+\(AttentionAdapter\)",
    "models/hooks.py": r"AttentionInterface",
    "models/faithfulness.py": r"^def \w+\(",
    "models/attribution.py": r"^def \w+\(",
    "static/js/views/effects.js": r"export function",
    "attnlab_prepare.py": r"^def prepare\w*\(",
    "tests/tiny_models.py": r"^def build_text_model\(",
    "tests/api/test_family_distilbert.py": r"^def test_maps_equal_transformers_output_attentions\(",
    "tests/unit/test_families.py": r"DISTILBERT_FAMILIES",
    "tests/unit/test_family_registry.py": r"^REGISTRATION_POINTS = \{",
    "docs/api.md": r"DistilBERT",
}


def exercise() -> str:
    text = DOC.read_text(encoding="utf-8")
    return text.split("**A model family**", 1)[1].split("**An intervention op**", 1)[0]


def test_every_file_the_exercise_names_holds_its_registration_point():
    named = set(PATH.findall(exercise()))
    assert {"models/families/__init__.py", "models/families/base.py", "app/pipeline/views.py"} <= named
    unknown = sorted(named - set(REGISTRATION_POINTS))
    assert unknown == [], f"the guide names files this test does not know the registration point of: {unknown}"
    wrong = [path for path in sorted(named) if not (ROOT / path).is_file()
             or not re.search(REGISTRATION_POINTS[path], (ROOT / path).read_text(encoding="utf-8"), re.M)]
    assert wrong == []


def test_the_exercise_states_the_count_of_the_commit_that_added_a_family():
    count = re.search(r"\*\*(\d+) files? of code\*\*", exercise())
    assert count is not None and int(count.group(1)) <= 3
    assert "models/families/distilbert.py" in exercise()


def test_every_family_has_each_part_and_a_file_of_its_own():
    from app.pipeline.job import JOB_BUILDERS
    from app.pipeline.views import VIEWS
    from models.adapters.base import AttentionAdapter

    assert len({f.name for f in FAMILIES}) == len(FAMILIES)
    for family in FAMILIES:
        assert (ROOT / "models" / "families" / f"{family.name}.py").is_file(), family.name
        assert family.kind in ("text", "image", "audio")
        assert all(callable(part) for part in (family.recognises, family.load, family.describe, family.adapter))
        assert issubclass(family.adapter(), AttentionAdapter), family.name
        assert family.view in VIEWS, family.name
        assert family.job in JOB_BUILDERS, family.name
        assert family.ops and set(family.ops) <= set(OPS), family.name
        assert family.what and family_named(family.name) is family


def _configs(tmp_path: Path) -> dict[str, tuple]:
    """(config, source) that each family, and only it, should claim: configs built in memory, no weights."""
    import transformers as tf

    prepared = tmp_path / "whisper"
    prepared.mkdir()
    (prepared / "ctranslate2_config.json").write_text("{}")
    return {
        "encoder": (tf.BertConfig(), str(tmp_path)),
        "distilbert": (tf.DistilBertConfig(), str(tmp_path)),
        "vision": (tf.ViTConfig(), str(tmp_path)),
        "causal_lm": (tf.LlamaConfig(architectures=["LlamaForCausalLM"]), str(tmp_path)),
        "seq2seq": (tf.BartConfig(), str(tmp_path)),
        "speech": (tf.WhisperConfig(), str(prepared)),
    }


def test_each_family_recognises_its_own_configs(tmp_path):
    cases = _configs(tmp_path)
    assert set(cases) == {f.name for f in FAMILIES}  # a new family brings a case here
    assert {name: family_of(*case).name for name, case in cases.items()} == {name: name for name in cases}
    import transformers as tf

    # a Whisper checkpoint `attnlab prepare` did not make is an encoder–decoder, as before the registry
    assert family_of(tf.WhisperConfig(), str(tmp_path)).name == "seq2seq"
    with pytest.raises(UnknownFamily) as refused:
        family_of(tf.MPNetConfig(), str(tmp_path))
    assert all(f.what in str(refused.value) for f in FAMILIES)


def test_vision_model_types_are_the_vit_adapters():
    from models.adapters.vit import SUPPORTED_MODEL_TYPES
    from models.families.vision import MODEL_TYPES

    assert MODEL_TYPES == SUPPORTED_MODEL_TYPES


def test_each_familys_ops_are_what_the_validator_offers_it():
    """Family.ops against app/interventions.py's tables for its job (plain, per kind, speech): the same ops."""
    from types import SimpleNamespace

    from app.interventions import plain_table, seq2seq_table, whisper_table

    info = SimpleNamespace(id="m", layers=2, heads=2, decoder_layers=2, decoder_heads=2, encoder_layers=2)
    tables = {"plain": plain_table(info, 4), "seq2seq": seq2seq_table(info, 4, 4), "whisper": whisper_table(info, 4)}
    for family in FAMILIES:
        offered = tuple(op for op in OPS if op not in tables[family.job].refused_ops)
        assert family.ops == offered, family.name


# what picking a job or a view by a family's (or an output kind's) name in code would look like; the pipeline picks
# them through the tables (JOB_BUILDERS, VIEWS) keyed by Family.job and Family.view
NAME_DISPATCH = re.compile(
    r"""(\bfamily(\.\w+)?\s*(==|!=|\bin\b)\s*[\"'(\[{])"""  # family == "whisper", job.family in ("plain", …)
    r"""|(\.output\s*(==|!=)\s*[\"']seq2seq)"""  # adapter.info.output == "seq2seq"
    r"""|(VIEWS\[\s*[\"'])|(JOB_BUILDERS\[\s*[\"'])"""  # a table entry taken by a literal name
    r"""|(isinstance\([^)]*(PlainJob|Seq2SeqJob|SpeechJob))"""  # the job's class asked instead of its view
)


def test_the_pipeline_picks_jobs_and_views_through_the_family():
    """No job or view in app/pipeline/ is picked by a family's name, an output kind or a job's class: build_job takes
    Family.job's builder, answer() Family.view's view."""
    found = [f"{path.relative_to(ROOT)}:{n}: {line.strip()}"
             for path in sorted((ROOT / "app" / "pipeline").glob("*.py"))
             for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1) if NAME_DISPATCH.search(line)]
    assert found == []
    job_source = (ROOT / "app" / "pipeline" / "job.py").read_text(encoding="utf-8")
    views_source = (ROOT / "app" / "pipeline" / "views.py").read_text(encoding="utf-8")
    assert "JOB_BUILDERS[family.job]" in job_source and "VIEWS[job.family.view]" in views_source


def test_the_pattern_catches_name_dispatch():
    """The check above can fail: each way of picking by name it is meant to catch is caught."""
    for line in ('if self.family == "whisper":', 'if job.family.name != "speech":', 'if family in ("plain", "x"):',
                 'if adapter.info.output == "seq2seq":', 'return VIEWS["plain"](job)', 'JOB_BUILDERS["seq2seq"](…)',
                 "if isinstance(job, SpeechJob):"):
        assert NAME_DISPATCH.search(line), line
    for line in ("return VIEWS[job.family.view](job)", "family = model_family(runtime, adapter.info.id)",
                 "return JOB_BUILDERS[family.job](runtime, family, adapter, encoded, req, page)"):
        assert not NAME_DISPATCH.search(line), line


def test_a_model_gets_the_job_and_view_its_family_names():
    """build_job's choice, for each family, is its Family.job's builder, whose job answers with Family.view's view."""
    from types import SimpleNamespace

    from app.pipeline.job import JOB_BUILDERS, PlainJob, Seq2SeqJob, SpeechJob, model_family

    kinds = {"plain": PlainJob, "seq2seq": Seq2SeqJob, "whisper": SpeechJob}
    assert set(JOB_BUILDERS) == set(kinds)
    for family in FAMILIES:
        runtime = SimpleNamespace(specs={"m": SimpleNamespace(family=family.name)})
        assert model_family(runtime, "m") is family
        assert JOB_BUILDERS[family.job].__annotations__["return"] == kinds[family.job].__name__, family.name
