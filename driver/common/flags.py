"""Flag and environment handling shared by every `fgpu` command: one-line errors (exit 2), defaults
from environment variables checked as flags are, and the value types flags share (ports, seconds).

Each command's own flags are defined with its command, whose module's `register` adds it to `fgpu`
(driver/cli/main.py): the node's (discover, kubelet-plugin) and the plugin's settings in
driver/node/settings.py, the controller's in driver/controller/settings.py, the webhook's in
driver/admission/settings.py, `fgpu plan`'s and `fgpu status`'s in driver/cli/plan_command.py and
status_command.py, `fgpu mock ...`'s in driver/nvml/commands.py."""

from __future__ import annotations

import argparse
import math
import os
from collections.abc import Sequence
from typing import NoReturn

DEFAULT_DRIVER_NAME = "gpu.fgpu.dev"
# What `add_subparsers` returns: each command's module adds its parser to it (its `register`).
Subcommands = argparse._SubParsersAction


class SettingsError(ValueError):
    """A bad flag, environment value or file: `fgpu` stops with this one line and exit code 2."""


class EnvValue(str):
    """A flag's value taken from its environment variable. Its repr names the variable, so every
    message that quotes a bad value (argparse's among them) says where it came from."""

    env: str

    def __new__(cls, value: str, env: str) -> EnvValue:
        self = super().__new__(cls, value)
        self.env = env
        return self

    def __repr__(self) -> str:
        return f"{self.env}={str.__repr__(self)}"

    def __getnewargs__(self) -> tuple[str, str]:  # type: ignore[override]
        # copy and pickle: a value such as NODE_NAME ends up in records that are deep-copied
        return str(self), self.env


def env_default(parser_default: str | None, env: str) -> str | None:
    """A flag's default from its environment variable. Kept a string: argparse converts a string
    default with the flag's `type`, so a bad value fails as a flag would, in one line, and only
    when the flag is not given (a bad variable does not break `--help` or an explicit flag)."""
    value = os.environ.get(env)
    return parser_default if value is None else EnvValue(value, env)


class FlagParser(argparse.ArgumentParser):
    """argparse with a one-line error (no usage block), and with defaults from the environment
    checked as flags are: argparse leaves a default's choices unchecked and a boolean flag's
    default unconverted."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: {message} (see {self.prog} --help)\n")

    def parse_known_args(  # type: ignore[override]
        self, args: Sequence[str] | None = None, namespace: argparse.Namespace | None = None
    ) -> tuple[argparse.Namespace, list[str]]:
        parsed, rest = super().parse_known_args(args, namespace)
        for action in self._actions:
            value = getattr(parsed, action.dest, None)
            if not isinstance(value, str):
                continue
            if isinstance(action, argparse.BooleanOptionalAction):
                if value not in ("true", "false"):
                    self.error(f"argument {action.option_strings[0]}: {value!r} is not true or false")
                setattr(parsed, action.dest, value == "true")
            elif action.choices is not None and value not in action.choices:
                choices = ", ".join(map(str, action.choices))
                self.error(f"argument {action.option_strings[0]}: {value!r} is not one of {choices}")
        return parsed, rest


def port(value: str) -> int:
    """A TCP port, or -1 (off)."""
    try:
        number = int(value)
    except ValueError:
        number = -2
    if not -1 <= number <= 65535:
        raise argparse.ArgumentTypeError(f"{value!r} is not a port (0-65535, or -1: off)")
    return number


def positive(value: str) -> int:
    """A whole number above 0."""
    try:
        number = int(value)
    except ValueError:
        number = 0
    if number < 1:
        raise argparse.ArgumentTypeError(f"{value!r} is not a whole number above 0")
    return number


def interval(value: str) -> float:
    """A period in seconds, above 0: a loop waits this long between rounds."""
    number = seconds(value)
    if number == 0:
        raise argparse.ArgumentTypeError(f"{value!r} is not a number of seconds above 0")
    return number


def seconds(value: str) -> float:
    """A duration in seconds: a finite number, not negative."""
    number = _number(value)
    if not 0 <= number < math.inf:
        raise argparse.ArgumentTypeError(f"{value!r} is not a number of seconds (0 or more)")
    return number


def above_zero(value: str) -> float:
    """A finite number above 0 (a factor, a rate)."""
    number = _number(value)
    if not 0 < number < math.inf:
        raise argparse.ArgumentTypeError(f"{value!r} is not a number above 0")
    return number


def _number(value: str) -> float:
    """The flag's float, NaN where it is none (every range check then refuses it)."""
    try:
        return float(value)
    except ValueError:
        return math.nan
