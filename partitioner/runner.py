"""The one place system tools (nvidia-smi, nvidia-cuda-mps-control, mount, unshare) are run or started.

The driver's tools come from the driver root: the host's driver, or the mock driver root with the
fakes (driver/nvml/mock_driver_root.py). Everything else comes from PATH: in the plugin's
container, the host's mount or unshare under the driver root would need the host's libraries.
"""

from __future__ import annotations

import logging
import os
import shutil
import subprocess
from dataclasses import dataclass, field
from pathlib import Path

log = logging.getLogger(__name__)
TOOL_TIMEOUT_S = 30
DRIVER_TOOLS = frozenset({"nvidia-smi", "nvidia-cuda-mps-control"})


class ToolError(RuntimeError):
    """A system tool failed; the message has the command and what it printed (also in `output`)."""

    def __init__(self, message: str, output: str = "") -> None:
        super().__init__(message)
        self.output = output


@dataclass(frozen=True)
class ToolRunner:
    driver_root: Path = Path("/")
    # The tools' environment where the plugin's own has no value (mock GPUs: the fakes' state files).
    env_defaults: dict[str, str] = field(default_factory=dict)

    def locate(self, tool: str) -> str:
        if tool in DRIVER_TOOLS:
            path = self.driver_root / "usr" / "bin" / tool
            if not os.access(path, os.X_OK):
                raise ToolError(f"{tool} not found under the driver root {self.driver_root}")
            return str(path)
        found = shutil.which(tool)
        if found is None:
            raise ToolError(f"{tool} not found on PATH")
        return found

    def run(
        self,
        tool: str,
        *args: str,
        stdin: str | None = None,
        env: dict[str, str] | None = None,
    ) -> str:
        """Run the tool and return its stdout."""
        command = [self.locate(tool), *args]
        try:
            done = subprocess.run(
                command,
                input=stdin,
                capture_output=True,
                text=True,
                timeout=TOOL_TIMEOUT_S,
                env={**self.env_defaults, **os.environ, **(env or {})},
            )
        except subprocess.TimeoutExpired as err:
            raise ToolError(f"{' '.join(command)} timed out after {TOOL_TIMEOUT_S}s") from err
        if done.returncode != 0:
            output = (done.stderr or done.stdout).strip()
            raise ToolError(f"{' '.join(command)} failed with exit code {done.returncode}: {output}", output)
        log.debug("%s -> %s", " ".join(command), done.stdout.strip())
        return done.stdout

    def spawn(self, tool: str, *args: str, env: dict[str, str], output: Path) -> subprocess.Popen[bytes]:
        """Start the tool and leave it running (a service in the foreground: its pid is this
        process's child, the one way to know it that nothing else can forge), in a session of its
        own (the plugin's process group is not signalled to it), stdout and stderr appended to
        `output`."""
        command = [self.locate(tool), *args]
        with open(output, "ab") as sink:  # the child keeps its own descriptor
            child = subprocess.Popen(
                command,
                stdin=subprocess.DEVNULL,
                stdout=sink,
                stderr=sink,
                env={**self.env_defaults, **os.environ, **env},
                start_new_session=True,
            )
        log.debug("%s started, pid %d", " ".join(command), child.pid)
        return child
