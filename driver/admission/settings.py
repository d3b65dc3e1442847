"""`fgpu webhook`: its flags and environment variables -> one typed WebhookSettings (docs/admission.md);
the command that runs the webhook from them is commands.py. What every command shares (flag parsing,
environment defaults, value types) is in driver/common/flags.py."""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from pathlib import Path

from driver.admission.gpu_pods_only import taint_key
from driver.admission.lifetimes import DEFAULT_LIFETIMES, Lifetimes, duration
from driver.common.flags import DEFAULT_DRIVER_NAME, SettingsError, env_default, port


@dataclass(frozen=True)
class WebhookSettings:
    driver_name: str
    bind_address: str
    port: int
    cert_file: Path | None = None  # a certificate from files (cert-manager's or an operator's Secret) ...
    key_file: Path | None = None
    ca_file: Path | None = None  # ... and its CA, copied into the configuration's caBundle
    tls_secret: str = ""  # ... or self-managed: the Secret the webhook keeps its CA and certificate in
    namespace: str = ""
    hosts: tuple[str, ...] = ()  # the serving certificate's names (self-managed)
    lifetimes: Lifetimes = DEFAULT_LIFETIMES
    webhook_configuration: str = ""  # the ValidatingWebhookConfiguration whose caBundle it writes
    gate_pods: bool = False  # POST /mutate: the scheduling gate for pods of opt-in claims
    gpu_pods_toleration: str = ""  # POST /mutate: this taint tolerated by pods whose claims ask for our devices
    mutating_configuration: str = ""  # the MutatingWebhookConfiguration whose caBundle it writes too
    kubeconfig: str | None = None
    check_interval_s: float = 10.0
    client_ca_file: Path | None = None  # reviews answered only for a client certificate of these CAs
    rightsize_history_namespace: str = ""  # POST /rightsize: new claims sized from the histories here

    def check(self) -> None:
        """Raises ValueError naming the flags that do not go together."""
        if self.tls_secret:
            if self.cert_file or self.key_file or self.ca_file:
                raise ValueError("--tls-secret (self-managed) or --tls-cert-file/--tls-private-key-file, not both")
            if not self.namespace:
                raise ValueError("--tls-secret needs --namespace (or POD_NAMESPACE): where the Secret is")
            if not self.hosts:
                raise ValueError("--tls-secret needs --service-name or --extra-san: the names to certify")
            self.lifetimes.check()
        elif not (self.cert_file and self.key_file):
            raise ValueError("the following arguments are required: --tls-cert-file and --tls-private-key-file "
                             "(a certificate), or --tls-secret (self-managed)")  # fmt: skip
        if self.ca_file and not self.webhook_configuration:
            raise ValueError("--ca-bundle-file needs --webhook-configuration: whose caBundle to write")
        if self.mutating_configuration and not self.webhook_configuration:
            raise ValueError("--mutating-webhook-configuration needs --webhook-configuration (and a CA to write)")


def add_webhook_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--driver-name", default=env_default(DEFAULT_DRIVER_NAME, "DRIVER_NAME"),
                        help="whose opaque configs to check [DRIVER_NAME]")  # fmt: skip
    parser.add_argument("--bind-address", default="0.0.0.0", help="listen on this address")
    parser.add_argument(
        "--port", type=port, default=env_default("8443", "WEBHOOK_PORT"), help="HTTPS port [WEBHOOK_PORT]"
    )
    parser.add_argument("--tls-cert-file", type=Path, help="serving certificate (PEM), read again when it changes")
    parser.add_argument("--tls-private-key-file", type=Path, help="its private key (PEM)")
    parser.add_argument(
        "--ca-bundle-file",
        type=Path,
        help="with --tls-cert-file: the CA to write into --webhook-configuration's caBundle",
    )
    parser.add_argument(
        "--tls-secret",
        default="",
        help="self-managed: a CA and serving certificate kept in this Secret, made and renewed here",
    )
    parser.add_argument(
        "--namespace",
        default=env_default(None, "POD_NAMESPACE"),
        help="the Secret's namespace, the Service's [POD_NAMESPACE]",
    )
    parser.add_argument("--service-name", default="", help="the Service in front of the webhook: the names certified")
    parser.add_argument("--extra-san", action="append", help="another DNS name or IP address to certify (repeat)")
    parser.add_argument(
        "--webhook-configuration",
        default="",
        help="the ValidatingWebhookConfiguration whose caBundle this webhook writes",
    )
    parser.add_argument(
        "--gate-pods",
        action="store_true",
        help="POST /mutate: add the scheduling gate gpu.fgpu.dev/allocation to pods that use opt-in claims "
        "(reads claims and templates)",
    )
    parser.add_argument(
        "--gpu-pods-toleration",
        default="",
        metavar="KEY",
        help="POST /mutate: add a toleration of the NoSchedule taint KEY (any value) to pods whose claims ask for "
        "the driver's device classes, for nodes kept for pods with GPUs (reads claims and templates)",
    )
    parser.add_argument(
        "--rightsize-history-namespace",
        default="",
        help="POST /rightsize: size new claims of opted-in namespaces and templates to their workload's "
        "recommendation, from the usage histories in this namespace (reads pods, namespaces, those ConfigMaps)",
    )
    parser.add_argument(
        "--mutating-webhook-configuration",
        default="",
        help="the MutatingWebhookConfiguration whose caBundle this webhook writes too (with --webhook-configuration)",
    )
    parser.add_argument(
        "--client-ca-file",
        type=Path,
        help="answer /validate and /mutate only for a client certificate of these CAs (PEM): kube-apiserver's "
        "admission client certificate (its AdmissionConfiguration's kubeConfigFile)",
    )
    parser.add_argument("--cert-validity", type=duration, default="8760h", help="serving certificate's lifetime")
    parser.add_argument("--cert-renew-before", type=duration, default="720h", help="renew it this long before expiry")
    parser.add_argument("--ca-validity", type=duration, default="87600h", help="the self-managed CA's lifetime")
    parser.add_argument(
        "--kubeconfig",
        default=env_default(None, "KUBECONFIG"),
        help="client configuration [KUBECONFIG]; default: the pod's service account",
    )


def _toleration_key(text: str) -> str:
    try:
        return taint_key(text) if text else ""
    except ValueError as err:
        raise SettingsError(str(err)) from err


def webhook_settings(args: argparse.Namespace) -> WebhookSettings:
    """The settings `fgpu webhook`'s flags give; which of them go together is checked by
    WebhookSettings.check, when the webhook starts."""
    from driver.admission import certs  # cryptography: only for the webhook, not every `fgpu` command

    if args.port < 1:
        raise SettingsError(f"--port {args.port}: the webhook needs a port (1-65535)")
    lifetimes = Lifetimes(args.cert_validity, args.cert_renew_before, args.ca_validity)
    return WebhookSettings(
        driver_name=args.driver_name,
        bind_address=args.bind_address,
        port=args.port,
        cert_file=args.tls_cert_file,
        key_file=args.tls_private_key_file,
        ca_file=args.ca_bundle_file,
        tls_secret=args.tls_secret,
        namespace=args.namespace or "",
        hosts=certs.service_hosts(args.service_name, args.namespace or "", args.extra_san or ()),
        lifetimes=lifetimes,
        webhook_configuration=args.webhook_configuration,
        gate_pods=args.gate_pods,
        gpu_pods_toleration=_toleration_key(args.gpu_pods_toleration),
        mutating_configuration=args.mutating_webhook_configuration,
        kubeconfig=args.kubeconfig,
        client_ca_file=args.client_ca_file,
        rightsize_history_namespace=args.rightsize_history_namespace,
        # Often enough to renew in time with a margin of seconds (tests); a GET of the Secret and
        # of the configuration every 10 s at most otherwise.
        check_interval_s=max(0.5, min(10.0, lifetimes.renew_before_s / 4)),
    )
