"""The package's import graph against the layers docs/ARCHITECTURE.md draws (tools/check_layers.py): no import from
a lower layer up, no circle, nothing outside engine/ reaching into an engine's runner or private parts."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def checker():
    spec = importlib.util.spec_from_file_location("check_layers", ROOT / "tools" / "check_layers.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules["check_layers"] = mod
    spec.loader.exec_module(mod)
    return mod


def test_import_graph_follows_the_drawn_layers():
    assert checker().check() == []


def test_the_check_sees_an_upward_import_and_a_circle(tmp_path):
    """On a package of its own: errors (layer 0) importing cli (layer 1) is upward; a <-> b is a circle."""
    cl = checker()
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "ARCHITECTURE.md").write_text("```\nerrors, a, b    low\ncli    top\n```\n")
    pkg = tmp_path / "blockspec"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "errors.py").write_text("def f():\n    from blockspec import cli\n")
    (pkg / "cli.py").write_text("")
    (pkg / "a.py").write_text("from blockspec.b import x\n")
    (pkg / "b.py").write_text("x = 1\nfrom typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import blockspec.a\n")
    cl.ROOT = tmp_path
    assert cl.check() == ["blockspec.errors imports blockspec.cli: upward (errors is below cli)",
                          "circle: blockspec.a <-> blockspec.b"]


def test_the_check_sees_a_reach_into_the_engine(tmp_path):
    cl = checker()
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "ARCHITECTURE.md").write_text("```\nerrors    low\n```\n")
    (tmp_path / "blockspec").mkdir()
    (tmp_path / "blockspec" / "errors.py").write_text("")
    (tmp_path / "tests").mkdir()
    (tmp_path / "tests" / "test_x.py").write_text("def t(llm):\n    llm.engine.runner.decode\n    llm.engine._k\n")
    cl.ROOT = tmp_path
    assert cl.check() == ["tests/test_x.py:2: reads engine.runner", "tests/test_x.py:3: reads engine._k"]
