"""The one place system tools (nvidia-smi, nvidia-cuda-mps-control) are run.

A real node runs the real tools from the driver root; tests put faithful fakes first on PATH.
"""

from __future__ import annotations

import logging
import os
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger(__name__)
TOOL_TIMEOUT_S = 30


class ToolError(RuntimeError):
    """A system tool failed; the message has the command and what it printed."""


@dataclass(frozen=True)
class ToolRunner:
    driver_root: Path = Path("/")

    def locate(self, tool: str) -> str:
        found = shutil.which(tool) or shutil.which(tool, path=str(self.driver_root / "usr" / "bin"))
        if found is None:
            raise ToolError(f"{tool} not found on PATH or under {self.driver_root / 'usr/bin'}")
        return found

    def run(self, tool: str, *args: str, stdin: str | None = None, env: dict[str, str] | None = None) -> str:
        command = [self.locate(tool), *args]
        try:
            done = subprocess.run(
                command,
                input=stdin,
                capture_output=True,
                text=True,
                timeout=TOOL_TIMEOUT_S,
                env={**os.environ, **(env or {})},
            )
        except subprocess.TimeoutExpired as err:
            raise ToolError(f"{' '.join(command)} timed out after {TOOL_TIMEOUT_S}s") from err
        if done.returncode != 0:
            output = (done.stderr or done.stdout).strip()
            raise ToolError(f"{' '.join(command)} failed with exit code {done.returncode}: {output}")
        log.debug("%s -> %s", " ".join(command), done.stdout.strip())
        return done.stdout
