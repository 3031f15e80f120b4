"""Shards as chart releases: N releases in one namespace, each serving its own namespaces with
its own Lease, one of them owning the CRDs, render no object twice (helm would refuse the second
install) and no shared Lease or epoch record."""

from __future__ import annotations

from typing import Any

from tests.unit.test_chart_support import Obj, one, operator_args, render, select

SYSTEM = "omnistage-system"


def _shard(release: str, namespaces: list[str], *, owns_crds: bool) -> list[Obj]:
    values: dict[str, Any] = {"watch": {"namespaces": namespaces}}
    if not owns_crds:
        values["crds"] = {"enabled": False}
    return render(values, release=release, namespace=SYSTEM)


def _key(obj: Obj) -> tuple[str, str, str | None, str]:
    group = obj["apiVersion"].rpartition("/")[0]
    return (group, obj["kind"], obj["metadata"].get("namespace"), obj["metadata"]["name"])


def _flag(args: list[str], name: str) -> list[str]:
    return [a.split("=", 1)[1] for a in args if a.startswith(f"--{name}=")]


def test_three_shards_render_disjoint_objects_and_one_owns_the_crds() -> None:
    shards = {
        "shard-0": _shard("shard-0", ["team-a", "team-b"], owns_crds=True),
        "shard-1": _shard("shard-1", ["team-c"], owns_crds=False),
        "shard-2": _shard("shard-2", ["team-d"], owns_crds=False),
    }
    seen: dict[tuple[str, str, str | None, str], str] = {}
    for release, objs in shards.items():
        for obj in objs:
            other = seen.setdefault(_key(obj), release)
            assert other == release, f"{_key(obj)} rendered by {other} and {release}"
    crds = {r: len(select(objs, "CustomResourceDefinition")) for r, objs in shards.items()}
    assert crds == {"shard-0": 2, "shard-1": 0, "shard-2": 0}
    served, leases = {}, {}
    for release, objs in shards.items():
        args = operator_args(objs)
        served[release] = _flag(args, "namespace")
        leases[release] = _flag(args, "lease-name")
    assert served == {"shard-0": ["team-a", "team-b"], "shard-1": ["team-c"],
                      "shard-2": ["team-d"]}  # fmt: skip
    # each shard elects its own leader: its own Lease (the epoch record is "<lease>-epoch"), and
    # its ServiceAccount may touch only those two, so a shard cannot take another's Lease
    assert len({lease for (lease,) in leases.values()}) == 3
    for release, objs in shards.items():
        role = one(objs, "Role", SYSTEM)
        named = sorted(n for rule in role["rules"] for n in rule.get("resourceNames", []))
        (lease,) = leases[release]
        assert set(named) <= {lease, f"{lease}-epoch"} and lease in named, (release, named)
