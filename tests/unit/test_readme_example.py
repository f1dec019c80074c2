"""The README's worked example of a handler package runs exactly as printed.

Its first Python block becomes the module ``example_handlers``, its ``pyproject.toml``
entry point is loaded and given to the registry as the bridge would, and the tests in
its last Python block (written with the testing helper) are run.
"""

from __future__ import annotations

import re
import sys
import tomllib
import types
from importlib.metadata import EntryPoint
from pathlib import Path

import pytest

from bridge.config import load_settings
from bridge.handlers.registry import ENTRY_POINT_GROUP, Registry, instantiate

ROOT = Path(__file__).resolve().parents[2]


def section_blocks(language: str) -> list[str]:
    readme = (ROOT / "README.md").read_text()
    section = readme.split("## Writing a native handler", 1)[1].split("\n## ", 1)[0]
    return re.findall(rf"^```{language}\n(.*?)^```", section, re.M | re.S)


@pytest.fixture
def example_handlers(monkeypatch: pytest.MonkeyPatch) -> types.ModuleType:
    package, _tests = section_blocks("python")
    module = types.ModuleType("example_handlers")
    monkeypatch.setitem(sys.modules, "example_handlers", module)
    exec(compile(package, "README.md:example_handlers", "exec"), module.__dict__)
    return module


def test_the_entry_point_gives_the_registry_both_handlers(example_handlers):
    (pyproject,) = section_blocks("toml")
    published = tomllib.loads(pyproject)["project"]["entry-points"][ENTRY_POINT_GROUP]
    ((name, target),) = published.items()
    factory = EntryPoint(name, target, ENTRY_POINT_GROUP).load()
    registry = Registry(instantiate(factory, load_settings({}), None))
    assert registry.handler_for("ExampleGreetWorker") is example_handlers.greet
    notify = registry.handler_for("ExampleNotifyWorker")
    assert isinstance(notify, example_handlers.NotifyWorker)


def test_the_readme_tests_pass(example_handlers):
    _package, tests = section_blocks("python")
    namespace: dict[str, object] = {"__name__": "test_example_handlers"}
    exec(compile(tests, "README.md:tests", "exec"), namespace)
    found = [test for name, test in namespace.items() if name.startswith("test_")]
    assert len(found) == 2
    for test in found:
        test()  # type: ignore[operator]
