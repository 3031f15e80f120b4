"""What one status write of an OmniStage costs the API server, against a ConfigMap's.

In bench/scale.py's storms the API server is the stack's largest CPU user (about 16 ms per
request of a 200-stage hand-over storm). This isolates one kind of request: on a fresh control
plane (no controller-manager, no other client, no watch), ``--writes`` sequential merge patches
of an OmniStage's status (a hand-over's usual status: state, four conditions, pod, node, last
ACK; one field changed each time), of a ConfigMap carrying that status as data, and reads of the
OmniStage; the API server's CPU seconds per request (psutil). Variants of the CRD: as shipped,
without its CEL rules (all, or the root's rule on the name alone, or all but that one), with
``status``, ``spec`` or both unvalidated objects (no schema), and the shipped CRD with the stage
carrying kopf's ``last-handled-configuration`` annotation (its spec again), to tell apart what
the cost comes from. ``--only NAME...`` runs some of them.

    .venv/bin/python bench/scale_crd_cost.py [--writes 300] [--out bench/results/X.json]
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import shlex
import sys
import time
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import httpx
import psutil
import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.scale_storms import stage  # noqa: E402
from tests.cluster.controlplane import ControlPlane  # noqa: E402
from tests.cluster.kubeconfig import auth_context, load_kubeconfig  # noqa: E402

CRD = ROOT / "crds" / "omnistages.omnistage.io.yaml"
CONDITIONS = ("Ready", "Asleep", "MemoryReleased", "Admitted")
STATUS: dict[str, Any] = {
    "state": "Asleep",
    "conditions": [
        {
            "type": t,
            "status": "True",
            "reason": "Slept",
            "message": "slept on hand-over h1",
            "lastTransitionTime": "2026-11-28T18:00:00Z",
            "observedGeneration": 1,
        }
        for t in CONDITIONS
    ],
    "pod": "s-worker",
    "node": "sim-0",
    "lastAck": {"taskId": "h1-s-sleep1", "ok": True, "durationSeconds": 0.1},
}


def _strip_cel(obj: Any) -> Any:
    if isinstance(obj, dict):
        obj.pop("x-kubernetes-validations", None)
        for value in obj.values():
            _strip_cel(value)
    elif isinstance(obj, list):
        for value in obj:
            _strip_cel(value)
    return obj


def _root(crd: dict[str, Any]) -> dict[str, Any]:
    schema: dict[str, Any] = crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
    return schema


def variants() -> dict[str, dict[str, Any]]:
    """The CRD as shipped, without CEL rules, without the root's rule alone (the name's), with
    only the root's rule, and with an unvalidated status."""
    shipped = yaml.safe_load(CRD.read_text())
    no_cel = _strip_cel(copy.deepcopy(shipped))
    no_root_rule = copy.deepcopy(shipped)
    _root(no_root_rule).pop("x-kubernetes-validations", None)
    root_rule_only = _strip_cel(copy.deepcopy(shipped))
    _root(root_rule_only)["x-kubernetes-validations"] = _root(shipped)["x-kubernetes-validations"]
    open_status = copy.deepcopy(shipped)
    for version in open_status["spec"]["versions"]:
        props = version["schema"]["openAPIV3Schema"]["properties"]
        props["status"] = {"type": "object", "x-kubernetes-preserve-unknown-fields": True}
    open_spec = copy.deepcopy(shipped)
    _root(open_spec).pop("x-kubernetes-validations", None)
    props = _root(open_spec)["properties"]
    props["spec"] = {"type": "object", "x-kubernetes-preserve-unknown-fields": True}
    for version in open_spec["spec"]["versions"]:  # they name fields of the spec's schema
        version.pop("selectableFields", None)
    open_both = copy.deepcopy(open_spec)
    _root(open_both)["properties"]["status"] = {
        "type": "object",
        "x-kubernetes-preserve-unknown-fields": True,
    }
    return {
        "shipped": shipped,
        "no_cel": no_cel,
        "no_root_rule": no_root_rule,
        "root_rule_only": root_rule_only,
        "status_unvalidated": open_status,
        "spec_unvalidated": open_spec,
        "unvalidated": open_both,
    }


def settle(cpu: Callable[[], float], within_s: float = 60.0) -> None:
    """Wait until the API server is idle (under 5% of a core over a second): a new CRD's OpenAPI
    is rebuilt in the background after it is established."""
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        before = cpu()
        time.sleep(1.0)
        if cpu() - before < 0.05:
            return


def measure(crd: dict[str, Any], writes: int, annotated: bool = False) -> dict[str, float]:
    """API server CPU ms per request of each kind, on a fresh control plane; ``annotated``:
    the stage carries kopf's last-handled configuration (its spec again, as an annotation)."""
    with ControlPlane(controller_manager=False) as cp:
        cp.apply(crd)
        cp.wait_crd_established("omnistages.omnistage.io")
        ns = cp.create_namespace("cost")
        auth = load_kubeconfig(cp.kubeconfig)
        proc = psutil.Process(cp.pid("kube-apiserver"))

        def cpu() -> float:
            t = proc.cpu_times()
            return float(t.user + t.system)

        merge = {"Content-Type": "application/merge-patch+json"}
        stages = f"/apis/omnistage.io/v1alpha1/namespaces/{ns}/omnistages"
        maps = f"/api/v1/namespaces/{ns}/configmaps"
        out: dict[str, float] = {}
        with httpx.Client(base_url=auth.server, verify=auth_context(auth), timeout=30) as http:
            body = stage("s", "g", "sim-0", model_dir="/tmp", state="Asleep", env={})
            if annotated:
                handled = json.dumps({"spec": body["spec"]}, separators=(",", ":")) + "\n"
                body["metadata"]["annotations"] = {
                    "omnistage.io/last-handled-configuration": handled
                }
            http.post(stages, json=body).raise_for_status()
            cm = {"metadata": {"name": "c"}, "data": {"status": json.dumps(STATUS)}}
            http.post(maps, json=cm).raise_for_status()

            def timed(label: str, call: Callable[[int], httpx.Response]) -> None:
                before = cpu()
                for i in range(writes):
                    call(i).raise_for_status()
                out[label] = round((cpu() - before) / writes * 1000, 2)

            def status_patch(i: int) -> httpx.Response:
                patch = {"status": {**STATUS, "pod": f"s-worker-{i}"}}
                return http.patch(f"{stages}/s/status", content=json.dumps(patch), headers=merge)

            def configmap_patch(i: int) -> httpx.Response:
                data = {"data": {"status": json.dumps({**STATUS, "pod": f"s-worker-{i}"})}}
                return http.patch(f"{maps}/c", content=json.dumps(data), headers=merge)

            settle(cpu)
            timed("configmap_patch_ms", configmap_patch)
            timed("omnistage_status_patch_ms", status_patch)
            timed("omnistage_get_ms", lambda i: http.get(f"{stages}/s"))
            timed("configmap_patch_again_ms", configmap_patch)
        # Against the ConfigMap's writes on either side (the load moves while a variant runs).
        either = (out["configmap_patch_ms"] + out["configmap_patch_again_ms"]) / 2
        out["status_patch_over_configmap"] = round(out["omnistage_status_patch_ms"] / either, 2)
        return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--writes", type=int, default=300)
    p.add_argument("--only", nargs="*", help="these variants only (default: all)")
    p.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "scale_crd_cost.json")
    args = p.parse_args()
    load = os.getloadavg()
    runs = {}
    shipped = variants()["shipped"]
    plan = [(name, crd, False) for name, crd in variants().items()]
    plan.append(("shipped_annotated", shipped, True))
    for name, crd, annotated in plan:
        if args.only and name not in args.only:
            continue
        runs[name] = measure(crd, args.writes, annotated)
        print(f"[crd-cost] {name}: {runs[name]}", flush=True)
    result = {
        "benchmark": "scale_crd_cost",
        "command": " ".join(shlex.quote(a) for a in [".venv/bin/python", *sys.argv]),
        "date": datetime.now(UTC).isoformat(timespec="seconds"),
        "load_avg_at_start": [round(x, 2) for x in load],
        "load_avg_at_end": [round(x, 2) for x in os.getloadavg()],
        "cpus": os.cpu_count(),
        "writes": args.writes,
        "api_server_cpu_per_request": runs,
    }
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
