"""`fgpu webhook`'s flags -> WebhookSettings (driver/admission/settings.py). Bad values as a user
gives them (one line, exit 2): tests/unit/cli/test_bad_input.py; which settings go together:
test_admission_certs.py."""

import pytest

from driver.admission.lifetimes import Lifetimes
from driver.admission.settings import WebhookSettings, add_webhook_flags, webhook_settings
from driver.common.flags import FlagParser, SettingsError


def settings(*argv: str) -> WebhookSettings:
    parser = FlagParser(prog="fgpu webhook")
    add_webhook_flags(parser)
    return webhook_settings(parser.parse_args(argv))


def test_self_managed_certificates_name_the_service_and_renew_in_time(monkeypatch):
    monkeypatch.setenv("POD_NAMESPACE", "fgpu-system")
    got = settings("--tls-secret=certs", "--service-name=hook", "--extra-san=10.0.0.1", "--cert-validity=1h",
                   "--cert-renew-before=20s", "--gate-pods")  # fmt: skip
    assert (got.port, got.tls_secret, got.namespace, got.gate_pods) == (8443, "certs", "fgpu-system", True)
    assert got.hosts == ("hook", "hook.fgpu-system", "hook.fgpu-system.svc", "10.0.0.1")
    assert got.lifetimes == Lifetimes(3600, 20, 87600 * 3600)
    assert got.check_interval_s == 5.0  # a quarter of the renewal margin
    got.check()


def test_a_port_the_webhook_cannot_serve_on_is_refused():
    with pytest.raises(SettingsError, match=r"^--port 0: the webhook needs a port \(1-65535\)$"):
        settings("--port=0")


def test_the_toleration_of_nodes_kept_for_gpu_pods_is_a_taint_key_checked_at_start():
    got = settings("--tls-secret=certs", "--namespace=n", "--service-name=hook",
                   "--gpu-pods-toleration=gpu.fgpu.dev/gpu-pods-only")  # fmt: skip
    assert (got.gate_pods, got.gpu_pods_toleration) == (False, "gpu.fgpu.dev/gpu-pods-only")
    assert settings("--tls-secret=certs").gpu_pods_toleration == ""
    with pytest.raises(SettingsError, match=r"^--gpu-pods-toleration 'a/b/c': not a taint key"):
        settings("--gpu-pods-toleration=a/b/c")
