"""The local demo (``make demo``): two tiny CPU stages hand one fake GPU back and forth.

It starts a real Kubernetes control plane (kube-apiserver, etcd, scheduler, controller-manager of
v1.36.3, built and cached by ``python -m tests.cluster.build``), one localnode GPU node whose
single fake GPU fits only one of the two stages at a time, and the real ``omnistage-operator``.
It builds the tiny models from configs (nothing downloaded), applies ``examples/cpu/*.yaml`` and
shows, with ``kubectl get omnistages``:

1. the Active stage (``tiny-llama``) holding the GPU and the other asleep;
2. a switch: ``tiny-diffusion`` is patched Active and ``tiny-llama`` Asleep; the operator puts
   the llama to sleep, and wakes the diffusion stage only after the sleep ACK, whose measured
   figures land in status;
3. a priority pre-emption: ``tiny-llama`` (priority 10) asks again and takes the GPU back from
   ``tiny-diffusion`` (priority 5), which waits;
4. traffic wakes a stage: ``tiny-llama`` becomes ``activation.policy: OnDemand`` and Asleep, so
   ``tiny-diffusion`` gets the GPU; an OpenAI ``/v1/completions`` request to the sleeping llama
   is held by its worker, the operator puts the diffusion stage to sleep, wakes the llama after
   the ACK, and the held request is answered.

``--keep`` leaves everything running (prints ``export KUBECONFIG=...``) until Ctrl-C.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tests.cluster.controlplane import ControlPlane  # noqa: E402
from tests.cluster.localnode import LocalNodes  # noqa: E402
from tests.cluster.procs import free_port  # noqa: E402
from tests.worker.tiny_models import build_causal_lm, build_diffusion_pipeline  # noqa: E402

MODELS = Path("/tmp/omnistage-demo/models")
NAMESPACE = "omnistage-demo"
# One fake GPU: the tiny diffusion pipeline (~1 MiB of float32 weights) fits alone, not beside
# the tiny llama; the examples' vram.request values say the same before the first measurement.
GPU_MEMORY = 1_100_000
WAKE_MARGIN = 16 * 1024


def say(text: str) -> None:
    print(f"\n\033[1m== {text}\033[0m", flush=True)


def wait_for(what: str, check: Callable[[], bool], timeout: float = 180.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if check():
            return
        time.sleep(0.2)
    raise SystemExit(f"demo: timed out after {timeout:.0f}s waiting for {what}")


def build_models() -> None:
    builders: dict[str, Callable[[Path], object]] = {
        "tiny-llama": build_causal_lm,
        "tiny-diffusion": build_diffusion_pipeline,
    }
    for name, build in builders.items():
        target = MODELS / name
        if not (target / "model_index.json").exists() and not (target / "config.json").exists():
            print(f"building {name} from a config into {target}", flush=True)
            build(target)


class Demo:
    def __init__(self, cp: ControlPlane, workdir: Path) -> None:
        self.cp = cp
        self.workdir = workdir
        self.operator: subprocess.Popen[bytes] | None = None

    def kubectl(self, *args: str) -> str:
        return self.cp.kubectl(*args, "-n", NAMESPACE).stdout

    def show(self) -> None:
        print(self.kubectl("get", "omnistages", "-o", "wide"), end="", flush=True)

    def state(self, name: str) -> str:
        data: dict[str, Any] = self.cp.get_json("omnistage", name, namespace=NAMESPACE)
        return str((data.get("status") or {}).get("state", ""))

    def patch(self, name: str, state: str) -> None:
        body = f'{{"spec":{{"state":"{state}"}}}}'
        print(f"$ kubectl patch ost {name} --type merge -p '{body}'", flush=True)
        self.kubectl("patch", "omnistage", name, "--type=merge", "-p", body)

    def on_demand_pod(self, name: str) -> str | None:
        """The IP of the stage's OnDemand worker pod once the stage is Asleep, else None."""
        if self.state(name) != "Asleep":
            return None
        res = self.cp.kubectl(
            "get", "pod", f"{name}-worker", "-n", NAMESPACE, "-o", "json", check=False
        )
        if res.returncode != 0:
            return None  # replaced: the new pod is not there yet
        pod = json.loads(res.stdout)
        args = pod["spec"]["containers"][0].get("args", [])
        ip = (pod.get("status") or {}).get("podIP")
        return str(ip) if "--activation" in args and ip else None

    def start_operator(self) -> None:
        token = self.workdir / "token"
        token.write_text("demo-worker-token")
        env = {**os.environ, "KUBECONFIG": str(self.cp.kubeconfig), "PYTHONUNBUFFERED": "1"}
        argv = [
            str(Path(sys.executable).parent / "omnistage-operator"),
            f"--namespace={NAMESPACE}",
            f"--worker-token-file={token}",
            f"--wake-margin-bytes={WAKE_MARGIN}",
            f"--metrics-port={free_port()}",
            f"--liveness-port={free_port()}",
        ]
        log = (self.workdir / "operator.log").open("wb")
        self.operator = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, env=env)
        print(f"operator started (log: {self.workdir / 'operator.log'})", flush=True)

    def stop_operator(self) -> None:
        if self.operator is not None and self.operator.poll() is None:
            self.operator.send_signal(signal.SIGTERM)
            try:
                self.operator.wait(20)
            except subprocess.TimeoutExpired:
                self.operator.kill()

    def order(self, slept: str, woke: str) -> str:
        """The hand-over's order, from the workers' own ACK timestamps and task ids: the wake
        after the sleep's ACK (serial), or beside the sleep it replaced (overlapped: it took
        only memory the sleep had reported released)."""
        sleep = self.cp.get_json("omnistage", slept, namespace=NAMESPACE)["status"]["lastAck"]
        wake = self.cp.get_json("omnistage", woke, namespace=NAMESPACE)["status"]["lastAck"]
        hid = str(sleep.get("taskId", "")).partition(f"-{slept}-sleep")[0]
        if str(sleep.get("taskId", "")).endswith("-overlapped") and str(
            wake.get("taskId", "")
        ).startswith(f"{hid}-{woke}-wake-beside"):
            return (
                f"order: {woke}'s wake started at {wake['startedAt']} beside {slept}'s sleep "
                f"(ACK at {sleep['time']}), under a limit raised by each release it reported"
            )
        verdict = "before" if sleep["time"] < wake["startedAt"] else "NOT before"
        return (
            f"order: {slept}'s sleep ACK finished at {sleep['time']}, {verdict} {woke}'s wake "
            f"started at {wake['startedAt']}"
        )

    def last_ack(self, name: str) -> str:
        status = self.cp.get_json("omnistage", name, namespace=NAMESPACE).get("status") or {}
        ack = status.get("lastAck") or {}
        return (
            f"{name}: lastAck op={ack.get('op')} ok={ack.get('ok')} level={ack.get('level')} "
            f"freed={ack.get('freed')} in {ack.get('durationSeconds')}s at {ack.get('time')}"
        )


def on_demand(demo: Demo) -> None:
    """Step 4: a request to a sleeping OnDemand stage is held and served after the wake."""
    say("on demand: tiny-llama becomes OnDemand and Asleep; tiny-diffusion gets the GPU")
    body = '{"spec":{"state":"Asleep","activation":{"policy":"OnDemand","holdTimeout":"60s"}}}'
    print(f"$ kubectl patch ost tiny-llama --type merge -p '{body}'", flush=True)
    demo.kubectl("patch", "omnistage", "tiny-llama", "--type=merge", "-p", body)
    wait_for("tiny-diffusion Active", lambda: demo.state("tiny-diffusion") == "Active")
    wait_for("tiny-llama Asleep (new pod)", lambda: demo.on_demand_pod("tiny-llama") is not None)
    demo.show()
    url = f"http://{demo.on_demand_pod('tiny-llama')}:8000/v1/completions"
    request = {"model": "tiny-llama", "prompt": "the cat", "max_tokens": 4}
    say("a request to the sleeping tiny-llama is held until the operator wakes it")
    print(f"$ curl {url} -d '{json.dumps(request)}'", flush=True)
    started = time.monotonic()
    http = urllib.request.Request(
        url, data=json.dumps(request).encode(), headers={"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(http, timeout=120) as resp:
        answer = json.loads(resp.read())
        held_ms = float(resp.headers.get("x-omnistage-held-ms", "0"))
    took = time.monotonic() - started
    print(json.dumps(answer["choices"][0]), flush=True)
    print(
        f"held request served after a wake: held {held_ms:.0f} ms, answered in {took:.2f} s",
        flush=True,
    )
    wait_for("tiny-llama Active", lambda: demo.state("tiny-llama") == "Active")
    demo.show()
    status = demo.cp.get_json("omnistage", "tiny-llama", namespace=NAMESPACE)["status"]
    print(f"tiny-llama: awakeReason={status.get('awakeReason')} demand={status.get('demand')}")
    print(demo.last_ack("tiny-diffusion"))
    print(demo.last_ack("tiny-llama"))
    print(demo.order("tiny-diffusion", "tiny-llama"))


def run(keep: bool) -> None:
    build_models()
    workdir = Path(tempfile.mkdtemp(prefix="omnistage-demo-"))
    say("starting the local control plane (real kube-apiserver, etcd, scheduler)")
    with ControlPlane() as cp, LocalNodes(cp.kubeconfig, nodes=1, gpus=1, gpu_memory=GPU_MEMORY):
        demo = Demo(cp, workdir)
        cp.kubectl("apply", "--server-side", "-f", str(ROOT / "crds"))
        cp.wait_crd_established("omnistages.omnistage.io")
        cp.kubectl("create", "namespace", NAMESPACE)
        demo.start_operator()
        try:
            say("kubectl apply -f examples/cpu/  (one fake GPU that fits one stage at a time)")
            print(demo.kubectl("apply", "-f", str(ROOT / "examples" / "cpu")), end="")
            wait_for("tiny-llama Active", lambda: demo.state("tiny-llama") == "Active")
            wait_for("tiny-diffusion Asleep", lambda: demo.state("tiny-diffusion") == "Asleep")
            demo.show()

            say("switch: tiny-diffusion Active, tiny-llama Asleep")
            demo.patch("tiny-diffusion", "Active")
            demo.patch("tiny-llama", "Asleep")
            wait_for("tiny-diffusion Active", lambda: demo.state("tiny-diffusion") == "Active")
            demo.show()
            print(demo.last_ack("tiny-llama"))
            print(demo.last_ack("tiny-diffusion"))
            print(demo.order("tiny-llama", "tiny-diffusion"))

            say("pre-emption: tiny-llama (priority 10) asks again; tiny-diffusion (5) must yield")
            demo.patch("tiny-llama", "Active")
            wait_for("tiny-llama Active", lambda: demo.state("tiny-llama") == "Active")
            wait_for("tiny-diffusion Waiting", lambda: demo.state("tiny-diffusion") == "Waiting")
            demo.show()
            print(demo.last_ack("tiny-diffusion"))
            print(demo.last_ack("tiny-llama"))
            print(demo.order("tiny-diffusion", "tiny-llama"))
            on_demand(demo)
            say("kubectl get events --field-selector involvedObject.kind=OmniStage")
            events = demo.kubectl(
                "get",
                "events",
                "--field-selector=involvedObject.kind=OmniStage",
                "--sort-by=.lastTimestamp",
            )
            print(events.rstrip())
            say("done: every wake above followed the other stage's measured sleep ACK")
            if keep:
                print(f"export KUBECONFIG={cp.kubeconfig}   # Ctrl-C to stop", flush=True)
                signal.sigwait({signal.SIGINT, signal.SIGTERM})
        finally:
            demo.stop_operator()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--keep", action="store_true", help="keep the cluster running at the end")
    run(parser.parse_args().keep)


if __name__ == "__main__":
    main()
