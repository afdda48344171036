"""Autotuning: time each legal config of a kernel once, keep the winner in a persistent JSON database.

The database key names everything that invalidates a result (dzc version, profile, the device's tuning identity
(arch, multiprocessor count, toolkit, Triton flavour and TileLang versions), codegen and its version,
generated-source hash, dtypes and shape bucket), so a stale entry is never used; it is just not found.
Writers take a file lock and replace the file atomically, so concurrent compiles cannot corrupt it; a file that
is corrupt anyway (a crash elsewhere, a hand edit) is set aside with a warning and rebuilt.

A shipped database (dzc-tune's output, given as CompileOptions.tuning_db or $DZC_TUNING_DB) is read-only and
consulted before the local one. It was tuned on one device; on any other (another arch, multiprocessor count,
toolkit or DSL version) it is refused with an error naming both devices, never partly used.

External candidates (a vendor library's kernel for the same op, e.g. MATE on MUSA) are timed next to the configs;
when one wins, the record names it, and a process where it is not installed uses the best config instead.
"""

from __future__ import annotations

import json
import logging
import os
import sys
import tempfile
import time
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from filelock import FileLock

from dzc import config
from dzc.targets.kernel_config import KernelConfig

log = logging.getLogger("dzc.autotune")

FORMAT_VERSION = 1
# Show progress once tuning one kernel takes longer than this.
PROGRESS_AFTER_S = 1.0


class TuningDatabase:
    """The local database (read-write, in the cache directory), behind an optional shipped one (read-only)."""

    def __init__(self, path: str | os.PathLike, shipped: ShippedTuningDatabase | None = None):
        self.path = Path(path)
        self.shipped = shipped
        self._lock = FileLock(str(self.path) + ".lock")
        self._entries: dict[str, dict] | None = None
        self._mtime_ns = -1

    @staticmethod
    def key_string(key: dict) -> str:
        return json.dumps(key, sort_keys=True, separators=(",", ":"))

    def _read_file(self) -> dict[str, dict]:
        try:
            text = self.path.read_text()
        except FileNotFoundError:
            return {}
        try:
            data = json.loads(text)
            if data.get("format") != FORMAT_VERSION or not isinstance(data.get("entries"), dict):
                raise ValueError(f"format {data.get('format')!r}, expected {FORMAT_VERSION}")
            return data["entries"]
        except (ValueError, AttributeError) as err:
            aside = self.path.with_name(self.path.name + ".corrupt")
            warnings.warn(f"dzc: tuning database {self.path} is unreadable ({err}); moved it to {aside} and "
                          f"starting a new one", RuntimeWarning, stacklevel=3)
            os.replace(self.path, aside)
            return {}

    def _load(self) -> dict[str, dict]:
        try:
            mtime = self.path.stat().st_mtime_ns
        except FileNotFoundError:
            mtime = 0
        if self._entries is None or mtime != self._mtime_ns:
            with self._lock:
                self._entries = self._read_file()
            self._mtime_ns = mtime
        return self._entries

    def lookup(self, key: dict) -> dict | None:
        """The record for `key`: from the shipped database when it has one (marked "shipped": its path), else
        from the local one."""
        if self.shipped is not None:
            record = self.shipped.lookup(key)
            if record is not None:
                return {**record, "shipped": str(self.shipped.path)}
        return self._load().get(self.key_string(key))

    def entries_for_device(self, identity: dict) -> dict[str, dict]:
        """The local entries measured on the device with this tuning identity (what dzc-tune exports)."""
        return {k: v for k, v in self._load().items() if v.get("key", {}).get("device") == identity}

    def store(self, key: dict, record: dict) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with self._lock:
            entries = self._read_file()  # merge with what other processes wrote meanwhile
            entries[self.key_string(key)] = {"key": key, **record}
            fd, tmp = tempfile.mkstemp(dir=self.path.parent, prefix=self.path.name, suffix=".tmp")
            with os.fdopen(fd, "w") as f:
                json.dump({"format": FORMAT_VERSION, "entries": entries}, f, indent=1, sort_keys=True)
            os.replace(tmp, self.path)
            self._entries = entries
            self._mtime_ns = self.path.stat().st_mtime_ns


def open_database(cache_dir: str | os.PathLike, tuning_db: str | None) -> TuningDatabase:
    """The database lowering uses: the cache directory's, behind the shipped one named by `tuning_db`
    (CompileOptions.tuning_db) or else $DZC_TUNING_DB, if any."""
    shipped_path = tuning_db or config.TUNING_DB.get()
    shipped = ShippedTuningDatabase(shipped_path) if shipped_path else None
    return TuningDatabase(Path(cache_dir) / "tuning.json", shipped)


def export_database(database: TuningDatabase, identity: dict, out: str | os.PathLike, **metadata) -> int:
    """Write the local entries tuned on the device `identity` as a shipped database at `out`; returns how many."""
    entries = database.entries_for_device(identity)
    data = {"format": FORMAT_VERSION, "kind": ShippedTuningDatabase.KIND, **metadata,
            "device": {name: identity[name] for name in IDENTITY_FIELDS}, "entries": entries}
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    partial = out.with_name(out.name + ".tmp")
    partial.write_text(json.dumps(data, indent=1, sort_keys=True))
    os.replace(partial, out)
    return len(entries)


@dataclass(frozen=True)
class ExternalCandidate:
    """A vendor library's kernel for an op, offered to the tuner next to dzc's configs (e.g. MATE on MUSA).

    fn has the op's signature (its arguments without kernel_id) and returns the op's results.
    """

    name: str  # "mate.flash_attn_varlen_func": stable, recorded in the database
    fn: Callable[..., object]


# The device facts a shipped database was tuned on; a device differing in any of them is refused.
IDENTITY_FIELDS = ("device_type", "device", "arch", "multiprocessors", "toolkit", "triton", "tilelang")


class TuningDatabaseMismatch(ValueError):
    """A shipped tuning database was made on another device than the one tuning asks about."""


class ShippedTuningDatabase:
    """dzc-tune's output: entries tuned on one device (its identity is the file's `device`), read-only."""

    KIND = "dzc shipped tuning database"

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)
        try:
            data = json.loads(self.path.read_text())
        except FileNotFoundError:
            raise FileNotFoundError(f"dzc: tuning database {self.path} does not exist") from None
        except ValueError as err:
            raise ValueError(f"dzc: tuning database {self.path} is not JSON ({err})") from None
        if not isinstance(data, dict) or data.get("kind") != self.KIND:
            raise ValueError(f"dzc: {self.path} is not a shipped tuning database (dzc-tune --out writes them; the "
                             f"local cache's tuning.json is not one)")
        if data.get("format") != FORMAT_VERSION:
            raise ValueError(f"dzc: tuning database {self.path} has format {data.get('format')!r}; this dzc reads "
                             f"format {FORMAT_VERSION}")
        device, entries = data.get("device"), data.get("entries")
        if not isinstance(device, dict) or set(device) != set(IDENTITY_FIELDS) or not isinstance(entries, dict):
            raise ValueError(f"dzc: tuning database {self.path} lacks its device identity or entries")
        self.device: dict = device
        self.entries: dict[str, dict] = entries

    @staticmethod
    def describe_device(identity: dict) -> str:
        return (f"{identity['device']} ({identity['arch']}, {identity['multiprocessors']} multiprocessors, "
                f"toolkit {identity['toolkit']}, triton {identity['triton']}, tilelang {identity['tilelang']})")

    def check_device(self, identity: dict) -> None:
        """Refuse the whole database unless `identity` is the device it was tuned on."""
        differing = [name for name in IDENTITY_FIELDS if identity.get(name) != self.device[name]]
        if differing:
            what = "another arch" if "arch" in differing else f"a device differing in {', '.join(differing)}"
            raise TuningDatabaseMismatch(
                f"dzc: refusing tuning database {self.path}: it was tuned on {self.describe_device(self.device)}, "
                f"and this is {what}: {self.describe_device(identity)}. Tune for this device with dzc-tune, or "
                f"drop tuning_db / DZC_TUNING_DB.")

    def lookup(self, key: dict) -> dict | None:
        self.check_device(key["device"])
        return self.entries.get(TuningDatabase.key_string(key))


@dataclass
class TuningResult:
    config: KernelConfig  # the fastest config (kept when an external candidate won: it is the fallback)
    from_cache: bool
    seconds_tuning: float
    timings: dict[str, float]  # candidate text -> seconds per call; empty when from the cache
    failures: dict[str, str]  # candidate text -> why it was skipped
    external: ExternalCandidate | None = None  # set when an external candidate beat every config
    shipped_from: str | None = None  # the shipped database the result came from

    @property
    def how(self) -> str:
        if self.shipped_from:
            return f"shipped tuning database {self.shipped_from}"
        if self.from_cache:
            return "tuning database"
        return f"timed {len(self.timings) + len(self.failures)} candidates"


def tune(
    label: str,
    key: dict,
    configs: Sequence[KernelConfig],
    run: Callable[[KernelConfig], object],
    bench: Callable[[Callable[[], object]], float],
    database: TuningDatabase,
    externals: Sequence[ExternalCandidate] = (),
    run_external: Callable[[ExternalCandidate], object] | None = None,
    check: Callable[[KernelConfig], str | None] | None = None,
) -> TuningResult:
    """Pick the fastest config: from the database when the key is known, else by timing each one.

    run(config) launches the kernel once on real arguments. A config that fails to compile or run is skipped
    and logged; so is one for which check(config), called after its timed runs, says why its result is wrong.
    Tuning fails only when every config does. externals are timed the same way, through run_external(candidate)
    (which calls candidate.fn on the same arguments); one wins only if it beats every config, and a config is
    always kept as the fallback.
    """
    record = database.lookup(key)
    if record is not None:
        try:
            best_config = KernelConfig.from_json(record["config"])
            external = next((e for e in externals if e.name == record.get("external")), None)
            return TuningResult(best_config, True, 0.0, {}, {}, external=external,
                                shipped_from=record.get("shipped"))
        except (KeyError, TypeError, ValueError) as err:  # a hand-edited entry: tune again and overwrite it
            warnings.warn(f"dzc: ignoring a malformed tuning-database entry for {label} ({err!r}); retuning",
                          RuntimeWarning, stacklevel=2)
    if externals and run_external is None:
        raise ValueError("external candidates need run_external")
    start = time.perf_counter()
    timings: dict[str, float] = {}
    failures: dict[str, str] = {}
    best: tuple[float, KernelConfig] | None = None
    best_external: tuple[float, ExternalCandidate] | None = None
    candidates = [*configs, *externals]
    show_progress = False
    for index, candidate in enumerate(candidates):
        is_external = isinstance(candidate, ExternalCandidate)
        name = f"external {candidate.name}" if is_external else str(candidate)
        call = (lambda: run_external(candidate)) if is_external else (lambda: run(candidate))
        try:
            seconds = bench(call)
            wrong = None if is_external or check is None else check(candidate)
        except Exception as err:  # a candidate that does not compile or launch is skipped, never fatal
            failures[name] = f"{type(err).__name__}: {err}".splitlines()[0][:300]
            log.info("dzc: %s candidate %s failed: %s", label, name, failures[name])
            continue
        if wrong is not None:  # a miscompiled tiling may well be the fastest: it must never be chosen
            failures[name] = f"wrong result: {wrong}"[:300]
            log.warning("dzc: %s candidate %s skipped: %s", label, name, failures[name])
            continue
        timings[name] = seconds
        if is_external:
            if best_external is None or seconds < best_external[0]:
                best_external = (seconds, candidate)
        elif best is None or seconds < best[0]:
            best = (seconds, candidate)
        if config.AUTOTUNE_LOG.get() == "1":
            print(f"dzc autotune {label}: {name}: {seconds * 1e6:.1f} us", file=sys.stderr)
        show_progress = show_progress or time.perf_counter() - start > PROGRESS_AFTER_S
        if show_progress and sys.stderr.isatty():
            print(f"\rdzc: tuning {label}: {index + 1}/{len(candidates)} candidates", end="", file=sys.stderr)
    if show_progress:
        print(("\r" if sys.stderr.isatty() else "") + f"dzc: tuned {label}: {len(candidates)} candidates in "
              f"{time.perf_counter() - start:.1f} s", file=sys.stderr)
    if best is None:
        raise RuntimeError(f"dzc: every config of {label} failed: {failures}")
    external = best_external[1] if best_external is not None and best_external[0] < best[0] else None
    elapsed = time.perf_counter() - start
    database.store(key, {"config": best[1].to_json(), "seconds_per_call": best[0], "tuning_seconds": elapsed,
                         "configs_tried": len(configs), "configs_failed": len(failures),
                         "external": external.name if external else None,
                         "external_seconds_per_call": best_external[0] if best_external else None})
    return TuningResult(best[1], False, elapsed, timings, failures, external=external)
