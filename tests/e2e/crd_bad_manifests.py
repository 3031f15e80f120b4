"""The bad manifests the API server must refuse: each a small change to a good one, with the
substrings its refusal must contain (the field, then why); test_crd_validation applies them."""

from __future__ import annotations

from tests.e2e.crd_stage import Mutation, _drop, _set, _vllm

# (id, mutation, substrings the refusal must contain: the field, then why)
BAD: list[tuple[str, Mutation, tuple[str, ...]]] = [
    ("wrong-runner-enum", _set("spec.runner", "GAN"), ("spec.runner", "Unsupported value")),
    ("wrong-state-enum", _set("spec.state", "Sleeping"), ("spec.state", "Unsupported value")),
    ("missing-image", _drop("spec.image"), ("spec.image", "Required value")),
    ("missing-colocation", _drop("spec.colocation"), ("spec.colocation", "Required value")),
    ("missing-model-path", _set("spec.model", {}), ("spec.model.path", "Required value")),
    (
        "priority-out-of-range",
        _set("spec.colocation.priority", 5000),
        ("spec.colocation.priority", "less than or equal to 1000"),
    ),
    ("sleep-level-3", _set("spec.sleepLevel", 3), ("spec.sleepLevel", "less than or equal to 2")),
    (
        "sleep-level-0",
        _set("spec.sleepLevel", 0),
        ("spec.sleepLevel", "greater than or equal to 1"),
    ),
    ("port-too-low", _set("spec.worker.port", 80), ("spec.worker.port", "greater than or equal")),
    ("port-too-high", _set("spec.worker.port", 70000), ("spec.worker.port", "less than or equal")),
    ("gpus-over-8", _set("spec.gpus", 9), ("spec.gpus", "less than or equal to 8")),
    (
        "diffusion-with-transformers",
        _set("spec.runner", "Diffusion"),
        ("spec.backend", "runner Diffusion needs backend Diffusers"),
    ),
    (
        "ar-with-diffusers",
        _set("spec.backend", "Diffusers"),
        ("spec.backend", "runner AR needs backend Transformers or VLLM"),
    ),
    (
        "explicit-without-devices",
        _set("spec.placement", {"mode": "Explicit", "nodeName": "gpu-node-1"}),
        ("spec.placement.devices", "needs at least one device"),
    ),
    (
        "explicit-without-node",
        _set("spec.placement", {"mode": "Explicit", "devices": ["0"]}),
        ("spec.placement.nodeName", "is required when spec.placement.mode is Explicit"),
    ),
    (
        "bad-group-name",
        _set("spec.colocation.group", "Bad_Group"),
        ("spec.colocation.group", "should match"),
    ),
    ("bad-vram-quantity", _set("spec.vram.request", "16GB"), ("spec.vram.request", "should match")),
    ("zero-vram", _set("spec.vram.request", "0"), ("spec.vram.request", "positive quantity")),
    (
        "unknown-field-strict",
        _set("spec.colour", "blue"),
        ('unknown field "spec.colour"',),
    ),
    (
        "relative-model-path",
        _set("spec.model.path", "models/x"),
        ("spec.model.path", "should match"),
    ),
    (
        "model-path-outside-mount",
        _set("spec.model", {"path": "/data/x", "volume": {"emptyDir": {}}}),
        ("spec.model.path", "must be under spec.model.mountPath"),
    ),
    (
        "reserved-worker-flag",
        _set("spec.worker.args", ["--port=1"]),
        ("spec.worker.args", "must not set, or abbreviate, a flag the operator"),
    ),
    (
        "reserved-env",
        _set("spec.template.env", [{"name": "POD_IP", "value": "1.2.3.4"}]),
        ("spec.template.env[0].name", "must not set a variable the operator sets"),
    ),
    (
        "reserved-label",
        _set("spec.template.labels", {"omnistage.io/group": "other"}),
        ("spec.template.labels", "set by the operator"),
    ),
    (
        "name-too-long",
        _set("metadata.name", "s" * 57),
        ("metadata.name", "at most 56 characters"),
    ),
    ("bad-dtype", _set("spec.worker.dtype", "int4"), ("spec.worker.dtype", "Unsupported value")),
    ("missing-runner", _drop("spec.runner"), ("spec.runner", "Required value")),
    ("missing-model", _drop("spec.model"), ("spec.model", "Required value")),
    ("missing-group", _set("spec.colocation", {}), ("spec.colocation.group", "Required value")),
    ("sleep-level-string", _set("spec.sleepLevel", "1"), ("spec.sleepLevel", "integer")),
    (
        "placement-mode-enum",
        _set("spec.placement.mode", "Static"),
        ("spec.placement.mode", "Unsupported value"),
    ),
    (
        "repeated-device",
        _set("spec.placement", {"mode": "Explicit", "nodeName": "n", "devices": ["0", "0"]}),
        ("spec.placement.devices[1]", "Duplicate value"),
    ),
    (
        "worker-device-enum",
        _set("spec.worker.device", "tpu"),
        ("spec.worker.device", "Unsupported value"),
    ),
    (
        "reserved-drain-timeout-flag",
        _set("spec.worker.args", ["--drain-timeout=5"]),
        ("spec.worker.args", "--drain-timeout, --activation, --hold-timeout, --http-port"),
    ),
    (
        "reserved-activation-flag",
        _set("spec.worker.args", ["--activation=ondemand"]),
        ("spec.worker.args", "sets from the spec"),
    ),
    ("args-not-a-list", _set("spec.worker.args", "--x"), ("spec.worker.args", "array")),
    (
        "drain-timeout-0",
        _set("spec.drainTimeoutSeconds", 0),
        ("spec.drainTimeoutSeconds", "greater than or equal to 1"),
    ),
    (
        "drain-timeout-over-a-day",
        _set("spec.drainTimeoutSeconds", 86401),
        ("spec.drainTimeoutSeconds", "less than or equal to 86400"),
    ),
    (
        "env-without-name",
        _set("spec.template.env", [{"value": "x"}]),
        ("spec.template.env[0].name", "Required value"),
    ),
    (
        "reserved-volume-name",
        _set("spec.template.volumes", [{"name": "model", "emptyDir": {}}]),
        ("spec.template.volumes[0].name", "the operator's own volumes"),
    ),
    (
        "claims-in-template-resources",
        _set("spec.template.resources", {"claims": [{"name": "x"}]}),
        ('unknown field "spec.template.resources.claims"',),
    ),
    (
        "node-selector-not-string",
        _set("spec.template.nodeSelector", {"a": 1}),
        ("spec.template.nodeSelector.a", "string"),
    ),
    (
        "model-mount-over-token",
        _set("spec.model.mountPath", "/var/run/secrets/omnistage"),
        ("spec.model.mountPath", "must not be under /var/run/secrets/omnistage"),
    ),
    (
        "model-path-in-sibling-of-mount",
        _set("spec.model", {"path": "/models2/x", "volume": {"emptyDir": {}}}),
        ("spec.model.path", "must be under spec.model.mountPath"),
    ),
    ("name-upper-case", _set("metadata.name", "Has-Upper"), ("metadata.name", "DNS-1035")),
    ("name-digit-first", _set("metadata.name", "9lives"), ("metadata.name", "DNS-1035")),
    (
        "activation-policy-enum",
        _set("spec.activation", {"policy": "Lazy"}),
        ("spec.activation.policy", "Unsupported value"),
    ),
    (
        "activation-idle-after-on-manual",
        _set("spec.activation", {"idleAfter": "5m"}),
        ("spec.activation", "apply only to policy OnDemand"),
    ),
    (
        "activation-duration-format",
        _set("spec.activation", {"policy": "OnDemand", "holdTimeout": "5 minutes"}),
        ("spec.activation.holdTimeout", "should match"),
    ),
    (
        "activation-hold-timeout-too-short",
        _set("spec.activation", {"policy": "OnDemand", "holdTimeout": "10ms"}),
        ("spec.activation.holdTimeout", "must be between 100ms and 1h"),
    ),
    (
        "activation-idle-after-too-long",
        _set("spec.activation", {"policy": "OnDemand", "idleAfter": "200h"}),
        ("spec.activation.idleAfter", "must be between 1s and 168h"),
    ),
    (
        "http-port-equals-grpc-port",
        _set("spec.worker", {"port": 8000, "httpPort": 8000}),
        ("spec.worker.httpPort", "must differ from spec.worker.port"),
    ),
    (
        "metrics-port-equals-http-port",
        _set("spec.worker", {"httpPort": 9000, "metricsPort": 9000}),
        ("spec.worker.metricsPort", "must differ from spec.worker.port and httpPort"),
    ),
    (
        "vllm-block-on-transformers",
        _set("spec.vllm", {"enforceEager": True}),
        ("spec.vllm", "is for backend VLLM only"),
    ),
    (
        "vllm-utilization-zero",
        _vllm({"gpuMemoryUtilization": 0}),
        ("spec.vllm.gpuMemoryUtilization", "greater than 0"),
    ),
    (
        "vllm-utilization-over-one",
        _vllm({"gpuMemoryUtilization": 1.5}),
        ("spec.vllm.gpuMemoryUtilization", "less than or equal to 1"),
    ),
    (
        "vllm-max-model-len-zero",
        _vllm({"maxModelLen": 0}),
        ("spec.vllm.maxModelLen", "greater than or equal to 1"),
    ),
    (
        "vllm-max-num-seqs-zero",
        _vllm({"maxNumSeqs": 0}),
        ("spec.vllm.maxNumSeqs", "greater than or equal to 1"),
    ),
    (
        "vllm-kv-cache-dtype-unknown",
        _vllm({"kvCacheDtype": "int3"}),
        ("spec.vllm.kvCacheDtype", "Unsupported value"),
    ),
    (
        "vllm-prefix-caching-not-bool",
        _vllm({"enablePrefixCaching": "yes"}),
        ("spec.vllm.enablePrefixCaching", "boolean"),
    ),
    (
        "vllm-tensor-parallel-size-not-gpus",
        _vllm({"tensorParallelSize": 2}),
        ("spec.vllm.tensorParallelSize", "must equal spec.gpus"),
    ),
    (
        "vllm-auto-tool-choice-without-parser",
        _vllm({"enableAutoToolChoice": True}),
        ("spec.vllm.toolCallParser", "is required when spec.vllm.enableAutoToolChoice"),
    ),
    (
        "vllm-tool-parser-without-auto-tool-choice",
        _vllm({"toolCallParser": "hermes"}),
        ("spec.vllm.toolCallParser", "needs spec.vllm.enableAutoToolChoice true"),
    ),
    (
        "vllm-tool-parser-not-a-name",
        _vllm({"enableAutoToolChoice": True, "toolCallParser": "hermes; rm -rf"}),
        ("spec.vllm.toolCallParser", "should match"),
    ),
    (
        "vllm-reasoning-parser-too-long",
        _vllm({"reasoningParser": "r" * 65}),
        ("spec.vllm.reasoningParser", "Too long"),
    ),
    (
        "vllm-chat-template-relative",
        _vllm({"chatTemplate": "templates/chat.jinja"}),
        ("spec.vllm.chatTemplate", "should match"),
    ),
    (
        "vllm-no-flag-in-worker-args",
        _set("spec.worker.args", ["--no-vllm-enable-prefix-caching"]),
        ("spec.worker.args", "--vllm-*"),
    ),
    (
        "vllm-unknown-engine-arg",
        _vllm({"swapSpace": 4}),
        ('unknown field "spec.vllm.swapSpace"',),
    ),
    (
        "vllm-flag-in-worker-args",
        _set("spec.worker.args", ["--vllm-max-model-len=9"]),
        ("spec.worker.args", "--vllm-*"),
    ),
    # Issue 19: every flag that could bypass the gate, exact or abbreviated (argparse would take
    # "--gpu 1" for "--gpus 1"), with or without "=value", and the variables that choose the
    # worker's devices or its memory probe.
    *[
        (
            f"gate-flag-{i}",
            _set("spec.worker.args", ["--sequential", *args]),
            ("spec.worker.args", "must not set, or abbreviate", "--gpus", "--residual-slack"),
        )
        for i, args in enumerate(
            [
                ["--gpus", "1"],
                ["--gpu", "1"],
                ["--gpus=2"],
                ["--g=2"],
                ["--residual-slack=1Ti"],
                ["--resid", "1Ti"],
                ["--initial-state=active"],
                ["--init=active"],
                ["--epoch=0"],
                ["--rank", "1"],
                ["--vllm-gpu-memory-utilization=0.9"],
                ["--vl=1"],
                ["--", "--gpus", "1"],
            ]
        )
    ],
    *[
        (
            f"gate-env-{name.lower().replace('_', '-')}",
            _set("spec.template.env", [{"name": "HF_HOME", "value": "/x"}, {"name": name}]),
            ("spec.template.env[1].name", "must not set a variable the operator sets"),
        )
        for name in (
            "CUDA_VISIBLE_DEVICES",
            "OMNISTAGE_GPUS",
            "OMNISTAGE_MEMORY_PROBE",
            "OMNISTAGE_DRAIN_TIMEOUT",
            "OMNISTAGE_RANK",
        )
    ],
    (
        "duplicate-volume",
        _set("spec.template.volumes", [{"name": "a", "emptyDir": {}}, {"name": "a"}]),
        ("spec.template.volumes[1]", "Duplicate value"),
    ),
]
