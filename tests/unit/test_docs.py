"""The docs a newcomer reads stay true to the code: every module has its row in
docs/architecture.md, and every subcommand and flag of `fgpu` is in docs/cli.md."""

from __future__ import annotations

import argparse
from collections.abc import Iterator

from driver.cli.main import build_parser
from tests.support import ROOT

DOCUMENTED_FOLDERS = ("driver", "partitioner", "testbed", "bench")


def _modules() -> Iterator[str]:
    for folder in DOCUMENTED_FOLDERS:
        for path in sorted((ROOT / folder).rglob("*.py")):
            if "__pycache__" in path.parts or "_pb2" in path.name or path.name in ("__init__.py", "__main__.py"):
                continue
            yield str(path.relative_to(ROOT))


def _commands(parser: argparse.ArgumentParser, prefix: str = "") -> Iterator[tuple[str, argparse.ArgumentParser]]:
    yield prefix, parser
    for action in parser._actions:  # argparse keeps its subcommands nowhere public
        if isinstance(action, argparse._SubParsersAction):
            hidden = {name for name, sub in action.choices.items() if sub.description == argparse.SUPPRESS}
            listed = {choice.dest for choice in action._choices_actions}
            for name, sub in action.choices.items():
                if name in listed and name not in hidden:
                    yield from _commands(sub, f"{prefix} {name}".strip())


def test_every_module_has_its_row_in_the_architecture_doc():
    text = (ROOT / "docs" / "architecture.md").read_text()
    missing = [module for module in _modules() if f"| `{module}` |" not in text]
    assert not missing, f"docs/architecture.md has no row for {missing}"


def test_every_subcommand_and_flag_is_in_the_cli_doc():
    text = (ROOT / "docs" / "cli.md").read_text()
    missing = []
    for command, parser in _commands(build_parser()):
        if command and f"fgpu {command}" not in text:
            missing.append(f"fgpu {command}")
        for action in parser._actions:
            flags = [flag for flag in action.option_strings if flag.startswith("--") and flag != "--help"]
            missing += [
                f"{command} {flag}" for flag in flags if action.help != argparse.SUPPRESS and f"`{flag}" not in text
            ]
    assert not missing, f"docs/cli.md does not mention {missing}"
