"""``bench/gpu_e2e.py --squeeze``: another tenant squeezes the device while both stages sleep, and
a stage larger than what is left is asked Active: no WakeUp, a status that says why, a wake once
the tenant leaves."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from bench.gpu_e2e_analysis import MiB
from bench.gpu_e2e_cluster import stage_status, wait_states

GPU_E2E = Path(__file__).resolve().parent / "gpu_e2e.py"
"""Run as the tenant: ``gpu_e2e.py ballast BYTES READY``."""
Json = dict[str, Any]


def _patch_state(cp: Any, ns: str, stage: str, state: str) -> None:
    cp.kubectl("patch", "omnistage", stage, "-n", ns, "--type=merge",
               "-p", json.dumps({"spec": {"state": state}}))  # fmt: skip


def _free_bytes(index: int = 0) -> int:
    import pynvml

    pynvml.nvmlInit()
    return int(pynvml.nvmlDeviceGetMemoryInfo(pynvml.nvmlDeviceGetHandleByIndex(index)).free)


def squeeze(cp: Any, ns: str, work: Path, args: argparse.Namespace) -> Json:
    """Both stages asleep, another tenant takes the device until ``--squeeze-free`` bytes are
    free, then ``llm`` (larger than that) is patched Active: it must get no WakeUp, and its
    status must say why with the figures (device, free, needed, other tenants) within one
    round; once the tenant leaves it wakes."""
    out: Json = {"target_free_bytes": args.squeeze_free}
    _patch_state(cp, ns, "llm", "Asleep")
    wait_states(cp, ns, {"llm": "Asleep", "sd": "Asleep"}, 120)
    before = stage_status(cp, ns, "llm").get("lastAck") or {}
    tenant_bytes = _free_bytes() - args.squeeze_free - 640 * MiB  # its own context
    ready = work / "tenant.ready"
    ready.unlink(missing_ok=True)
    tenant = subprocess.Popen([sys.executable, str(GPU_E2E), "ballast",
                               str(tenant_bytes), str(ready)])  # fmt: skip
    try:
        deadline = time.monotonic() + 120
        while not ready.exists():
            if tenant.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError("the tenant did not start")
            time.sleep(0.1)
        time.sleep(0.5)
        out["tenant_bytes"] = tenant_bytes
        out["free_with_tenant_bytes"] = _free_bytes()
        t0 = time.monotonic()
        _patch_state(cp, ns, "llm", "Active")
        seen: Json = {}
        while time.monotonic() - t0 < args.squeeze_hold:
            st = stage_status(cp, ns, "llm")
            if (
                "reason_s" not in out
                and st.get("waitReason")
                and any("other tenants" in e for e in st.get("waitingFor") or ())
            ):
                out["reason_s"] = round(time.monotonic() - t0, 3)
                seen = st
            time.sleep(0.1)
        held = stage_status(cp, ns, "llm")
        ack = held.get("lastAck") or {}
        out["no_wake_while_squeezed"] = ack.get("taskId") == before.get("taskId")
        out["state_while_squeezed"] = held.get("state")
        out["status_when_reason_seen"] = {
            k: seen.get(k) for k in ("state", "waitReason", "waitingFor", "conditions")
        }
        events = cp.get_json("events", namespace=ns)
        out["waiting_events"] = [
            e.get("message") for e in events.get("items", [])
            if e.get("reason") == "Waiting" and e["involvedObject"].get("name") == "llm"
        ]  # fmt: skip
    finally:
        tenant.terminate()
        tenant.wait(30)
    t1 = time.monotonic()
    wait_states(cp, ns, {"llm": "Active"}, 120)
    out["active_after_tenant_left_s"] = round(time.monotonic() - t1, 3)
    woke = stage_status(cp, ns, "llm").get("lastAck") or {}
    out["woke_ok"] = bool(woke.get("op") == "wake" and woke.get("ok"))
    out["ok"] = bool(out.get("reason_s") is not None and out["no_wake_while_squeezed"]
                     and out["woke_ok"])  # fmt: skip
    return out
