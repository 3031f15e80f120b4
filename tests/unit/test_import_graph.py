"""No import circle among the project's modules, typing-only and function-level imports included;
pure-logic modules use no I/O library and import only pure modules (README, "Code layout").

A module typed against the object that owns it (``port_listing`` against ``GroupRunner``,
``transition_acks`` against ``Worker``) is a circle in the design even when the import sits
under ``TYPE_CHECKING``; such parts are typed against a protocol of a lower module instead
(``port_host``, ``worker_parts``).
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from tests.unit.import_graph import (
    PATH_IO,
    circles,
    describe,
    import_graph,
    library_uses,
    modules_under,
    within,
)

ROOT = Path(__file__).resolve().parents[2]
SOURCES = [ROOT / "operator" / "src", ROOT / "worker_image" / "src"]

# The operator's I/O side; every other operator module is pure logic. The operator is mostly
# decisions over facts, so a new module is held to the pure rule until it is named here.
# (Full dotted names, so that a move of modules into layer packages rewrites them.)
OPERATOR_IO = {
    # reach outside the process: the API server, workers, files, the environment, metrics
    "omnistage_operator.k8s.kube",
    "omnistage_operator.k8s.http_pool",
    "omnistage_operator.k8s.aio_lane",
    "omnistage_operator.k8s.kopf_session",
    "omnistage_operator.k8s.api_session",
    "omnistage_operator.k8s.claim_slices",
    "omnistage_operator.k8s.leader",
    "omnistage_operator.k8s.lease_store",
    "omnistage_operator.k8s.claim_keeper",
    "omnistage_operator.runtime.election_thread",
    "omnistage_operator.k8s.worker_client",
    "omnistage_operator.runtime.login",
    "omnistage_operator.k8s.settings",
    "omnistage_operator.k8s.worker_credentials",
    "omnistage_operator.runtime.pipeline_status",
    "omnistage_operator.k8s.metrics",
    "omnistage_operator.k8s.gc_metrics",
    "omnistage_operator.k8s.gc_policy",
    "omnistage_operator.runtime.stage_metrics",
    "omnistage_operator.cli",
    "omnistage_operator.runtime.handlers",
    "omnistage_operator.runtime.diffbase",
    # drive rounds over those: loops, a round's port and its two sides, status writes
    "omnistage_operator.runtime.runner",
    "omnistage_operator.runtime.group_loops",
    "omnistage_operator.runtime.group_forget",
    "omnistage_operator.k8s.group_claims",
    "omnistage_operator.runtime.round_memory",
    "omnistage_operator.runtime.publisher",
    "omnistage_operator.runtime.claim_gate",
    "omnistage_operator.runtime.demand_watch",
    "omnistage_operator.k8s.port",
    "omnistage_operator.k8s.port_facts",
    "omnistage_operator.k8s.port_listing",
    "omnistage_operator.k8s.port_orders",
    "omnistage_operator.k8s.port_host",
}
# The worker's pure logic; every other worker module may do I/O. The worker is a process
# around a model on a device, so its decisions and parsers are the named few.
WORKER_PURE = {
    "omnistage_worker.control.transitions",
    "omnistage_worker.control.oom",
    "omnistage_worker.limits",
    "omnistage_worker.serving.image_usage",
    "omnistage_worker.serving.pipeline_def",
    "omnistage_worker.quantities",
    "omnistage_worker.dtype_choices",
    "omnistage_worker.token_review_settings",
    "omnistage_worker.serving.openai_api",
    "omnistage_worker.serving.openai_answers",
    "omnistage_worker.serving.vllm_fields",
    "omnistage_worker.engine.layout",
    "omnistage_worker.memory.base",
    "omnistage_worker.runners.chunk_hop",
    "omnistage_worker.runners.decode_policy",
}
# What pure logic must not use: network and cluster clients, servers, processes, files and the
# environment, exported metrics, and the device and model libraries. gRPC status codes are
# values a decision returns (the right status for a refusal), so ``grpc.StatusCode`` is allowed.
IO_LIBRARIES = (
    "kr8s",
    "kopf",
    "grpc",
    "grpc_health",
    "httpx",
    "aiohttp",
    "requests",
    "urllib.request",
    "http.client",
    "socket",
    "ssl",
    "subprocess",
    "asyncio.subprocess",
    "asyncio.create_subprocess_exec",
    "asyncio.create_subprocess_shell",
    "os",
    "open",
    *(f"pathlib.Path.{method}" for method in sorted(PATH_IO)),
    "shutil",
    "tempfile",
    "mmap",
    "signal",
    "uvicorn",
    "starlette",
    "prometheus_client",
    "torch",
    "pynvml",
    "vllm",
    "transformers",
    "diffusers",
    "safetensors",
    "accelerate",
)
ALLOWED = ("grpc.StatusCode",)


def pure_modules() -> set[str]:
    operator = set(modules_under(SOURCES[0]))
    return (operator - OPERATOR_IO) | WORKER_PURE


def io_uses(path: Path) -> list[str]:
    """The I/O library uses of one module, as ``name @line (kind)``."""
    return [
        f"{u.name} @{u.line} ({u.kind})"
        for u in library_uses(path)
        if within(u.name, IO_LIBRARIES) and not within(u.name, ALLOWED)
    ]


def _tree(tmp_path: Path, files: dict[str, str]) -> Path:
    for name, text in files.items():
        path = tmp_path / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return tmp_path


def test_the_project_has_no_import_circle() -> None:
    graph = import_graph(SOURCES)
    assert len(graph) > 100, "the source roots moved: the graph would be empty"
    found = circles(graph)
    if found:
        pytest.fail("import circles:\n" + "\n".join(describe(c) for c in found), pytrace=False)


def test_a_typing_only_circle_is_a_circle(tmp_path: Path) -> None:
    root = _tree(
        tmp_path,
        {
            "pkg/__init__.py": "",
            "pkg/owner.py": "from pkg.part import Part\n",
            "pkg/part.py": (
                "from typing import TYPE_CHECKING\n"
                "if TYPE_CHECKING:\n"
                "    from pkg.owner import Owner\n"
            ),
        },
    )
    (circle,) = circles(import_graph([root]))
    assert describe(circle) == "pkg.owner -[module @1]-> pkg.part -[typing @3]-> pkg.owner"


def test_imports_in_functions_and_relative_ones_are_edges(tmp_path: Path) -> None:
    root = _tree(
        tmp_path,
        {
            "pkg/__init__.py": "",
            "pkg/sub/__init__.py": "from . import leaf\n",
            "pkg/sub/leaf.py": "def f() -> None:\n    from ..top import g\n",
            "pkg/top.py": "import pkg.sub.leaf as leaf\ndef g() -> None: ...\n",
        },
    )
    graph = import_graph([root])
    assert [(e.target, e.kind) for e in graph["pkg.sub"]] == [("pkg.sub.leaf", "module")]
    assert [(e.target, e.kind) for e in graph["pkg.sub.leaf"]] == [("pkg.top", "function")]
    (circle,) = circles(graph)
    assert describe(circle) == "pkg.sub.leaf -[function @2]-> pkg.top -[module @1]-> pkg.sub.leaf"


def test_a_tree_without_circles_passes(tmp_path: Path) -> None:
    root = _tree(tmp_path, {"a.py": "import b\n", "b.py": "import c\n", "c.py": "import os\n"})
    graph = import_graph([root])
    assert circles(graph) == []
    assert [e.target for e in graph["a"]] == ["b"]
    assert graph["c"] == []


def test_every_named_module_exists() -> None:
    known = set(modules_under(SOURCES[0])) | set(modules_under(SOURCES[1]))
    assert (OPERATOR_IO | WORKER_PURE) - known == set()


def test_pure_logic_uses_no_io_library_and_imports_only_pure_modules() -> None:
    paths = {**modules_under(SOURCES[0]), **modules_under(SOURCES[1])}
    graph = import_graph(SOURCES)
    pure = pure_modules()
    problems = []
    for name in sorted(pure):
        problems += [f"{name}: uses {use}" for use in io_uses(paths[name])]
        problems += [
            f"{name}: imports {e.target} @{e.line} ({e.kind}), which is not pure"
            for e in graph[name]
            if e.target not in pure
        ]
    if problems:
        pytest.fail("pure logic doing I/O:\n" + "\n".join(problems), pytrace=False)


def test_io_is_found_in_each_form(tmp_path: Path) -> None:
    module = tmp_path / "m.py"
    module.write_text(
        "import grpc\n"
        "import asyncio\n"
        "from typing import TYPE_CHECKING\n"
        "if TYPE_CHECKING:\n"
        "    import kr8s\n"
        "def f() -> None:\n"
        "    from torch import cuda\n"
        "    asyncio.create_subprocess_exec('x')\n"
        "    open('x')\n"
        "    Path('x').read_text()\n"
        "CODE = grpc.StatusCode.INVALID_ARGUMENT\n"
        "SERVER = grpc.server\n"
    )
    assert io_uses(module) == [
        "kr8s @5 (typing)",
        "torch.cuda @7 (function)",
        "asyncio.create_subprocess_exec @8 (module)",
        "open @9 (module)",
        "pathlib.Path.read_text @10 (module)",
        "grpc.server @12 (module)",
    ]
    module.write_text(
        "import grpc\nimport asyncio\nfrom pathlib import Path\n"
        "CODE = grpc.StatusCode.OK\nasyncio.sleep(0)\nNAME = Path('a') / 'b'\n"
    )
    assert io_uses(module) == []


def test_the_readme_names_the_same_layers() -> None:
    text = (ROOT / "README.md").read_text()
    section = text.split("### Code layout: pure logic and I/O", 1)[1].split("\n### ", 1)[0]
    rows = [line.split(" | ") for line in section.splitlines() if line.startswith("| ")]

    def named(cells: list[str]) -> list[str]:
        return [n.replace("/", ".") for c in cells for n in re.findall(r"`([\w/]+)`", c)]

    # By the module's own name (its package may move: issue 25's layer packages).
    for names, modules in (
        (named([r[1] for r in rows if "I/O" in r[0]]), OPERATOR_IO),
        (named([r[2] for r in rows if "pure" in r[0]]), WORKER_PURE),
    ):
        matched = {n: sorted(m for m in modules if m.endswith("." + n)) for n in names}
        assert all(len(m) == 1 for m in matched.values()), matched
        assert sorted(m[0] for m in matched.values()) == sorted(modules)
