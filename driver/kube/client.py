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
import urllib.parse
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any, Protocol

import kubernetes
import urllib3
from kubernetes.client.exceptions import ApiException
from kubernetes.watch.watch import iter_resp_lines

from driver.common.yamlfile import YamlFileError, load_yaml
from driver.kube import claim_protobuf
from driver.kube.claim_protobuf import DeviceKey
from driver.kube.errors import (
    ConflictError,
    KubeConfigError,
    KubeUnavailableError,
    NotFoundError,
    RefusedError,
    TooManyRequestsError,
)

JsonObject = dict[str, Any]


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
    def get_pod(self, namespace: str, name: str) -> JsonObject: ...
    def get_configmap(self, namespace: str, name: str) -> JsonObject: ...
    def create_configmap(self, namespace: str, body: JsonObject) -> JsonObject: ...
    def replace_configmap(self, namespace: str, name: str, body: JsonObject) -> JsonObject: ...
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


def _check_kubeconfig_files(kubeconfig: str) -> None:
    """The client library reads a kubeconfig (a list of files, like KUBECONFIG) without checking
    that it is YAML or a mapping, and fails with a traceback where it is not."""
    paths = [Path(name) for name in kubeconfig.split(os.pathsep) if name]
    if not any(path.exists() for path in paths):  # the library would only say "No configuration found"
        raise YamlFileError("no such file")
    for path in paths:
        if path.exists() and not isinstance(load_yaml(path) or {}, dict):
            raise YamlFileError(f"{path} is not a kubeconfig (a mapping of clusters, users, contexts)")


def _selected(label_selector: str) -> list[tuple[str, str]]:
    return [("labelSelector", label_selector)] if label_selector else []


def _kind_path(kind: str, namespace: str) -> str:
    """Where the objects of `kind` are listed: a namespaced kind's in `namespace`."""
    return KIND_PATHS[kind].replace("{namespace}", urllib.parse.quote(namespace, safe=""))


def slice_field_selector(driver: str, node: str) -> str:
    return f"spec.driver={driver},spec.nodeName={node}"


RESOURCE_V1 = "/apis/resource.k8s.io/v1"
CORE_V1 = "/api/v1"
JSON = "application/json"
# What list_pages and watch read, by the names the informers give them.
KIND_PATHS = {
    "slices": RESOURCE_V1 + "/resourceslices",
    "classes": RESOURCE_V1 + "/deviceclasses",
    "claims": RESOURCE_V1 + "/resourceclaims",
    "templates": RESOURCE_V1 + "/resourceclaimtemplates",
    "pods": CORE_V1 + "/pods",
    "nodes": CORE_V1 + "/nodes",
    "namespaces": CORE_V1 + "/namespaces",  # those whose pods the controller places (--place-pods)
    "podgroups": "/apis/scheduling.k8s.io/v1beta1/podgroups",  # Kubernetes 1.37+
    "ledgers": CORE_V1 + "/namespaces/{namespace}/configmaps",
    "configmaps": CORE_V1 + "/namespaces/{namespace}/configmaps",  # the usage histories (driver/sizing/store.py)
}


class ClientKubeApi:
    """KubeApi over the official `kubernetes` client, returning the server's JSON untouched."""

    def __init__(self, kubeconfig: str | None, timeout_s: float = 10.0, connections: int | None = None) -> None:
        """`connections`: how many requests go out at once (threads), each on a connection of its
        own; urllib3 drops what its pool cannot keep (a warning each time) and connects again."""
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
        if connections is not None:
            configuration.connection_pool_maxsize = connections
        self._client = kubernetes.client.ApiClient(configuration)
        self._timeout = timeout_s
        self._watches: set[urllib3.BaseHTTPResponse] = set()

    # Made at their first call, for subclasses (the controller's): importing the client's API classes
    # takes most of a second and 25 MiB (CoreV1Api alone 20), which the node plugin spends on none of
    # them: its requests below name their paths (_json), as kubectl's do.
    @functools.cached_property
    def _resource(self) -> kubernetes.client.ResourceV1Api:
        return kubernetes.client.ResourceV1Api(self._client)

    @functools.cached_property
    def _core(self) -> kubernetes.client.CoreV1Api:
        return kubernetes.client.CoreV1Api(self._client)

    def _call(self, method: Any, *args: Any, **kwargs: Any) -> Any:
        with translated_errors():  # the body too: a connection lost while it is read is an outage
            data = method(*args, _preload_content=False, _request_timeout=self._timeout, **kwargs).data
        return json.loads(data) if data else None

    def _send(
        self,
        method: str,
        path: str,
        headers: dict[str, str],
        body: Any = None,
        query: Sequence[tuple[str, Any]] = (),
        timeout_s: float | None = None,
        **path_params: str,
    ) -> urllib3.BaseHTTPResponse:
        """One request through the client's configuration (server, credentials, TLS), as its
        generated methods send it (`path_params` quoted into the {placeholders} of `path`): the
        response unread (a watch streams), ApiException for a status outside 2xx. The caller
        translates errors."""
        request = self._client.param_serialize(
            method=method,
            resource_path=path,
            path_params=path_params or None,
            query_params=list(query),
            header_params=headers,
            body=body,
            auth_settings=["BearerToken"],
        )
        response = self._client.call_api(*request, _request_timeout=timeout_s)
        if not 200 <= response.status <= 299:
            response.read()
            raise ApiException(http_resp=response)
        return response.response

    def _json(
        self,
        method: str,
        path: str,
        body: JsonObject | None = None,
        query: Sequence[tuple[str, Any]] = (),
        content_type: str = JSON,
        **path_params: str,
    ) -> Any:
        """A JSON request and its decoded answer (None for an empty one)."""
        headers = {"Accept": JSON, **({"Content-Type": content_type} if body is not None else {})}
        with translated_errors():
            data = self._send(method, path, headers, body, query, self._timeout, **path_params).data
        return json.loads(data) if data else None

    def close(self) -> None:
        """Close the connections; a watch blocked on one returns at once."""
        for response in list(self._watches):
            response.shutdown()
        self._client.close()

    def get_claim(self, namespace: str, name: str) -> JsonObject:
        path = RESOURCE_V1 + "/namespaces/{namespace}/resourceclaims/{name}"
        return self._json("GET", path, namespace=namespace, name=name)

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
        headers = {"Accept": claim_protobuf.CONTENT_TYPE if method == "GET" else JSON}
        if body is not None:
            headers["Content-Type"] = claim_protobuf.CONTENT_TYPE
        with translated_errors():
            return self._send(method, path, headers, body, list(query.items()), self._timeout).data

    def create_event(self, namespace: str, event: JsonObject) -> JsonObject:
        return self._json("POST", CORE_V1 + "/namespaces/{namespace}/events", event, namespace=namespace)

    def get_node(self, name: str) -> JsonObject:
        return self._json("GET", CORE_V1 + "/nodes/{name}", name=name)

    def annotate_pod(self, namespace: str, name: str, uid: str, annotations: dict[str, str]) -> None:
        """Set these annotations on the pod of this UID (a JSON merge patch: nothing else changes;
        the UID in it is a precondition, so a pod re-created under the name is left alone:
        ConflictError)."""
        body = {"metadata": {"uid": uid, "annotations": annotations}}
        path = CORE_V1 + "/namespaces/{namespace}/pods/{name}"
        self._json("PATCH", path, body, content_type="application/merge-patch+json", namespace=namespace, name=name)

    def get_pod(self, namespace: str, name: str) -> JsonObject:
        return self._json("GET", CORE_V1 + "/namespaces/{namespace}/pods/{name}", namespace=namespace, name=name)

    def get_configmap(self, namespace: str, name: str) -> JsonObject:
        path = CORE_V1 + "/namespaces/{namespace}/configmaps/{name}"
        return self._json("GET", path, namespace=namespace, name=name)

    def create_configmap(self, namespace: str, body: JsonObject) -> JsonObject:
        return self._json("POST", CORE_V1 + "/namespaces/{namespace}/configmaps", body, namespace=namespace)

    def replace_configmap(self, namespace: str, name: str, body: JsonObject) -> JsonObject:
        """A PUT without a resourceVersion: the last writer wins (the usage history has one writer
        per object, its node's plugin)."""
        path = CORE_V1 + "/namespaces/{namespace}/configmaps/{name}"
        return self._json("PUT", path, body, namespace=namespace, name=name)

    def list_configmaps(self, namespace: str, label_selector: str = "") -> list[JsonObject]:
        """Every ConfigMap in the namespace (that the selector selects), page by page."""
        return [item for items, _ in self.list_pages("configmaps", label_selector, namespace) for item in items]

    def list_slices(self, driver: str, node: str) -> tuple[list[JsonObject], str]:
        query = [("fieldSelector", slice_field_selector(driver, node))]
        result = self._json("GET", RESOURCE_V1 + "/resourceslices", query=query)
        return result.get("items") or [], result["metadata"].get("resourceVersion", "")

    def list_driver_slices(self, driver: str) -> list[JsonObject]:
        """Every node's slices of `driver`."""
        query = [("fieldSelector", f"spec.driver={driver}")]
        return self._json("GET", RESOURCE_V1 + "/resourceslices", query=query).get("items") or []

    def list_all_claims(self, from_cache: bool = False) -> list[JsonObject]:
        """Every claim; `from_cache`: as the API server's watch cache has them (resourceVersion 0:
        possibly a moment old, but no read of etcd), for a list every node makes at once."""
        query = [("resourceVersion", "0")] if from_cache else []
        return self._json("GET", RESOURCE_V1 + "/resourceclaims", query=query).get("items") or []

    def create_slice(self, body: JsonObject) -> JsonObject:
        return self._json("POST", RESOURCE_V1 + "/resourceslices", body)

    def replace_slice(self, name: str, body: JsonObject) -> JsonObject:
        return self._json("PUT", RESOURCE_V1 + "/resourceslices/{name}", body, name=name)

    def delete_slice(self, name: str) -> None:
        with contextlib.suppress(NotFoundError):
            self._json("DELETE", RESOURCE_V1 + "/resourceslices/{name}", name=name)

    def watch_slices(
        self, driver: str, node: str, resource_version: str, timeout_s: int
    ) -> Iterator[tuple[str, JsonObject]]:
        query = [
            ("fieldSelector", slice_field_selector(driver, node)),
            ("resourceVersion", resource_version),
            ("timeoutSeconds", timeout_s),
            ("watch", True),
        ]
        # No read timeout, as the client's watches have none: the server ends it after timeout_s.
        return self._events(
            functools.partial(self._send, "GET", RESOURCE_V1 + "/resourceslices", {"Accept": JSON}, None, query)
        )

    def list_pages(
        self, kind: str, label_selector: str = "", namespace: str = "", limit: int = 500
    ) -> Iterator[tuple[list[JsonObject], str]]:
        """(items, resourceVersion) of the objects of `kind` (KIND_PATHS) page by page: one
        consistent list, `limit` objects at a time (an expired continue token ends it with an
        error: the informer lists again)."""
        token = ""
        while True:
            query = [("limit", limit), *_selected(label_selector), *([("continue", token)] if token else [])]
            result = self._json("GET", _kind_path(kind, namespace), query=query)
            yield result.get("items") or [], result["metadata"].get("resourceVersion", "")
            token = result["metadata"].get("continue") or ""
            if not token:
                return

    def watch(
        self, kind: str, resource_version: str, timeout_s: int, label_selector: str = "", namespace: str = ""
    ) -> Iterator[tuple[str, JsonObject]]:
        """(type, object) events of the objects of `kind` from `resource_version`, bookmarks
        included, until the server ends the watch after `timeout_s`; close() ends it at once."""
        query = [
            *_selected(label_selector),
            ("resourceVersion", resource_version),
            ("timeoutSeconds", timeout_s),
            ("allowWatchBookmarks", True),
            ("watch", True),
        ]
        send = functools.partial(self._send, "GET", _kind_path(kind, namespace), {"Accept": JSON}, None, query)
        return self._events(send)

    def _events(self, opened: Callable[[], Any]) -> Iterator[tuple[str, JsonObject]]:
        """(type, object) events of the watch response `opened` returns (opened at the first
        next()); close() ends it at once."""
        with translated_errors():
            response = opened()
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
