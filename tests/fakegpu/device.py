"""A simulated GPU shared by processes through a directory (the I/O around :mod:`.model`).

Layout of ``<dir>``:

- ``device.json``: the :class:`~tests.fakegpu.model.Device` (written by whoever creates the
  device: localnode at start, or a test);
- ``procs/<pid>.json``: one :class:`~tests.fakegpu.model.Proc` per process that touched the
  device, written atomically (temp file + rename); a record whose process is gone (pid not
  running, or running with another create time, or a zombie) is not counted, as the driver
  frees a killed process's memory;
- ``faults.json``: fault switches, ``{"*": {...}, "<pid>": {...}}`` with keys
  ``leak_on_sleep`` (bytes, or ``"all"``), ``lie`` (bool), ``slow_serving_s`` (seconds),
  ``unlisted`` (bool: the process's own figure reads 0, the device still charges it);
  ``tenant_on_copy`` ([pid, bytes], one shot); read on every probe call, so a test may switch
  them at run time;
- ``lock``: serialises allocations between processes (an allocation checks free memory and
  publishes its record under the lock, as the driver allocates atomically);
- ``driver.sock`` (only where a host side serves it, :mod:`.driver`: the real node's devices,
  whose processes run in containers): records are keyed by host pid and judged alive on the
  host, as a real driver lists host pids across PID namespaces.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tests.fakegpu.driver import SOCKET_NAME, DriverClient, alive
from tests.fakegpu.model import Device, Faults, Proc, free

__all__ = ["FakeGpu", "Snapshot", "alive"]


def _write_json(path: Path, data: Any) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(data, sort_keys=True))
    os.replace(tmp, path)


def _read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


@dataclass(frozen=True)
class Snapshot:
    """The device as ``nvidia-smi`` would show it: free and every live process's usage."""

    device: Device
    free: int
    procs: dict[int, Proc]

    @property
    def used_total(self) -> int:
        """Memory taken from the device (reserve excluded): what the processes hold."""
        return sum(p.charged for p in self.procs.values())


class FakeGpu:
    """One simulated device directory."""

    def __init__(self, directory: Path | str) -> None:
        self.dir = Path(directory)
        self.procs_dir = self.dir / "procs"
        self._driver: DriverClient | None = None

    def driver(self) -> DriverClient | None:
        """The device's host side, when one serves ``driver.sock`` (see :mod:`.driver`)."""
        if self._driver is None and (self.dir / SOCKET_NAME).exists():
            self._driver = DriverClient(self.dir / SOCKET_NAME)
        return self._driver

    # -- creation and switches (localnode, tests) ---------------------------------------------

    @classmethod
    def create(cls, directory: Path | str, device: Device) -> FakeGpu:
        """Write ``device.json`` (keeping the records and faults already there)."""
        gpu = cls(directory)
        gpu.procs_dir.mkdir(parents=True, exist_ok=True)
        _write_json(gpu.dir / "device.json", device.to_json())
        return gpu

    def device(self) -> Device:
        data = _read_json(self.dir / "device.json")
        if data is None:
            raise FileNotFoundError(f"{self.dir / 'device.json'} is missing or unreadable")
        return Device.from_json(data)

    def faults_table(self) -> dict[str, Any]:
        data = _read_json(self.dir / "faults.json")
        return dict(data) if isinstance(data, dict) else {}

    def faults(self, pid: int) -> Faults:
        return Faults.for_pid(self.faults_table(), pid)

    def set_faults(self, pid: int | None = None, **switches: Any) -> None:
        """Switch faults for ``pid`` (None: every process); ``None`` values clear a switch."""
        with self.locked():
            table = self.faults_table()
            key = "*" if pid is None else str(pid)
            entry = dict(table.get(key) or {})
            for name, value in switches.items():
                if name not in (
                    "leak_on_sleep",
                    "lie",
                    "slow_serving_s",
                    "unlisted",
                    "tenant_on_copy",
                ):
                    raise TypeError(f"unknown fault {name!r}")
                if value is None:
                    entry.pop(name, None)
                else:
                    entry[name] = value
            table[key] = entry
            _write_json(self.dir / "faults.json", table)

    def take_tenant_fault(self, pid: int) -> tuple[int, int] | None:
        """Clear ``pid``'s (or everyone's) ``tenant_on_copy`` switch and return it (call with
        the lock held: the tenant is published under the same lock as the copy it precedes)."""
        table = self.faults_table()
        for key in (str(pid), "*"):
            entry = table.get(key)
            if isinstance(entry, dict) and entry.get("tenant_on_copy"):
                tenant = entry.pop("tenant_on_copy")
                _write_json(self.dir / "faults.json", table)
                return int(tenant[0]), int(tenant[1])
        return None

    def clear_faults(self) -> None:
        with contextlib.suppress(FileNotFoundError):
            (self.dir / "faults.json").unlink()

    # -- records ------------------------------------------------------------------------------

    @contextlib.contextmanager
    def locked(self) -> Iterator[None]:
        self.dir.mkdir(parents=True, exist_ok=True)
        with (self.dir / "lock").open("a") as fh:
            fcntl.flock(fh, fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(fh, fcntl.LOCK_UN)

    def publish(self, proc: Proc) -> None:
        self.procs_dir.mkdir(parents=True, exist_ok=True)
        _write_json(self.procs_dir / f"{proc.pid}.json", proc.to_json())

    def withdraw(self, pid: int) -> None:
        with contextlib.suppress(FileNotFoundError):
            (self.procs_dir / f"{pid}.json").unlink()

    def live(self) -> dict[int, Proc]:
        """The records of the processes that still run."""
        records: list[Proc] = []
        if not self.procs_dir.is_dir():
            return {}
        for entry in self.procs_dir.glob("*.json"):
            if entry.name.startswith("."):
                continue
            data = _read_json(entry)
            try:
                records.append(Proc.from_json(data))
            except (TypeError, KeyError, ValueError):
                continue
        keys = [(p.pid, p.create_time) for p in records]
        driver = self.driver()
        flags = driver.alive(keys) if driver else [alive(pid, ct) for pid, ct in keys]
        return {p.pid: p for p, up in zip(records, flags, strict=True) if up}

    def snapshot(self) -> Snapshot:
        """Free memory and live processes now (an outside observer's view)."""
        device = self.device()
        procs = self.live()
        return Snapshot(device, free(device, procs.values()), procs)
