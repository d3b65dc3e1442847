"""The reference allocator (k8s.io/dynamic-resource-allocation/structured, what kube-scheduler
runs) as a long-lived `allocate --batch` process: one JSON scenario in, one answer out."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path
from typing import Any


class ReferenceAllocator:
    def __init__(self, binary: Path) -> None:
        self._process = subprocess.Popen(
            [str(binary), "--batch"], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, bufsize=1
        )

    def _ask(self, objects: list[dict[str, Any]], verify: bool, node: str = "") -> dict[str, Any]:
        assert self._process.stdin and self._process.stdout
        self._process.stdin.write(json.dumps({"objects": objects, "verify": verify, "node": node}) + "\n")
        answer = json.loads(self._process.stdout.readline())
        if answer.get("error"):
            raise RuntimeError(f"reference allocator: {answer['error']}")
        return answer

    def allocate(self, objects: list[dict[str, Any]], node: str = "") -> list[dict[str, Any]]:
        """One result per unallocated claim, in order: {claim, node, allocation} or {claim, error};
        on `node` only when given, else on the first node by name where it fits."""
        return self._ask(objects, verify=False, node=node)["results"]

    def problems(self, objects: list[dict[str, Any]]) -> list[str]:
        """What is wrong with the allocations the claims carry (double booking, overdrawn counters
        or capacity, devices that do not exist or do not match their selectors)."""
        return self._ask(objects, verify=True).get("problems") or []

    def close(self) -> None:
        if self._process.stdin:
            self._process.stdin.close()
        self._process.wait(timeout=10)
