"""The errors of fgpu's Kubernetes access, apart from the client so that code which only names them
(every `fgpu` command's one-line error) does not load the kubernetes package."""

from __future__ import annotations


class KubeError(Exception):
    """A request to the API server failed; the message says how."""


class NotFoundError(KubeError, LookupError):
    """The object does not exist."""


class ConflictError(KubeError):
    """The object changed since it was read (HTTP 409): read it again and retry."""


class KubeUnavailableError(KubeError, ConnectionError):
    """The API server could not be reached or answered with a server error."""


class TooManyRequestsError(KubeUnavailableError):
    """HTTP 429: try again later; for an eviction, a PodDisruptionBudget does not allow it now
    (`reason` says which)."""

    def __init__(self, reason: str) -> None:
        super().__init__(f"API server error 429: {reason}")
        self.reason = reason


class RefusedError(KubeError):
    """The API server refused the request (a 4xx other than 404, 409 and 429): sent again as it
    is, it would be refused again. `status` is the HTTP code; `resource_version`, where the caller
    knows it, the version of the object the refused write was based on."""

    def __init__(self, message: str, status: int, resource_version: str = "") -> None:
        super().__init__(message)
        self.status = status
        self.resource_version = resource_version


class KubeConfigError(ValueError):
    """No usable client configuration: a setup error, reported once, not retried."""
