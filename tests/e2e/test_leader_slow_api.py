"""The leader keeps its Lease while the API server answers every renewal late (issue 24).

In the 1000-stage scale storms (bench/scale.py, 2 cores) the API server answered the operator's
Lease requests later than the retry period and than half the renew deadline, and the only
replica lost and took back its Lease 12 times. Here a real API server answers the Lease writes
late, and deterministically: its authorization chain starts with a webhook (an HTTPS server in
this test) that is asked only about updates and patches of Leases and answers each, with no
opinion, ``DELAY_S`` later; RBAC then allows them. The delay is in front of the request's
handler, where a CPU-starved or queueing API server keeps a request too.

``DELAY_S`` is more than half the renew deadline (where each request used to be cut) and too
slow for renewals that wait for each other (2 x ``DELAY_S`` + retry period > renew deadline),
but within the renew deadline less a retry period. The operator's elector, on its own thread
as in the operator (``ElectionThread``), acting as a ServiceAccount (the admin's group skips
authorization), acquires the Lease (reads and creates are not delayed) and must then hold it
for five renew deadlines of late answers: not lost once, one epoch.
"""

from __future__ import annotations

import asyncio
import json
import ssl
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import kr8s.asyncio
import pytest
import yaml

from omnistage_operator.decisions.election import Timing
from omnistage_operator.k8s.leader import Elector, KrEpochStore, KrLeaseStore, new_identity
from omnistage_operator.runtime.election_thread import ElectionThread
from tests.cluster.build import BuildError, find_binaries
from tests.cluster.controlplane import ControlPlane
from tests.cluster.pki import create_pki
from tests.e2e.conftest import wait_for

pytestmark = [pytest.mark.timeout(180), pytest.mark.cluster]

TIMING = Timing(6.0, 4.0, 0.5)  # lease, renew deadline, retry period
DELAY_S = 2.5  # > 4 / 2 and 2 x 2.5 + 0.5 > 4; < 4 - 0.5
HOLD_S = 20.0  # five renew deadlines
NAMESPACE = "slow-leases"
LEASE = "omnistage-operator"
# Only the Lease writes in NAMESPACE go to the webhook (CEL over the SubjectAccessReview).
MATCH = (
    "has(request.resourceAttributes) && request.resourceAttributes.resource == 'leases'"
    f" && request.resourceAttributes.namespace == '{NAMESPACE}'"
    " && request.resourceAttributes.verb in ['update', 'patch']"
)


class SlowAuthorizer:
    """An authorization webhook on 127.0.0.1 answering "no opinion" ``DELAY_S`` late."""

    def __init__(self, cert: Path, key: Path) -> None:
        self.asked: list[tuple[str, float]] = []  # (verb, when the question came)
        hook = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                review = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                verb = str(review["spec"]["resourceAttributes"]["verb"])
                hook.asked.append((verb, time.monotonic()))
                time.sleep(DELAY_S)
                body = json.dumps({
                    "apiVersion": "authorization.k8s.io/v1",
                    "kind": "SubjectAccessReview",
                    "status": {"allowed": False},  # no opinion: RBAC decides
                }).encode()  # fmt: skip
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, format: str, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        context.load_cert_chain(cert, key)
        self.server.socket = context.wrap_socket(self.server.socket, server_side=True)
        self.port = int(self.server.server_address[1])
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        """Stop serving."""
        self.server.shutdown()
        self.server.server_close()


def authorization_config(directory: Path, port: int, ca: Path) -> Path:
    """The API server's authorizers: the slow webhook (Lease writes only), Node, RBAC."""
    kubeconfig = directory / "slow-authz.kubeconfig"
    kubeconfig.write_text(yaml.safe_dump({
        "apiVersion": "v1", "kind": "Config", "current-context": "slow",
        "clusters": [{"name": "slow", "cluster": {
            "server": f"https://127.0.0.1:{port}/authorize", "certificate-authority": str(ca),
        }}],
        "users": [{"name": "apiserver", "user": {}}],
        "contexts": [{"name": "slow", "context": {"cluster": "slow", "user": "apiserver"}}],
    }))  # fmt: skip
    config = directory / "authorization.yaml"
    config.write_text(yaml.safe_dump({
        "apiVersion": "apiserver.config.k8s.io/v1",
        "kind": "AuthorizationConfiguration",
        "authorizers": [
            {"type": "Webhook", "name": "slow-leases", "webhook": {
                "timeout": "10s", "failurePolicy": "NoOpinion",
                "authorizedTTL": "1s", "unauthorizedTTL": "1s",
                "cacheAuthorizedRequests": False, "cacheUnauthorizedRequests": False,
                "subjectAccessReviewVersion": "v1",
                "matchConditionSubjectAccessReviewVersion": "v1",
                "connectionInfo": {"type": "KubeConfigFile", "kubeConfigFile": str(kubeconfig)},
                "matchConditions": [{"expression": MATCH}],
            }},
            {"type": "Node", "name": "node"},
            {"type": "RBAC", "name": "rbac"},
        ],
    }))  # fmt: skip
    return config


ROLE = {
    "apiVersion": "rbac.authorization.k8s.io/v1",
    "kind": "Role",
    "metadata": {"name": "elector", "namespace": NAMESPACE},
    "rules": [
        {
            "apiGroups": ["coordination.k8s.io"],
            "resources": ["leases"],
            "verbs": ["get", "create", "update", "patch"],
        },
        {"apiGroups": [""], "resources": ["configmaps"], "verbs": ["get", "create", "patch"]},
    ],
}


@pytest.fixture
def slow_plane(tmp_path: Path) -> Iterator[tuple[ControlPlane, SlowAuthorizer]]:
    """A control plane whose Lease writes in ``NAMESPACE`` wait ``DELAY_S`` for the webhook."""
    try:
        binaries = find_binaries()
    except BuildError as exc:
        pytest.fail(f"{exc}\n(build once with: python -m tests.cluster.build)", pytrace=False)
    pki = create_pki(tmp_path / "webhook-pki")
    hook = SlowAuthorizer(pki.serving_cert, pki.serving_key)
    config = authorization_config(tmp_path, hook.port, pki.ca_cert)
    try:
        with ControlPlane(
            binaries=binaries, controller_manager=False, authorization_config=config
        ) as cp:
            yield cp, hook
    finally:
        hook.close()


def test_renewals_answered_late_keep_the_lease(
    slow_plane: tuple[ControlPlane, SlowAuthorizer],
) -> None:
    cp, hook = slow_plane
    cp.kubectl("create", "namespace", NAMESPACE)
    cp.apply(ROLE)
    cp.kubectl("create", "rolebinding", "elector", "-n", NAMESPACE, "--role=elector",
               f"--serviceaccount={NAMESPACE}:elector")  # fmt: skip
    kubeconfig = cp.service_account_kubeconfig(NAMESPACE, "elector")
    acquired: list[int] = []
    lost: list[float] = []
    identity = new_identity("slow-api")

    async def build() -> Elector:
        api = await kr8s.asyncio.api(kubeconfig=str(kubeconfig))
        return Elector(
            KrLeaseStore(api, NAMESPACE, LEASE), identity, TIMING,
            on_acquired=acquired.append, on_lost=lambda: lost.append(time.monotonic()),
            epochs=KrEpochStore(api, NAMESPACE, f"{LEASE}-epoch"),
        )  # fmt: skip

    election = ElectionThread(build)
    election.start()
    try:
        wait_for("the elector leading", election.leading, 30)
        start = time.monotonic()
        while time.monotonic() - start < HOLD_S and not lost:
            time.sleep(0.05)
        assert not lost and acquired == [1], "stepped down while the renewals came late"
        late = [t for verb, t in hook.asked if verb == "patch" and t >= start]
        assert len(late) >= HOLD_S / TIMING.retry_period_s / 2, hook.asked  # the test shows it
        assert election.leading()
        lease = cp.get_json("lease", LEASE, namespace=NAMESPACE)
        assert lease["spec"]["holderIdentity"] == identity
        assert lease["spec"]["leaseTransitions"] == 1
    finally:
        asyncio.run(election.stop())
        print(f"acquired {acquired}, lost {len(lost)} time(s), asked {len(hook.asked)} times")
