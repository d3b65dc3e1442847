"""The YAML files users hand fgpu (sharing config, machine profiles, `fgpu plan` inputs, kubeconfig):
one that cannot be read or parsed is an error of one line that names the file."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import yaml


class YamlFileError(ValueError):
    pass


def load_yaml(path: Path) -> Any:
    """The file's one document (None when empty)."""
    return _parse(path, yaml.safe_load)


def load_yaml_documents(path: Path) -> list[Any]:
    """Every document in the file."""
    return _parse(path, lambda text: list(yaml.safe_load_all(text)))


def parse_yaml_documents(text: str, name: str) -> list[Any]:
    """Every document in `text`, which came from `name` (stdin, say: named in the message)."""
    return _parsed(text, name, lambda text: list(yaml.safe_load_all(text)))


def _parse(path: Path, parse: Callable[[str], Any]) -> Any:
    try:
        text = path.read_text()
    except OSError as err:
        raise YamlFileError(f"cannot read {path}: {err.strerror or err}") from err
    except UnicodeDecodeError as err:
        raise YamlFileError(f"{path} is not a text file") from err
    return _parsed(text, str(path), parse)


def _parsed(text: str, name: str, parse: Callable[[str], Any]) -> Any:
    try:
        return parse(text)
    except yaml.YAMLError as err:
        raise YamlFileError(f"{name} is not valid YAML: {_problem(err)}") from err


def _problem(err: yaml.YAMLError) -> str:
    """PyYAML's message spans lines (context, problem, a quoted excerpt): the problem and where."""
    if isinstance(err, yaml.MarkedYAMLError) and err.problem_mark is not None:
        mark = err.problem_mark
        return f"{err.problem} at line {mark.line + 1}, column {mark.column + 1}"
    return " ".join(str(err).split())


def document_text(document: Any, as_json: bool) -> str:
    """A document as a command prints it (`-o json|yaml`): keys sorted, JSON indented."""
    return (
        json.dumps(document, indent=2, sort_keys=True) + "\n" if as_json else yaml.safe_dump(document, sort_keys=True)
    )
