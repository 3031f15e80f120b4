#!/usr/bin/env python3
"""Packages by layer (issue 25): move the operator's and worker's modules, rewrite references.

Run from the repository root on a clean tree: ``.venv/bin/python .ci/relayer.py`` (``--dry-run``
prints what it would do). The mapping below is the data; the script

- creates the layer packages (an ``__init__.py`` with the layer's docstring),
- moves each module or package with ``git mv`` (one already moved is skipped, one absent is
  reported), and deletes the re-export shims (``REDIRECTS``, ``SHIM_SYMBOLS``),
- rewrites every reference in the repository's tracked text files: ``from pkg import mod`` and
  ``from pkg.mod import name`` statements (split per new module), dotted names anywhere (imports,
  ``import x.y as z``, monkeypatch and mock strings, logger names, entry points, docs) and file
  paths (``omnistage_operator/kube.py``), with word-boundary patterns built from the mapping,
  longest names first,
- replaces the README's "Where things are" table and the packages' module lists with the
  templates below,
- sorts and formats the Python files it changed (ruff), and prints what it did.

Running it again changes nothing: no new name starts with an old one (checked first).
History is left alone: ``CHANGELOG.md`` and ``bench/results/`` keep the paths they recorded.
"""

from __future__ import annotations

import argparse
import ast
import io
import re
import shutil
import subprocess
import sys
import tokenize
from collections.abc import Iterable
from pathlib import Path

OP = "omnistage_operator"
WK = "omnistage_worker"
SRC = {OP: "operator/src", WK: "worker_image/src"}

# The layer packages, bottom first, and what each holds (their ``__init__.py`` docstrings).
PACKAGES: dict[str, str] = {
    f"{OP}.api": "The API types: what a user writes and reads (spec, parsing, labels, conditions).",
    f"{OP}.decisions": (
        "The pure decisions: the arbiter, the hand-over round, worker facts, status (no I/O)."
    ),
    f"{OP}.k8s": (
        "The Kubernetes side: kr8s objects, views, pod and claim builders, the group port,\n"
        "the Lease elector and the worker client."
    ),
    f"{OP}.runtime": (
        "The process wiring: kopf handlers, group runners, the status publisher, demand watchers,\n"
        "settings and login."
    ),
    f"{WK}.control": (
        "Control of the one model: sleep and wake, transitions, ACKs, epochs, demand, loading."
    ),
    f"{WK}.serving": (
        "What the worker serves: gRPC services, the OpenAI layer, the router, auth, metrics."
    ),
}

# old dotted name -> new dotted name (a module, or a package moved whole).
MOVES: dict[str, str] = {
    # operator: API types
    f"{OP}.spec": f"{OP}.api.spec",
    f"{OP}.spec_parse": f"{OP}.api.spec_parse",
    f"{OP}.activation": f"{OP}.api.activation",
    f"{OP}.model_source": f"{OP}.api.model_source",
    f"{OP}.pod_template": f"{OP}.api.pod_template",
    f"{OP}.serving": f"{OP}.api.serving",
    f"{OP}.worker_tls": f"{OP}.api.worker_tls",
    f"{OP}.pipelines": f"{OP}.api.pipelines",
    f"{OP}.labels": f"{OP}.api.labels",
    f"{OP}.conditions": f"{OP}.api.conditions",
    # operator: pure decisions
    f"{OP}.arbiter": f"{OP}.decisions.arbiter",
    f"{OP}.blockers": f"{OP}.decisions.arbiter.blockers",
    f"{OP}.device_scope": f"{OP}.decisions.arbiter.device_scope",
    f"{OP}.wakegate": f"{OP}.decisions.arbiter.wakegate",
    f"{OP}.footprints": f"{OP}.decisions.arbiter.footprints",
    f"{OP}.handover": f"{OP}.decisions.handover",
    f"{OP}.sleep_tasks": f"{OP}.decisions.handover.sleep_tasks",
    f"{OP}.facts": f"{OP}.decisions.facts",
    f"{OP}.memory": f"{OP}.decisions.memory",
    f"{OP}.pods": f"{OP}.decisions.pods",
    f"{OP}.peaks": f"{OP}.decisions.peaks",
    f"{OP}.ondemand": f"{OP}.decisions.ondemand",
    f"{OP}.remembered": f"{OP}.decisions.remembered",
    f"{OP}.wake_backoff": f"{OP}.decisions.wake_backoff",
    f"{OP}.status": f"{OP}.decisions.status",
    f"{OP}.components": f"{OP}.decisions.component_status",
    f"{OP}.election": f"{OP}.decisions.election",
    f"{OP}.leadership": f"{OP}.decisions.leadership",
    f"{OP}.event_series": f"{OP}.decisions.event_series",
    # operator: the Kubernetes side
    f"{OP}.kube": f"{OP}.k8s.kube",
    f"{OP}.views": f"{OP}.k8s.views",
    f"{OP}.builders": f"{OP}.k8s.builders",
    f"{OP}.pod_hash": f"{OP}.k8s.pod_hash",
    f"{OP}.worker_command": f"{OP}.k8s.worker_command",
    f"{OP}.token_secret": f"{OP}.k8s.token_secret",
    f"{OP}.claim_slices": f"{OP}.k8s.claim_slices",
    f"{OP}.port": f"{OP}.k8s.port",
    f"{OP}.port_facts": f"{OP}.k8s.port_facts",
    f"{OP}.port_listing": f"{OP}.k8s.port_listing",
    f"{OP}.port_host": f"{OP}.k8s.port_host",
    f"{OP}.settings": f"{OP}.k8s.settings",  # read by the port (``port_host``) and the runtime
    f"{OP}.leader": f"{OP}.k8s.leader",
    f"{OP}.worker_client": f"{OP}.k8s.worker_client",
    f"{OP}.worker_credentials": f"{OP}.k8s.worker_credentials",
    f"{OP}.metrics": f"{OP}.k8s.metrics",
    # operator: process wiring (``cli`` stays: the console script's and ``python -m``'s path)
    f"{OP}.handlers": f"{OP}.runtime.handlers",
    f"{OP}.diffbase": f"{OP}.runtime.diffbase",
    f"{OP}.runner": f"{OP}.runtime.runner",
    f"{OP}.group_loops": f"{OP}.runtime.group_loops",
    f"{OP}.round_memory": f"{OP}.runtime.round_memory",
    f"{OP}.group_claims": f"{OP}.k8s.group_claims",
    f"{OP}.publisher": f"{OP}.runtime.publisher",
    f"{OP}.demand_watch": f"{OP}.runtime.demand_watch",
    f"{OP}.pipeline_status": f"{OP}.runtime.pipeline_status",
    f"{OP}.stage_metrics": f"{OP}.runtime.stage_metrics",
    f"{OP}.election_thread": f"{OP}.runtime.election_thread",
    f"{OP}.login": f"{OP}.runtime.login",
    # worker: control (``memory``, ``engine``, ``runners`` are packages already)
    f"{WK}.acks": f"{WK}.control.acks",
    f"{WK}.transitions": f"{WK}.control.transitions",
    f"{WK}.transition_acks": f"{WK}.control.transition_acks",
    f"{WK}.sleep_wake": f"{WK}.control.sleep_wake",
    f"{WK}.component_sleep": f"{WK}.control.component_sleep",
    f"{WK}.wake_capacity": f"{WK}.control.wake_capacity",
    f"{WK}.oom": f"{WK}.control.oom",
    f"{WK}.demand": f"{WK}.control.demand",
    f"{WK}.queued": f"{WK}.control.queued",
    f"{WK}.status": f"{WK}.control.status",
    f"{WK}.loading": f"{WK}.control.loading",
    f"{WK}.termination": f"{WK}.control.termination",
    f"{WK}.lane": f"{WK}.control.lane",
    f"{WK}.chunk_sinks": f"{WK}.control.chunk_sinks",
    f"{WK}.prestart": f"{WK}.control.prestart",
    f"{WK}.worker_parts": f"{WK}.control.worker_parts",
    # worker: serving
    f"{WK}.server": f"{WK}.serving.server",
    f"{WK}.sleep_service": f"{WK}.serving.sleep_service",
    f"{WK}.inference_service": f"{WK}.serving.inference_service",
    f"{WK}.demand_service": f"{WK}.serving.demand_service",
    f"{WK}.health": f"{WK}.serving.health",
    f"{WK}.auth": f"{WK}.serving.auth",
    f"{WK}.http_auth": f"{WK}.serving.http_auth",
    f"{WK}.token_review": f"{WK}.serving.token_review",
    f"{WK}.kube_access": f"{WK}.serving.kube_access",
    f"{WK}.encoding": f"{WK}.serving.encoding",
    f"{WK}.openai_api": f"{WK}.serving.openai_api",
    f"{WK}.openai_answers": f"{WK}.serving.openai_answers",
    f"{WK}.openai_http": f"{WK}.serving.openai_http",
    f"{WK}.openai_stream": f"{WK}.serving.openai_stream",
    f"{WK}.image_usage": f"{WK}.serving.image_usage",
    f"{WK}.vllm_front": f"{WK}.serving.vllm_front",
    f"{WK}.asgi_serve": f"{WK}.serving.asgi_serve",
    f"{WK}.metrics_serve": f"{WK}.serving.metrics_serve",
    f"{WK}.router": f"{WK}.serving.router",
    f"{WK}.pipeline_def": f"{WK}.serving.pipeline_def",
    f"{WK}.pipeline_serve": f"{WK}.serving.pipeline_serve",
    # worker: runners take the prompt-embeds message they and the pipeline router share
    f"{WK}.embeds": f"{WK}.runners.embeds",
}

# Modules that stay at a package's top: the command lines, the process's basics, the Worker,
# and what pods run by module path (``python -m omnistage_worker.fetch``). Any other module
# found there is reported as not in the mapping.
TOP: dict[str, set[str]] = {
    OP: {"cli"},
    WK: {
        "cli", "flag_groups", "config", "dtype_choices", "limits", "quantities", "state",
        "metrics", "fetch", "fetch_s3", "sigv4", "host_allocator", "jsonlog",
        "stray_output", "engine", "memory", "runners",
    },
}  # fmt: skip

# Re-export shims deleted: every reference goes to the module that defines the names.
REDIRECTS: dict[str, str] = {
    f"{OP}.quantities": f"{WK}.quantities",
}
# Shims re-exporting names of several modules: each name goes to its own module (old names).
SHIM_SYMBOLS: dict[str, dict[str, str]] = {
    f"{OP}.groups": {
        "GroupRunner": f"{OP}.runner",
        "KubeGroupPort": f"{OP}.port",
        "group_of": f"{OP}.port",
    },
}

# Text left alone: history, generated code, this script.
EXCLUDED_PREFIXES = ("CHANGELOG.md", "bench/results/", "protos/gen/", ".ci/relayer")

# Text the rewrite would leave wrong: (file after the moves, old text, new text).
FIXUPS: list[tuple[str, str, str]] = [
    (  # a ``# fmt: skip`` tuple the longer name would push past the line length
        "bench/gpu_e2e.py",
        """"grpc_health.v1.health", "omnistage_operator.handlers",
                "omnistage_worker.cli", "tests.cluster.controlplane"):  # fmt: skip""",
        """"grpc_health.v1.health",
                "omnistage_operator.handlers", "omnistage_worker.cli",
                "tests.cluster.controlplane"):  # fmt: skip""",
    ),
    (
        f"{SRC[WK]}/{WK}/quantities.py",
        "takes nothing else of the worker with it. :mod:`omnistage_operator.quantities` "
        "re-exports it.",
        "takes nothing else of the worker with it.",
    ),
]


def template(name: str) -> str:
    """A section's new text, kept beside this script (``relayer_templates/``)."""
    return (Path(__file__).parent / "relayer_templates" / name).read_text(encoding="utf-8")


def sub_after(text: str, start: str, end: str, new: str) -> str | None:
    """``text`` with what lies from ``start`` up to ``end`` (kept) replaced by ``new``."""
    i = text.find(start)
    j = text.find(end, i + len(start)) if i >= 0 else -1
    if i < 0 or j < 0:
        return None
    return text[:i] + new + text[j:]


README_TABLE = template("readme_table.md")

OPERATOR_DOC_TABLE = template("operator_init.txt")

WORKER_DOC_MODULES = template("worker_init.txt")

# New files from templates, written once (a later run leaves them as they are).
NEW_FILES: list[tuple[str, str]] = [
    ("test_layers.py", "tests/unit/test_layers.py"),  # imports point down the layers
]

# (file, start marker, end marker (kept), new text): templates replacing a section.
SECTIONS: list[tuple[str, str, str, str]] = [
    ("README.md", "### Where things are\n", "The API traffic of a round", README_TABLE),
    (
        f"{SRC[OP]}/{OP}/__init__.py",
        "Where things are (pure modules",
        "Decisions beyond the design contract:",
        OPERATOR_DOC_TABLE,
    ),
    (
        f"{SRC[WK]}/{WK}/__init__.py",
        "Modules: ``cli``",
        "Decisions a user of the worker should know:",
        WORKER_DOC_MODULES,
    ),
]


def git(*args: str, check: bool = True) -> str:
    out = subprocess.run(["git", *args], check=check, capture_output=True, text=True)
    return out.stdout


def file_of(dotted: str) -> Path:
    """The source path of a dotted module or package (without ``.py``)."""
    top = dotted.split(".", 1)[0]
    return Path(SRC[top], *dotted.split("."))


def existing(dotted: str) -> Path | None:
    """The file or directory of ``dotted`` if it exists."""
    base = file_of(dotted)
    if base.is_dir():
        return base
    mod = base.with_suffix(".py")
    return mod if mod.is_file() else None


def old_names() -> list[str]:
    return [*MOVES, *REDIRECTS, *SHIM_SYMBOLS]


def check_mapping() -> None:
    """No new name is, or lies under, an old one: a second run then matches nothing."""
    olds = old_names()
    for new in [*MOVES.values(), *PACKAGES]:
        for old in olds:
            if new == old or new.startswith(old + "."):
                sys.exit(f"mapping error: new name {new} lies under old name {old}")


def rename(dotted: str) -> str:
    """``dotted`` (a module or a name in it) under the new layout."""
    table = {**MOVES, **REDIRECTS}
    for old in sorted(table, key=len, reverse=True):
        if dotted == old or dotted.startswith(old + "."):
            return table[old] + dotted[len(old) :]
    return dotted


def symbol_target(full: str) -> str | None:
    """Where a name imported from a deleted multi-module shim lives (new layout)."""
    mod, _, name = full.rpartition(".")
    if mod in SHIM_SYMBOLS and name in SHIM_SYMBOLS[mod]:
        return rename(f"{SHIM_SYMBOLS[mod][name]}.{name}")
    return None


# --- moving -------------------------------------------------------------------------------


def make_packages(dry: bool, log: list[str]) -> None:
    packages = set(PACKAGES)
    for new in MOVES.values():
        parts = new.split(".")
        packages.update(".".join(parts[:i]) for i in range(2, len(parts)))
    for pkg in sorted(packages, key=lambda p: (p.count("."), p)):
        init = file_of(pkg) / "__init__.py"
        arrives = any(pkg == new or pkg.startswith(new + ".") for new in MOVES.values())
        if init.exists() or (arrives and pkg not in PACKAGES):
            continue  # exists, or arrives with a package moved whole
        log.append(f"create package {pkg} ({init})")
        if not dry:
            init.parent.mkdir(parents=True, exist_ok=True)
            init.write_text(f'"""{PACKAGES.get(pkg, pkg)}"""\n')
            git("add", str(init))


def add_files(dry: bool, log: list[str]) -> None:
    for name, dest in NEW_FILES:
        if Path(dest).exists():
            log.append(f"skip {dest}: exists")
            continue
        log.append(f"add {dest} (from relayer_templates/{name})")
        if not dry:
            Path(dest).write_text(template(name), encoding="utf-8")
            git("add", dest)


def move(dry: bool, log: list[str]) -> None:
    # Packages first, so that modules moving into a moved package find it.
    order = sorted(MOVES, key=lambda o: (not file_of(o).is_dir(), o))
    for old in order:
        new = MOVES[old]
        src, dst = existing(old), existing(new)
        if src is not None and dst is not None:
            sys.exit(f"both {src} and {dst} exist: resolve by hand")
        if src is None:
            log.append(f"skip {old}: {'already moved' if dst else 'absent'}")
            continue
        target = file_of(new) if src.is_dir() else file_of(new).with_suffix(".py")
        log.append(f"git mv {src} {target}")
        if not dry:
            target.parent.mkdir(parents=True, exist_ok=True)
            git("mv", str(src), str(target))
    for shim in [*REDIRECTS, *SHIM_SYMBOLS]:
        path = existing(shim)
        if path is None:
            log.append(f"skip shim {shim}: already deleted")
            continue
        log.append(f"git rm {path} (re-export shim)")
        if not dry:
            git("rm", "-q", str(path))


# --- rewriting ----------------------------------------------------------------------------


def rewrite_from_imports(source: str) -> str:
    """Each ``from <ours> import ...`` split per new module (a module imported by name included)."""
    try:
        tree = ast.parse(source)
    except SyntaxError:
        return source
    moved = {**MOVES, **REDIRECTS}
    lines = source.splitlines(keepends=True)
    offsets = [0]
    for line in lines:
        offsets.append(offsets[-1] + len(line))
    edits: list[tuple[int, int, str]] = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.ImportFrom) or node.level or not node.module:
            continue
        if node.module.split(".")[0] not in SRC:
            continue
        groups: dict[str, list[str]] = {}
        changed = False
        for alias in node.names:
            full = f"{node.module}.{alias.name}"
            target = symbol_target(full)
            if target is None and full in moved:
                target = rename(full)
            if target is not None:
                tmod, _, tname = target.rpartition(".")
                asname = alias.asname or (alias.name if tname != alias.name else None)
            else:
                tmod, tname, asname = rename(node.module), alias.name, alias.asname
            changed |= (tmod, tname, asname) != (node.module, alias.name, alias.asname)
            groups.setdefault(tmod, []).append(f"{tname} as {asname}" if asname else tname)
        if not changed:
            continue
        new_lines = [f"from {mod} import {', '.join(names)}" for mod, names in groups.items()]
        start = offsets[node.lineno - 1] + node.col_offset
        end = offsets[(node.end_lineno or node.lineno) - 1] + (node.end_col_offset or 0)
        indent = " " * node.col_offset
        edits.append((start, end, ("\n" + indent).join(new_lines)))
    for start, end, new in sorted(edits, reverse=True):
        source = source[:start] + new + source[end:]
    return source


def dotted_pattern() -> tuple[re.Pattern[str], dict[str, str]]:
    table = {**MOVES, **REDIRECTS}
    for shim, names in SHIM_SYMBOLS.items():
        for name in names:
            table[f"{shim}.{name}"] = symbol_target(f"{shim}.{name}") or ""
    keys = sorted(table, key=len, reverse=True)
    alternation = "|".join(re.escape(k) for k in keys)
    return re.compile(rf"(?<![\w.])({alternation})(?!\w)"), table


def path_pattern() -> tuple[re.Pattern[str], dict[str, str]]:
    """``omnistage_operator/kube.py`` and ``omnistage_operator/arbiter/`` in docs and strings."""
    table: dict[str, str] = {}
    for old, new in MOVES.items():
        o, n = old.replace(".", "/"), new.replace(".", "/")
        if file_of(new).is_dir() or file_of(old).is_dir():
            table[o] = n
        else:
            table[o + ".py"] = n + ".py"
    keys = sorted(table, key=len, reverse=True)
    alternation = "|".join(re.escape(k) for k in keys)
    return re.compile(rf"(?<![\w.])({alternation})(?!\w)"), table


LINE_LENGTH = 100


def prose_lines(source: str) -> set[int]:
    """0-based numbers of the lines that are docstring text or whole-line comments."""
    lines: set[int] = set()
    try:
        for tok in tokenize.generate_tokens(io.StringIO(source).readline):
            if tok.type == tokenize.STRING and tok.string.lstrip("rbuRBU").startswith(
                ('"""', "'''")
            ):
                lines.update(range(tok.start[0] - 1, tok.end[0]))
            elif tok.type == tokenize.COMMENT and not tok.line[: tok.start[1]].strip():
                lines.add(tok.start[0] - 1)
    except (tokenize.TokenError, SyntaxError):
        return set()
    return lines


def reflow(source: str, inserted: Iterable[str]) -> str:
    """Prose lines our longer names pushed past the line length, wrapped into the next line."""
    names = tuple(inserted)
    prose = prose_lines(source)
    lines = source.split("\n")
    carried: set[int] = set()  # lines that took the tail of the line before
    i = 0
    while i < len(lines):
        line = lines[i]
        ours = i in carried or any(n in line for n in names)
        if len(line) <= LINE_LENGTH or i not in prose or not ours:
            i += 1
            continue
        indent = line[: len(line) - len(line.lstrip())]
        comment = line.lstrip().startswith("#")
        lead = indent + ("# " if comment else "")
        body = line.lstrip()[2:] if comment else line.lstrip()
        hang = "  " if body.startswith(("- ", "* ")) else ""
        cut = line.rfind(" ", len(lead) + 1, LINE_LENGTH + 1)
        if cut < 0:
            i += 1
            continue
        head, tail = line[:cut], line[cut + 1 :]
        cont = lead + hang
        nxt = lines[i + 1] if i + 1 < len(lines) else None
        nxt_body = nxt[len(cont) :] if nxt is not None else ""
        joins = (
            nxt is not None
            and i + 1 in prose
            and nxt.startswith(cont)
            and nxt_body.strip() != ""
            and not nxt_body[0].isspace()
            and not nxt_body.startswith(("- ", "* ", '"""', "```", ".. "))
            and (not comment or nxt.lstrip().startswith("#"))
        )
        lines[i] = head
        if joins:
            lines[i + 1] = cont + tail + " " + nxt_body
            carried.add(i + 1)
        else:
            lines.insert(i + 1, cont + tail)
            prose = {n + 1 if n > i else n for n in prose} | {i + 1}
        i += 1
    return "\n".join(lines)


def text_files() -> Iterable[Path]:
    for name in git("ls-files", "-z").split("\0"):
        if not name or name.startswith(EXCLUDED_PREFIXES):
            continue
        path = Path(name)
        if not path.is_file() or path.is_symlink():
            continue
        data = path.read_bytes()
        if b"\0" in data:
            continue
        try:
            data.decode("utf-8")
        except UnicodeDecodeError:
            continue
        yield path


def rewrite(dry: bool, log: list[str]) -> list[Path]:
    dotted, dotted_to = dotted_pattern()
    paths, paths_to = path_pattern()
    changed: list[Path] = []
    for path in text_files():
        text = path.read_text(encoding="utf-8")
        new = text
        for file, old, fixed in FIXUPS:
            if str(path) == file:
                new = new.replace(old, fixed)
        for file, start, end, template in SECTIONS:
            if str(path) == file and template not in new:
                replaced = sub_after(new, start, end, template)
                if replaced is None:
                    log.append(
                        f"WARNING: {file}: section '{start.strip()}' not found; apply by hand"
                    )
                else:
                    new = replaced
        if path.suffix == ".py":
            new = rewrite_from_imports(new)
        new = dotted.sub(lambda m: dotted_to[m.group(1)], new)
        new = paths.sub(lambda m: paths_to[m.group(1)], new)
        if path.suffix == ".py" and new != text:
            new = reflow(new, [*dotted_to.values(), *paths_to.values()])
        if new != text:
            changed.append(path)
            log.append(f"rewrite {path}")
            if not dry:
                path.write_text(new, encoding="utf-8")
    return changed


def tidy(changed: list[Path], log: list[str]) -> None:
    """Imports sorted and long lines wrapped as the project's ruff wants them."""
    py = [str(p) for p in changed if p.suffix == ".py" and p.exists()]
    if not py:
        return
    venv = Path(".venv/bin/ruff")
    ruff = str(venv) if venv.exists() else shutil.which("ruff")
    if ruff is None:
        log.append("WARNING: ruff not found: run `ruff check --select I --fix . && ruff format .`")
        return
    subprocess.run([ruff, "check", "--select", "I", "--fix", "-q", *py], check=False)
    subprocess.run([ruff, "format", "-q", *py], check=False)
    log.append(f"ruff: sorted imports and formatted {len(py)} Python files")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0] if __doc__ else None)
    parser.add_argument("--dry-run", action="store_true", help="print what would be done")
    args = parser.parse_args()
    if not Path(".git").exists() or not Path(SRC[OP]).is_dir():
        sys.exit("run from the repository root")
    status = git("status", "--porcelain").splitlines()
    if any(not line.startswith("??") for line in status) and not args.dry_run:
        sys.exit("the tree has uncommitted changes: commit or stash them first")
    for line in status:
        print(f"note: untracked {line[3:]} is not rewritten")
    check_mapping()
    log: list[str] = []
    make_packages(args.dry_run, log)
    move(args.dry_run, log)
    add_files(args.dry_run, log)
    changed = [] if args.dry_run else rewrite(False, log)
    if not args.dry_run:
        tidy(changed, log)
    print("\n".join(log))
    mapped = {*MOVES, *REDIRECTS, *SHIM_SYMBOLS}
    for top, keep in TOP.items():
        for path in sorted(Path(SRC[top], top).iterdir()):
            name = path.stem if path.suffix == ".py" else path.name
            dotted = f"{top}.{name}"
            if name.startswith("_") or name in keep or dotted in mapped or dotted in PACKAGES:
                continue
            if path.suffix == ".py" or (path / "__init__.py").exists():
                print(f"WARNING: {dotted} is not in the mapping: it stays at the top")
    if not args.dry_run:
        print("\nnext: ruff check . && ruff format --check . && mypy; then the tests; then commit")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
