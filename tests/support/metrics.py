"""Prometheus endpoints of our processes, scraped over HTTP as Prometheus does."""

from __future__ import annotations

import re
import time
import urllib.request

from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.samples import Sample

Families = dict[str, tuple[str, list[Sample]]]


def scrape(port: int, timeout: float = 30.0) -> Families:
    """Family name -> (type, samples), once the endpoint answers."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
            return {f.name: (f.type, f.samples) for f in text_string_to_metric_families(text)}
        except OSError:
            assert time.monotonic() < deadline, f"nothing serves metrics on port {port}"
            time.sleep(0.1)


def value(families: Families, name: str, **labels: str) -> float | None:
    family = re.sub(r"_(total|bucket|sum|count)$", "", name)
    matches = [s.value for s in families.get(family, ("", []))[1] if s.name == name and s.labels == labels]
    return matches[0] if matches else None
