"""The handler examples run exactly as printed: the README's short one, and the worked
package of docs/handlers.md.

Each page's first Python block becomes the module ``example_handlers``, its
``pyproject.toml`` entry point is loaded and given to the registry as the bridge would,
and the handler guide's tests (its last Python block, written with the testing helper)
are run; so is the README's one-line use of the testing helper.
"""

from __future__ import annotations

import re
import sys
import tomllib
import types
from importlib.metadata import EntryPoint
from pathlib import Path

import pytest

import bridge.handlers.testing
from bridge import Outcome
from bridge.assembly import ENTRY_POINT_GROUP, instantiate
from bridge.config import load_settings
from bridge.handlers.registry import Registry

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
GUIDE = ROOT / "docs" / "handlers.md"


def section(page: Path, heading: str | None = None) -> str:
    text = page.read_text()
    if heading is None:
        return text
    return text.split(f"## {heading}\n", 1)[1].split("\n## ", 1)[0]


def blocks(text: str, language: str) -> list[str]:
    return re.findall(rf"^```{language}\n(.*?)^```", text, re.M | re.S)


def load_module(monkeypatch: pytest.MonkeyPatch, source: str, origin: str) -> types.ModuleType:
    module = types.ModuleType("example_handlers")
    monkeypatch.setitem(sys.modules, "example_handlers", module)
    exec(compile(source, origin, "exec"), module.__dict__)
    return module


def registry_of(text: str) -> Registry:
    (pyproject,) = blocks(text, "toml")
    published = tomllib.loads(pyproject)["project"]["entry-points"][ENTRY_POINT_GROUP]
    ((name, target),) = published.items()
    factory = EntryPoint(name, target, ENTRY_POINT_GROUP).load()
    return Registry(instantiate(factory, load_settings({}), None))


# -- the README's short handler ------------------------------------------------------------


@pytest.fixture
def readme_example(monkeypatch: pytest.MonkeyPatch) -> types.ModuleType:
    (package,) = blocks(section(README, "A native handler"), "python")
    return load_module(monkeypatch, package, "README.md:example_handlers")


def test_the_readme_entry_point_gives_the_registry_its_handler(readme_example):
    registry = registry_of(section(README, "A native handler"))
    assert registry.handler_for("ExampleGreetWorker") is readme_example.greet


def test_the_readme_handler_runs_as_the_readme_says(readme_example):
    (call,) = re.findall(r"`(bridge\.handlers\.testing\.run\([^`]*\))`", README.read_text())
    result = eval(call, {"bridge": bridge, "greet": readme_example.greet})
    assert result.outcome == Outcome.SUCCESS
    assert [(t.task_class, t.data) for t in result.followups] == [
        ("ExampleNotifyWorker", {"text": "Hello, Ada!"})
    ]
    empty = bridge.handlers.testing.run(readme_example.greet, {})
    assert empty.outcome == Outcome.PERMANENT_FAILURE


# -- the handler guide's package -----------------------------------------------------------


@pytest.fixture
def example_handlers(monkeypatch: pytest.MonkeyPatch) -> types.ModuleType:
    package, _tests = blocks(section(GUIDE), "python")
    return load_module(monkeypatch, package, "docs/handlers.md:example_handlers")


def test_the_entry_point_gives_the_registry_both_handlers(example_handlers):
    registry = registry_of(section(GUIDE))
    assert registry.handler_for("ExampleGreetWorker") is example_handlers.greet
    notify = registry.handler_for("ExampleNotifyWorker")
    assert isinstance(notify, example_handlers.NotifyWorker)


def test_the_handler_guide_tests_pass(example_handlers):
    _package, tests = blocks(section(GUIDE), "python")
    namespace: dict[str, object] = {"__name__": "test_example_handlers"}
    exec(compile(tests, "docs/handlers.md:tests", "exec"), namespace)
    found = [test for name, test in namespace.items() if name.startswith("test_")]
    assert len(found) == 2
    for test in found:
        test()  # type: ignore[operator]
