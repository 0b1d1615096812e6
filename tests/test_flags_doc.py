"""docs/flags.md is what tools/gen_flags_doc.py writes from the config dataclasses (stale: this fails, and so does
`python tools/gen_flags_doc.py --check`); a changed help string makes the page stale (so the first test cannot pass
by comparing the generator with itself on something that never changes); and the docs' links and docs/ paths lead
to files that exist (the results log and its data were renamed once, and a dangling link is silent otherwise)."""

from __future__ import annotations

import dataclasses
import re
import typing
from pathlib import Path

from tool_utils import ROOT, load_tool

gen = load_tool("gen_flags_doc")


def with_help(cls: type, name: str, text: str) -> type:
    """A copy of the dataclass `cls` whose field `name` has the help `text`; everything else as in `cls`."""
    hints = typing.get_type_hints(cls)
    specs = []
    for f in dataclasses.fields(cls):
        kw: dict[str, typing.Any] = {"metadata": {**f.metadata, **({"help": text} if f.name == name else {})}}
        if f.default is not dataclasses.MISSING:
            kw["default"] = f.default
        elif f.default_factory is not dataclasses.MISSING:  # type: ignore[misc]
            kw["default_factory"] = f.default_factory  # type: ignore[misc]
        specs.append((f.name, hints[f.name], dataclasses.field(**kw)))
    copy = dataclasses.make_dataclass(cls.__name__, specs)
    copy.__module__, copy.__qualname__ = cls.__module__, cls.__qualname__  # the table names the class by these
    return copy


def test_committed_flags_doc_is_current():
    assert gen.OUT.read_text() == gen.render(), "docs/flags.md is stale: run python tools/gen_flags_doc.py"
    assert gen.main(["--check"]) == 0
    assert gen.HEADER in gen.OUT.read_text().splitlines()[2]


def test_a_changed_help_string_makes_the_page_stale(monkeypatch, capsys):
    classes = gen.load_classes()
    engine = next(i for i, (cls, _) in enumerate(classes) if cls.__name__ == "EngineConfig")
    cls, what = classes[engine]
    changed = list(classes)
    changed[engine] = (with_help(cls, "enforce_eager", "a help string nobody wrote"), what)
    before, after = gen.render(classes).splitlines(), gen.render(changed).splitlines()
    # exactly the row of that flag differs, and it carries the new text
    diff = [(a, b) for a, b in zip(before, after) if a != b]
    assert len(before) == len(after) and len(diff) == 1
    assert "--enforce-eager" in diff[0][1] and "a help string nobody wrote" in diff[0][1]
    monkeypatch.setattr(gen, "load_classes", lambda specs=gen.CLASSES: changed)
    assert gen.main(["--check"]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["%s is stale: run python tools/gen_flags_doc.py" % gen.OUT]


def test_a_class_without_flag_fields_gets_no_table():
    @dataclasses.dataclass
    class NoFlags:
        x: int = 1

    assert gen.table(NoFlags, "nothing") is None
    assert "## NoFlags" not in gen.render([(NoFlags, "nothing")])


LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
# a docs/ path named in the text (not inside another path such as /work/shared/docs/...)
DOCS_PATH = re.compile(r"(?<![\w/.-])docs/[\w./-]*[\w/]")


def doc_files() -> list[Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md")),
            *sorted((ROOT / "blockspec" / "drafters").glob("*/README.md"))]


def test_every_relative_link_and_docs_path_resolves():
    missing = []
    for md in doc_files():
        text = md.read_text()
        for target in LINK.findall(text):
            if re.match(r"[a-z]+:", target) or target.startswith("#"):
                continue  # a web address or an anchor on the same page
            if not (md.parent / target.split("#")[0]).exists():
                missing.append(f"{md.relative_to(ROOT)}: link {target}")
        for path in DOCS_PATH.findall(text):
            if not (ROOT / path).exists():
                missing.append(f"{md.relative_to(ROOT)}: path {path}")
    assert not missing, "\n".join(missing)
