"""Pods that test reachability on the real node, from the operator image (it has Python).

``stand_in(node, labels)``: a stage pod stand-in serving a TCP greeting on the worker's HTTP
and gRPC ports (what a NetworkPolicy sees of the 5.5 GB worker: its labels and ports).
``probe(node, name, labels, target, ports, window)``: a pod that connects to each port until
the greeting comes back or ``window`` seconds pass, and exits writing ``port=outcome`` pairs to
its termination message (``open``; ``timeout``: the SYN was dropped, as a policy refuses;
``closed``: reset, nothing listening). :func:`outcomes` reads them back. Both run under the
restricted Pod Security Standard.
"""

from __future__ import annotations

from typing import Any

from tests.node.images import IMAGES

OPERATOR = IMAGES["operator"]
HTTP_PORT = 8000
GRPC_PORT = 50051

_SERVE = """
import socketserver, sys, threading
class Greet(socketserver.BaseRequestHandler):
    def handle(self):
        self.request.sendall(b"ok\\n")
for port in sys.argv[1:]:
    server = socketserver.ThreadingTCPServer(("0.0.0.0", int(port)), Greet)
    threading.Thread(target=server.serve_forever, daemon=True).start()
print("serving", *sys.argv[1:], flush=True)
threading.Event().wait()
"""

_PROBE = """
import socket, sys, threading, time
target, window, ports = sys.argv[1], float(sys.argv[2]), sys.argv[3:]
deadline = time.monotonic() + window
found = {}
def probe(port):
    outcome = "timeout"
    while time.monotonic() < deadline:
        try:
            with socket.create_connection((target, int(port)), timeout=2) as conn:
                conn.settimeout(2)
                if conn.recv(8).startswith(b"ok"):
                    outcome = "open"
                    break
        except ConnectionRefusedError:
            outcome = "closed"
        except OSError:
            outcome = "timeout"
        time.sleep(0.2)
    found[port] = outcome
threads = [threading.Thread(target=probe, args=(p,)) for p in ports]
for t in threads:
    t.start()
for t in threads:
    t.join()
with open("/dev/termination-log", "w") as out:
    out.write(" ".join(f"{p}={found[p]}" for p in ports))
"""


def _pod(
    node: str, name: str, labels: dict[str, str], command: list[str], restart: str
) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "labels": labels},
        "spec": {
            "nodeSelector": {"kubernetes.io/hostname": node},
            "restartPolicy": restart,
            "automountServiceAccountToken": False,
            "terminationGracePeriodSeconds": 1,
            "securityContext": {"runAsNonRoot": True, "seccompProfile": {"type": "RuntimeDefault"}},
            "containers": [
                {
                    "name": "main",
                    "image": OPERATOR.ref,
                    "imagePullPolicy": "Never",
                    "command": command,
                    "securityContext": {
                        "allowPrivilegeEscalation": False,
                        "readOnlyRootFilesystem": True,
                        "capabilities": {"drop": ["ALL"]},
                    },
                }
            ],
        },
    }


def stand_in(node: str, name: str, labels: dict[str, str]) -> dict[str, Any]:
    """A pod serving a greeting on the worker's HTTP and gRPC ports."""
    ports = [str(HTTP_PORT), str(GRPC_PORT)]
    return _pod(node, name, labels, ["python3", "-u", "-c", _SERVE, *ports], "Always")


def probe(
    node: str, name: str, labels: dict[str, str], target: str, *, ports: list[int], window: float
) -> dict[str, Any]:
    """A pod that tries ``ports`` of ``target`` for ``window`` seconds and reports."""
    argv = ["python3", "-c", _PROBE, target, str(window), *map(str, ports)]
    return _pod(node, name, labels, argv, "Never")


def outcomes(message: str) -> dict[int, str]:
    """``{port: outcome}`` from a probe's termination message."""
    pairs = (item.split("=", 1) for item in message.split())
    return {int(port): outcome for port, outcome in pairs}
