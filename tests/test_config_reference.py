"""docs/training.md's key reference is the one the job config's dataclasses generate."""

import dataclasses
import typing

from recsys import config_reference


def test_the_committed_key_reference_is_current():
    """Fails when a setting, its default or its field docstring changed without
    ``python -m recsys.config_reference`` run after it."""
    text = config_reference.DOC.read_text()
    assert config_reference.current(text) == text, (
        f"docs/training.md's key reference is stale: run {config_reference.COMMAND}")
    assert config_reference.main(["--check"]) == 0


def test_the_reference_has_a_row_for_every_key_with_its_docstring():
    from recsys.config import JobConfig

    text = config_reference.reference_markdown()
    seen = 0

    def walk(cls):
        nonlocal seen
        docs = config_reference._field_docs(cls)
        for f in dataclasses.fields(cls):
            assert docs.get(f.name), f"{cls.__name__}.{f.name} has no docstring"
            assert config_reference._cell(docs[f.name]) in text, f"{cls.__name__}.{f.name}"
            assert config_reference._only_sections(cls) or f"| `{f.name}` |" in text, f"{cls.__name__}.{f.name}"
            seen += 1
            inner, _ = config_reference._section_of(typing.get_type_hints(cls)[f.name], f.name)
            if inner is not None:
                walk(inner)

    walk(JobConfig)
    assert seen > 100
    for section in ("[store.spill]", "[store.device]", "[store.host]", "[train.optim]", "[train.schedule]",
                    "[train.eval]", "[train.checkpoint]", "[train.runtime]", "[[schema.sparse]]",
                    "[schema.tables.NAME]"):
        assert f"### `{section}`" in text or f"`{section}`," in text, section
