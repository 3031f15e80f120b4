"""OmniPipeline parsing and the batch policy its stages get: held requests collect a batch
before they displace the awake stage; with room for both there is no swap."""

from __future__ import annotations

from typing import Any

import pytest

from omnistage_operator.api.activation import Activation, ActivationPolicy
from omnistage_operator.api.pipelines import (
    Batching,
    PipelineError,
    batching_for,
    parse_pipeline,
    pipeline_keys,
    router_flag,
)
from omnistage_operator.decisions.arbiter import GroupMemory, StageFacts, StageIntent, WorkerPhase
from omnistage_operator.decisions.arbiter.admission import admission_order
from omnistage_operator.decisions.arbiter.plan import plan
from omnistage_operator.decisions.ondemand import DEFERRED, Demand, DemandInput, shape_intents

GI = 1 << 30
ON = Activation(ActivationPolicy.ON_DEMAND)
A, S = WorkerPhase.ACTIVE, WorkerPhase.ASLEEP
POLICY = Batching(max_batch=8, max_wait_s=2.0)


def body(stages: list[dict[str, Any]], batching: Any = None, name: str = "qi") -> dict[str, Any]:
    spec: dict[str, Any] = {"stages": stages}
    if batching is not None:
        spec["batching"] = batching
    return {"metadata": {"name": name, "namespace": "ns"}, "spec": spec}


QI = [{"name": "enc", "passes": "Embeds"}, {"name": "dit"}]


def test_parse_pipeline_and_router_flag() -> None:
    got = parse_pipeline(body(QI, {"maxBatch": 4, "maxWait": "500ms", "minResidency": "1s"}))
    assert got.stage_names == ("enc", "dit")
    assert got.batching == Batching(4, 0.5, 1.0)
    assert router_flag(got) == "qi=enc:embeds,dit"
    assert parse_pipeline(body(QI)).batching == Batching(8, 2.0, 0.0)
    for stages, batching, field in (
        ([{"name": "dit"}], None, "spec.stages"),
        ([{"name": "enc"}, {"name": "dit"}], None, "spec.stages[0].passes"),
        ([QI[0], {"name": "dit", "passes": "Text"}], None, "spec.stages[1].passes"),
        ([QI[0], {"name": "enc"}], None, "spec.stages"),
        (QI, {"maxBatch": 0}, "spec.batching.maxBatch"),
        (QI, {"maxWait": "soon"}, "spec.batching.maxWait"),
        (QI, {"minResidency": "2h"}, "spec.batching.minResidency"),
    ):
        with pytest.raises(PipelineError) as info:
            parse_pipeline(body(stages, batching))
        assert info.value.field == field, str(info.value)


def test_index_keys_and_policy_per_stage() -> None:
    keys = pipeline_keys(body(QI), "ns")
    assert keys is not None and set(keys) == {("stage", "ns", "enc"), ("stage", "ns", "dit")}
    a = body(QI, {"maxBatch": 4, "maxWait": "3s"})
    b = body(QI, {"maxBatch": 16, "maxWait": "1s", "minResidency": "2s"}, name="other")
    broken = body([{"name": "enc"}])
    assert batching_for([a, b, broken], "ns") == Batching(4, 1.0, 2.0)
    assert batching_for([broken], "ns") is None


def shaped(held: int, oldest: float, now: float, awake_since: float = 0.0) -> Any:
    return shape_intents(
        {"enc": StageIntent("enc", False), "dit": StageIntent("dit", False)},
        {
            "enc": DemandInput(ON, A, Demand(last_request=now - 1), awake_since, batching=POLICY),
            "dit": DemandInput(ON, S, Demand(held, oldest), batching=POLICY),
        },
        now=now,
    )


def test_held_requests_collect_a_batch_before_they_displace() -> None:
    view = shaped(held=3, oldest=99.0, now=100.0)
    assert view.intents["dit"].want_active
    assert view.intents["dit"].requested_active_at == DEFERRED
    assert admission_order(view.intents) == ["enc", "dit"]  # the awake stage keeps the GPU
    assert view.recheck_at == 101.0  # the oldest's maxWait ends: look again
    full = shaped(held=8, oldest=99.0, now=100.0)
    assert admission_order(full.intents) == ["dit", "enc"]  # a full batch swaps at once
    waited = shaped(held=3, oldest=99.0, now=101.0)
    assert admission_order(waited.intents) == ["dit", "enc"]  # so does a wait past maxWait


def test_pipeline_min_residency_keeps_a_woken_stage() -> None:
    policy = Batching(max_batch=1, max_wait_s=0.0, min_residency_s=5.0)
    view = shape_intents(
        {"enc": StageIntent("enc", False), "dit": StageIntent("dit", False)},
        {
            "enc": DemandInput(ON, A, Demand(last_request=99.0), 98.0, batching=policy),
            "dit": DemandInput(ON, S, Demand(3, 99.0), batching=policy),
        },
        now=100.0,
    )
    assert admission_order(view.intents) == ["enc", "dit"]
    assert view.recheck_at == 103.0


def _plan(view: Any, free: int) -> Any:
    facts = {
        "enc": StageFacts(A, used_bytes=4 * GI, active_footprint=4 * GI),
        "dit": StageFacts(S, level=1, active_footprint=6 * GI),
    }
    return plan(view.intents, facts, GroupMemory(capacity=12 * GI, free=free))


def test_room_for_both_wakes_a_collecting_stage_without_a_swap() -> None:
    view = shaped(held=1, oldest=99.0, now=100.0)
    roomy = _plan(view, free=8 * GI)
    assert set(roomy.admitted) == {"enc", "dit"} and roomy.sleep == ()
    tight = _plan(view, free=5 * GI)
    assert tight.admitted == ("enc",) and tight.sleep == ()  # it waits for its batch
    due = _plan(shaped(held=8, oldest=99.0, now=100.0), free=5 * GI)
    assert due.admitted == ("dit",) and [s.stage for s in due.sleep] == ["enc"]


def test_status_body_names_stages_queues_and_readiness() -> None:
    from omnistage_operator.runtime.pipeline_status import StageView, status_body

    p = parse_pipeline(body(QI))
    ar, dif = ("AR", "Transformers"), ("Diffusion", "Diffusers")
    views = {"enc": StageView(A, 0, 2, "g", ar), "dit": StageView(S, 5, 0, "g", dif)}
    got = status_body(p, views, 3, 7, generation=2, now=0.0)
    assert got["stages"] == [
        {"name": "enc", "state": "Active", "heldRequests": 0, "inflightRequests": 2},
        {"name": "dit", "state": "Asleep", "heldRequests": 5, "inflightRequests": 0},
    ]
    assert (got["swaps"], got["batches"], got["observedGeneration"]) == (3, 7, 2)
    assert got["conditions"][0]["status"] == "True"
    apart = {**views, "dit": StageView(S, 0, 0, "h")}
    cond = status_body(p, apart, 0, 0, generation=1, now=0.0)["conditions"][0]
    assert (cond["status"], cond["reason"]) == ("False", "GroupsDiffer")
    gone = status_body(p, {"enc": views["enc"]}, 0, 0, generation=1, now=0.0)
    assert gone["conditions"][0]["message"] == "no OmniStage dit"

    swapped = {"enc": StageView(A, 0, 0, "g", dif), "dit": StageView(S, 0, 0, "g", ar)}
    cond = status_body(p, swapped, 0, 0, generation=1, now=0.0)["conditions"][0]
    assert (cond["status"], cond["reason"]) == ("False", "StageKindMismatch")
    assert cond["message"].startswith("enc passes Embeds: an AR Transformers stage encodes")
    vllm = {**views, "enc": StageView(A, 0, 0, "g", ("AR", "VLLM"))}
    assert (
        "not AR VLLM"
        in status_body(p, vllm, 0, 0, generation=1, now=0.0)["conditions"][0]["message"]
    )
    text = parse_pipeline(body([{"name": "enc", "passes": "Text"}, {"name": "dit"}]))
    assert status_body(text, vllm, 0, 0, generation=1, now=0.0)["conditions"][0]["status"] == "True"
