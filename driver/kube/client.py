"""The narrow interface between fgpu and the Kubernetes API server, with plain-dict objects.

Everything that reads or writes API objects goes through `KubeApi`, so tests can run against the
real control plane or an in-memory stand-in with the same methods. Objects are the API's JSON
(camelCase keys), exactly as the server sends them.
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, Protocol

import kubernetes
import urllib3
from kubernetes.client.exceptions import ApiException
from kubernetes.watch.watch import iter_resp_lines

from driver.common.yamlfile import YamlFileError, load_yaml
from driver.kube import claim_protobuf
from driver.kube.claim_protobuf import DeviceKey

JsonObject = dict[str, Any]


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


class KubeApi(Protocol):
    def close(self) -> None: ...
    def get_claim(self, namespace: str, name: str) -> JsonObject: ...
    def write_claim_device_status(
        self,
        namespace: str,
        name: str,
        uid: str,
        replaced: Callable[[DeviceKey], bool],
        entries: list[JsonObject],
        field_manager: str,
    ) -> None: ...
    def create_event(self, namespace: str, event: JsonObject) -> JsonObject: ...
    def get_node(self, name: str) -> JsonObject: ...
    def list_all_claims(self, from_cache: bool = False) -> list[JsonObject]: ...
    def annotate_pod(self, namespace: str, name: str, uid: str, annotations: dict[str, str]) -> None: ...
    def list_slices(self, driver: str, node: str) -> tuple[list[JsonObject], str]: ...
    def create_slice(self, body: JsonObject) -> JsonObject: ...
    def replace_slice(self, name: str, body: JsonObject) -> JsonObject: ...
    def delete_slice(self, name: str) -> None: ...
    def watch_slices(
        self, driver: str, node: str, resource_version: str, timeout_s: int
    ) -> Iterator[tuple[str, JsonObject]]: ...


@contextlib.contextmanager
def translated_errors() -> Iterator[None]:
    """Map client exceptions onto NotFoundError / KubeUnavailableError; others pass through."""
    try:
        yield
    except ApiException as err:
        if err.status == 404:
            raise NotFoundError(err.reason) from err
        if err.status == 409:
            raise ConflictError(f"conflict: {err.reason}") from err
        if err.status == 429:
            raise TooManyRequestsError(_status_message(err)) from err
        if err.status >= 500:
            raise KubeUnavailableError(f"API server error {err.status}: {err.reason}") from err
        message = f"API server refused the request: {err.status} {_status_message(err)}"
        raise RefusedError(message, err.status) from err
    except (OSError, urllib3.exceptions.HTTPError) as err:
        raise KubeUnavailableError(f"API server unreachable: {err}") from err


def _status_message(err: ApiException) -> str:
    """The message of the Status the server sent (it names the field and the rule broken), on one
    line; the HTTP reason when there is none."""
    try:
        message = json.loads(err.body or "").get("message")
    except (ValueError, AttributeError):
        message = None
    return " ".join(str(message).split()) if message else str(err.reason)


class KubeConfigError(ValueError):
    """No usable client configuration: a setup error, reported once, not retried."""


def _check_kubeconfig_files(kubeconfig: str) -> None:
    """The client library reads a kubeconfig (a list of files, like KUBECONFIG) without checking
    that it is YAML or a mapping, and fails with a traceback where it is not."""
    paths = [Path(name) for name in kubeconfig.split(os.pathsep) if name]
    if not any(path.exists() for path in paths):  # the library would only say "No configuration found"
        raise YamlFileError("no such file")
    for path in paths:
        if path.exists() and not isinstance(load_yaml(path) or {}, dict):
            raise YamlFileError(f"{path} is not a kubeconfig (a mapping of clusters, users, contexts)")


def slice_field_selector(driver: str, node: str) -> str:
    return f"spec.driver={driver},spec.nodeName={node}"


class ClientKubeApi:
    """KubeApi over the official `kubernetes` client, returning the server's JSON untouched."""

    def __init__(self, kubeconfig: str | None, timeout_s: float = 10.0) -> None:
        configuration = kubernetes.client.Configuration()
        try:
            if kubeconfig:
                _check_kubeconfig_files(kubeconfig)
                kubernetes.config.load_kube_config(config_file=kubeconfig, client_configuration=configuration)
            else:
                kubernetes.config.load_incluster_config(client_configuration=configuration)
        except (kubernetes.config.ConfigException, OSError, YamlFileError) as err:
            where = kubeconfig or "the in-cluster service account (no --kubeconfig given)"
            raise KubeConfigError(
                f"cannot load the Kubernetes client configuration from {where}: {err}; "
                "give a working kubeconfig (--kubeconfig, KUBECONFIG)"
            ) from err
        configuration.retries = False
        self._client = kubernetes.client.ApiClient(configuration)
        self._timeout = timeout_s
        self._watches: set[urllib3.BaseHTTPResponse] = set()

    # Made at their first call: importing the client's API classes takes most of a second, which a
    # plugin starting up would spend before kubelet can register it.
    @functools.cached_property
    def _resource(self) -> kubernetes.client.ResourceV1Api:
        return kubernetes.client.ResourceV1Api(self._client)

    @functools.cached_property
    def _core(self) -> kubernetes.client.CoreV1Api:
        return kubernetes.client.CoreV1Api(self._client)

    def _call(self, method: Any, *args: Any, **kwargs: Any) -> Any:
        with translated_errors():
            response = method(*args, _preload_content=False, _request_timeout=self._timeout, **kwargs)
        data = response.data
        return json.loads(data) if data else None

    def close(self) -> None:
        """Close the connections; a watch blocked on one returns at once."""
        for response in list(self._watches):
            response.shutdown()
        self._client.close()

    def get_claim(self, namespace: str, name: str) -> JsonObject:
        return self._call(self._resource.read_namespaced_resource_claim, name, namespace)

    def write_claim_device_status(
        self,
        namespace: str,
        name: str,
        uid: str,
        replaced: Callable[[DeviceKey], bool],
        entries: list[JsonObject],
        field_manager: str,
    ) -> None:
        """Make the claim's status.devices entries for which `replaced` holds exactly `entries`:
        one GET and one PUT of the status, both in protobuf, so that every other byte of the claim
        goes back as stored (claim_protobuf.py says why JSON cannot). The PUT carries the
        resourceVersion read: a concurrent writer makes it fail with ConflictError, never lose its
        change. NotFoundError: the claim is gone or was re-created (another UID)."""
        path = f"/apis/resource.k8s.io/v1/namespaces/{namespace}/resourceclaims/{name}"
        body = self._protobuf("GET", path)
        claim = claim_protobuf.unwrap(body)
        found = claim_protobuf.identity(claim)
        if found.uid != uid:
            raise NotFoundError(f"{namespace}/{name} was re-created (uid {found.uid}, not {uid})")
        edited = claim_protobuf.rewrap(body, claim_protobuf.with_devices(claim, replaced, entries))
        try:
            self._protobuf("PUT", f"{path}/status", edited, fieldManager=field_manager)
        except RefusedError as err:
            err.resource_version = found.resource_version
            raise

    def _protobuf(self, method: str, path: str, body: bytes | None = None, **query: str) -> bytes:
        """A request in the API server's protobuf encoding. The client's generated methods would
        turn a body into JSON; a bytes body with a non-JSON content type goes out as it is. Errors
        come back as JSON, whose message says what was refused."""
        headers = {"Accept": claim_protobuf.CONTENT_TYPE if method == "GET" else "application/json"}
        if body is not None:
            headers["Content-Type"] = claim_protobuf.CONTENT_TYPE
        with translated_errors():
            request = self._client.param_serialize(
                method=method,
                resource_path=path,
                query_params=list(query.items()),
                header_params=headers,
                body=body,
                auth_settings=["BearerToken"],
            )
            response = self._client.call_api(*request, _request_timeout=self._timeout)
            data = response.read()
            if not 200 <= response.status <= 299:
                raise ApiException(http_resp=response)
        return data

    def create_event(self, namespace: str, event: JsonObject) -> JsonObject:
        return self._call(self._core.create_namespaced_event, namespace, event)

    def get_node(self, name: str) -> JsonObject:
        return self._call(self._core.read_node, name)

    def annotate_pod(self, namespace: str, name: str, uid: str, annotations: dict[str, str]) -> None:
        """Set these annotations on the pod of this UID (a JSON merge patch: nothing else changes;
        the UID in it is a precondition, so a pod re-created under the name is left alone:
        ConflictError)."""
        body = {"metadata": {"uid": uid, "annotations": annotations}}
        self._call(self._core.patch_namespaced_pod, name, namespace, body, _content_type="application/merge-patch+json")

    def list_slices(self, driver: str, node: str) -> tuple[list[JsonObject], str]:
        result = self._call(self._resource.list_resource_slice, field_selector=slice_field_selector(driver, node))
        return result.get("items") or [], result["metadata"].get("resourceVersion", "")

    def list_driver_slices(self, driver: str) -> list[JsonObject]:
        """Every node's slices of `driver`."""
        return self._call(self._resource.list_resource_slice, field_selector=f"spec.driver={driver}").get("items") or []

    def list_all_claims(self, from_cache: bool = False) -> list[JsonObject]:
        """Every claim; `from_cache`: as the API server's watch cache has them (resourceVersion 0:
        possibly a moment old, but no read of etcd), for a list every node makes at once."""
        version = {"resource_version": "0"} if from_cache else {}
        return self._call(self._resource.list_resource_claim_for_all_namespaces, **version).get("items") or []

    def create_slice(self, body: JsonObject) -> JsonObject:
        return self._call(self._resource.create_resource_slice, body)

    def replace_slice(self, name: str, body: JsonObject) -> JsonObject:
        return self._call(self._resource.replace_resource_slice, name, body)

    def delete_slice(self, name: str) -> None:
        with contextlib.suppress(NotFoundError):
            self._call(self._resource.delete_resource_slice, name)

    def watch_slices(
        self, driver: str, node: str, resource_version: str, timeout_s: int
    ) -> Iterator[tuple[str, JsonObject]]:
        selector = slice_field_selector(driver, node)
        return self._watch(self._resource.list_resource_slice, resource_version, timeout_s, field_selector=selector)

    def _watch(
        self, lister: Any, resource_version: str, timeout_s: int, **selectors: Any
    ) -> Iterator[tuple[str, JsonObject]]:
        """(type, object) events of a watch through `lister`; close() ends it at once."""
        with translated_errors():
            response = lister(
                resource_version=resource_version,
                timeout_seconds=timeout_s,
                watch=True,
                _preload_content=False,
                **selectors,
            )
        self._watches.add(response)
        try:
            with translated_errors():
                for line in iter_resp_lines(response):
                    if line.strip():
                        event = json.loads(line)
                        yield event["type"], event["object"]
        finally:
            self._watches.discard(response)
            response.release_conn()
