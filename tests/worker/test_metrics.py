"""A real ``omnistage-worker`` process: its Prometheus endpoint scraped over HTTP after real
requests (gRPC, streamed gRPC, HTTP, refused ones) and a sleep and wake-up; its JSON logs."""

from __future__ import annotations

import json
import re
import time
from pathlib import Path

import grpc
import httpx
from prometheus_client.parser import text_string_to_metric_families

from omnistage.worker.v1 import inference_service_pb2, types_pb2
from omnistage_worker.metrics import EXPORTED
from tests.worker.cli_process import Subprocess, spawn  # noqa: F401  (fixture)
from tests.worker.conftest import WorkerHandle, rpc_error, wait_for

Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]


def scrape(port: int) -> tuple[Samples, set[str]]:
    """Every sample (name and sorted labels -> value) and the family names of one scrape."""
    text = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=10).text
    samples: Samples = {}
    families = set()
    for family in text_string_to_metric_families(text):
        if family.name.endswith("_created"):
            continue  # prometheus_client's creation times of counters and histograms
        families.add(family.name + ("_total" if family.type == "counter" else ""))
        for s in family.samples:
            samples[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return samples, families


def value(samples: Samples, name: str, **labels: str) -> float:
    return samples.get((name, tuple(sorted(labels.items()))), 0.0)


def logged_port(log: Path, what: str, within: float = 60.0) -> int:
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        match = re.search(rf"{what} on [\d.]+:(\d+)", log.read_text())
        if match:
            return int(match.group(1))
        time.sleep(0.05)
    raise AssertionError(f"no {what!r} line:\n{log.read_text()}")


GENERATE = "omnistage.worker.v1.InferenceService/Generate"
STREAM = "omnistage.worker.v1.InferenceService/GenerateStream"


async def test_scraped_worker_and_json_logs(
    lm_dir: Path,
    tmp_path: Path,
    spawn: list[Subprocess],  # noqa: F811
) -> None:
    log = tmp_path / "worker.log"
    proc = Subprocess(
        [
            *("--runner", "ar", "--backend", "transformers", "--model", str(lm_dir)),
            *("--host", "127.0.0.1", "--port", "0", "--http-port", "0", "--metrics-port", "0"),
            *("--stage", "writer", "--pod", "writer-0", "--log-format", "json"),
            *("--max-batch", "4"),
        ],
        log,
    )
    spawn.append(proc)
    port = proc.port()
    metrics_port = logged_port(log, "Prometheus metrics")
    http_port = logged_port(log, "OpenAI-compatible HTTP")
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}")
    # WorkerHandle only needs a channel here (its server field is not used).
    w = WorkerHandle(None, channel)  # type: ignore[arg-type]
    try:

        async def active() -> bool:
            try:
                return (await w.status()).state == types_pb2.WORKER_STATE_ACTIVE
            except grpc.aio.AioRpcError:
                return False

        await wait_for(active, within=120, what="the worker to load")
        samples, _ = scrape(metrics_port)
        assert value(samples, "omnistage_worker_state", state="ACTIVE") == 1
        assert value(samples, "omnistage_worker_state", state="ASLEEP") == 0

        tokens = 0
        for i in range(3):
            r = await w.generate(prompt=f"the cat {i}", max_new_tokens=5, request_id=f"g{i}")
            tokens += r.usage.completion_tokens
        request = inference_service_pb2.GenerateStreamRequest(
            request=inference_service_pb2.GenerateRequest(prompt="a dog", max_new_tokens=4)
        )
        async for m in w.inference_stub.GenerateStream(request):
            if m.HasField("done"):
                tokens += m.done.usage.completion_tokens
        await rpc_error(w.generate(prompt="", max_new_tokens=0, num_inference_steps=-1))
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{http_port}") as http:
            ok = await http.post(
                "/v1/completions", json={"model": "writer", "prompt": "hi", "max_tokens": 3}
            )
            assert ok.status_code == 200, ok.text
            tokens += ok.json()["usage"]["completion_tokens"]
            bad = await http.post("/v1/completions", json={"model": "writer", "max_tokens": 3})
            assert bad.status_code == 400
            assert (await http.get("/no/such/path")).status_code == 404

        slept = await w.sleep(1)
        assert slept.ok, slept.error
        refused = await rpc_error(w.generate(prompt="asleep", max_new_tokens=2))
        asleep, _ = scrape(metrics_port)
        woke = await w.wake()
        assert woke.ok, woke.error
        samples, families = scrape(metrics_port)
        status = await w.status()
    finally:
        await channel.close()

    # Every family the worker exports is named in EXPORTED (the chart's check relies on it).
    assert families == EXPORTED, families ^ EXPORTED

    # Requests by protocol, route and status: answers, refusals and unknown paths.
    requests = "omnistage_worker_requests_total"
    assert value(samples, requests, protocol="grpc", route=GENERATE, status="OK") == 3
    assert value(samples, requests, protocol="grpc", route=STREAM, status="OK") == 1
    assert value(samples, requests, protocol="grpc", route=GENERATE, status="INVALID_ARGUMENT") == 1
    refused_code = refused.code().name
    assert refused_code == "FAILED_PRECONDITION"
    assert value(samples, requests, protocol="grpc", route=GENERATE, status=refused_code) == 1
    assert value(samples, requests, protocol="http", route="/v1/completions", status="200") == 1
    assert value(samples, requests, protocol="http", route="/v1/completions", status="400") == 1
    assert value(samples, requests, protocol="http", route="other", status="404") == 1
    sleep_route = "omnistage.worker.v1.SleepService/Sleep"
    assert value(samples, requests, protocol="grpc", route=sleep_route, status="OK") == 1
    seconds = "omnistage_worker_request_seconds_count"
    assert value(samples, seconds, protocol="grpc", route=GENERATE) == 5

    # What the model did: tokens, one batch size and model time per served request, the time
    # to first token of the two streamed ones (gRPC stream; HTTP non-streamed is not timed).
    assert tokens > 0
    assert value(samples, "omnistage_worker_generated_tokens_total") == tokens
    assert value(samples, "omnistage_worker_prompt_tokens_total") > 0
    assert value(samples, "omnistage_worker_batch_size_count") == 5
    assert value(samples, "omnistage_worker_batch_size_bucket", le="+Inf") == 5
    assert value(samples, "omnistage_worker_generate_seconds_count") == 5
    assert value(samples, "omnistage_worker_time_to_first_token_seconds_count") == 1

    # The sleep and the wake-up: counted, timed, and the last Ack's freed bytes.
    transitions = "omnistage_worker_transitions_total"
    assert value(samples, transitions, operation="sleep", result="ok") == 1
    assert value(samples, transitions, operation="wake_up", result="ok") == 1
    assert value(samples, "omnistage_worker_transition_seconds_count", operation="sleep") == 1
    assert value(asleep, "omnistage_worker_state", state="ASLEEP") == 1
    assert value(asleep, "omnistage_worker_sleep_level") == 1
    freed = "omnistage_worker_last_ack_freed_bytes"
    assert value(asleep, freed, operation="OPERATION_SLEEP") == slept.freed_bytes > 0
    assert value(samples, freed, operation="OPERATION_WAKE_UP") == woke.freed_bytes < 0

    # Device memory as GetStatus measures it (the worker is idle: the same figures).
    used = sum(
        v for (name, _), v in samples.items() if name == "omnistage_worker_device_memory_used_bytes"
    )
    assert used == status.used_bytes > 0
    assert value(samples, "omnistage_worker_state", state="ACTIVE") == 1
    info = [k for k in samples if k[0] == "omnistage_worker_info"]
    assert dict(info[0][1])["stage"] == "writer"

    # JSON logs: every line one object with the fields, the ack line with its task id.
    lines = [json.loads(line) for line in log.read_text().splitlines() if line.strip()]
    for line in lines:
        assert {"time", "level", "logger", "message"} <= line.keys(), line
        assert line["stage"] == "writer" and line["pod"] == "writer-0"
    acks = [line for line in lines if line["message"].startswith("ack ")]
    assert [a["task_id"] for a in acks] == [slept.task_id, woke.task_id]
    assert acks[0]["operation"] == "sleep" and acks[0]["epoch"] == 0
    assert any(line["level"] == "INFO" and "listening on" in line["message"] for line in lines)


def test_metrics_port_refused(tmp_path: Path, lm_dir: Path) -> None:
    from tests.worker.cli_process import run_cli

    done = run_cli(
        *("--runner", "ar", "--backend", "transformers", "--model", str(lm_dir)),
        *("--port", "50051", "--metrics-port", "50051"),
    )
    assert done.returncode == 2
    assert "--metrics-port" in done.stderr
