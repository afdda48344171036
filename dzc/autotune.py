"""Autotuning: time each legal config of a kernel once, keep the winner in a persistent JSON database.

The database key names everything that invalidates a result (dzc version, profile, the device's tuning identity
(arch, multiprocessor count, toolkit, Triton flavour and TileLang versions), codegen and its version,
generated-source hash, dtypes and shape bucket, and `config_fingerprint`: the sources that decide what a config
means and whether it is legal: the family module with its config space and launch code, the targets modules it
uses, legality, the launcher, the codegen and the templates), so a stale entry is just not found. A stored config
is also checked against the current legal configs before it is used: one that is not among them (a hand edit, a
database shipped by another dzc) is ignored, retuned, and the report says so.
Writers take a file lock and replace the file atomically (temporary file + os.replace), so concurrent compiles and
a writer killed mid-write cannot corrupt it; a file that is corrupt anyway (a hand edit) is set aside with a
warning and rebuilt. A database that cannot be written (read-only or full disk) costs only the persistence: the
tuned config is used, and the report says it was not saved.

A shipped database (dzc-tune's output, given as CompileOptions.tuning_db or $DZC_TUNING_DB) is read-only and
consulted before the local one. It was tuned on one device; on any other (another arch, multiprocessor count,
toolkit or DSL version) it is refused with an error naming both devices, never partly used.

External candidates (a vendor library's kernel for the same op, e.g. MATE on MUSA) are timed next to the configs;
when one wins, the record names it, and a process where it is not installed uses the best config instead.
"""

from __future__ import annotations

import functools
import hashlib
import json
import logging
import os
import re
import sys
import tempfile
import time
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType

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

    def _parse(self) -> tuple[dict[str, dict] | None, str]:
        """(entries, "") or, for a file that is there but unreadable, (None, why)."""
        try:
            text = self.path.read_text()
        except FileNotFoundError:
            return {}, ""
        try:
            data = json.loads(text)
            if data.get("format") != FORMAT_VERSION or not isinstance(data.get("entries"), dict):
                raise ValueError(f"format {data.get('format')!r}, expected {FORMAT_VERSION}")
            return data["entries"], ""
        except (ValueError, AttributeError) as err:
            return None, str(err)

    def _read_file(self) -> dict[str, dict]:
        """The entries; a corrupt file is moved aside (the caller holds the lock, so no writer replaces it
        meanwhile) and counts as empty."""
        entries, why = self._parse()
        if entries is not None:
            return entries
        aside = self.path.with_name(self.path.name + ".corrupt")
        try:
            os.replace(self.path, aside)
            what = f"moved it to {aside} and starting a new one"
        except OSError as err:
            what = f"could not move it aside ({err}); tuning without it"
        warnings.warn(f"dzc: tuning database {self.path} is unreadable ({why}); {what}", RuntimeWarning,
                      stacklevel=4)
        return {}

    def _load(self) -> dict[str, dict]:
        try:
            mtime = self.path.stat().st_mtime_ns
        except FileNotFoundError:
            mtime = 0
        if self._entries is None or mtime != self._mtime_ns:
            # Writers replace the file atomically, so reading needs no lock (nor a writable directory); only
            # setting a corrupt file aside does.
            entries, _ = self._parse()
            if entries is None:
                try:
                    with self._lock:
                        entries = self._read_file()
                except OSError:  # no lock file in a read-only directory: nothing can be set aside there
                    entries = {}
                    warnings.warn(f"dzc: tuning database {self.path} is unreadable; tuning without it",
                                  RuntimeWarning, stacklevel=3)
            self._entries = entries
            self._mtime_ns = mtime
        return self._entries

    def records(self, key: dict) -> list[dict]:
        """The records for `key`, the shipped database's first (marked "shipped": its path), then the local one's."""
        found = []
        if self.shipped is not None:
            record = self.shipped.lookup(key)
            if record is not None:
                found.append({**record, "shipped": str(self.shipped.path)})
        record = self._load().get(self.key_string(key))
        return found + ([record] if record is not None else [])

    def lookup(self, key: dict) -> dict | None:
        """The record for `key`: from the shipped database when it has one, else from the local one."""
        return next(iter(self.records(key)), None)

    def entries_for_device(self, identity: dict) -> dict[str, dict]:
        """The local entries measured on the device with this tuning identity (what dzc-tune exports)."""
        return {k: v for k, v in self._load().items() if v.get("key", {}).get("device") == identity}

    def store(self, key: dict, record: dict) -> None:
        """Add `record` under `key`. Raises OSError when the file cannot be written (the old file stays whole)."""
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with self._lock:
            entries = self._read_file()  # merge with what other processes wrote meanwhile
            entries[self.key_string(key)] = {"key": key, **record}
            fd, tmp = tempfile.mkstemp(dir=self.path.parent, prefix=self.path.name, suffix=".tmp")
            try:
                with os.fdopen(fd, "w") as f:
                    json.dump({"format": FORMAT_VERSION, "entries": entries}, f, indent=1, sort_keys=True)
                    f.flush()
                    os.fsync(f.fileno())  # the rename must not reach the disk before the contents
                os.replace(tmp, self.path)
            except BaseException:
                Path(tmp).unlink(missing_ok=True)
                raise
            self._entries = entries
            self._mtime_ns = self.path.stat().st_mtime_ns


def open_shipped(tuning_db: str | None) -> ShippedTuningDatabase | None:
    """The shipped database named by `tuning_db` (CompileOptions.tuning_db) or else $DZC_TUNING_DB, if any.
    dzc.compile opens it once to check it, so that a missing or malformed file is an error there and then."""
    path = tuning_db or config.TUNING_DB.get()
    if not path:
        return None
    try:
        return _read_shipped(Path(path))
    except TuningDatabaseError as err:
        raise TuningDatabaseError(f"{err} (named by {'CompileOptions.tuning_db' if tuning_db else 'DZC_TUNING_DB'})"
                                  ) from None


_SHIPPED: dict[tuple, "ShippedTuningDatabase"] = {}


def _read_shipped(path: Path) -> "ShippedTuningDatabase":
    """The file parsed once per version of it (lowering opens the database for every graph, and the rewrite
    check's rebuilds again): it is read-only, so a changed mtime or size is the only reason to read it anew."""
    try:
        stat = path.stat()
    except OSError:
        return ShippedTuningDatabase(path)  # which says what is wrong with the path
    key = (str(path.resolve()), stat.st_mtime_ns, stat.st_size)
    if key not in _SHIPPED:
        _SHIPPED[key] = ShippedTuningDatabase(path)
    return _SHIPPED[key]


def open_database(cache_dir: str | os.PathLike, tuning_db: str | None) -> TuningDatabase:
    """The database lowering uses: the cache directory's, behind the shipped one (open_shipped), if any."""
    return TuningDatabase(Path(cache_dir) / "tuning.json", open_shipped(tuning_db))


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


def _targets_modules_used(roots: list[ModuleType]) -> dict[str, ModuleType]:
    """`roots` and the dzc.targets modules they use (import, or import names from), transitively."""
    modules: dict[str, ModuleType] = {}
    pending = list(roots)
    while pending:
        module = pending.pop()
        if module.__name__ in modules:
            continue
        modules[module.__name__] = module
        for value in vars(module).values():
            name = value.__name__ if isinstance(value, ModuleType) else getattr(value, "__module__", None)
            if isinstance(name, str) and name.startswith("dzc.targets.") and name not in modules:
                pending.append(sys.modules[name])
    return modules


@functools.cache
def config_fingerprint(family: ModuleType, codegen: ModuleType) -> str:
    """A hash of every source that decides what a config of `family` means and whether it is legal for `codegen`:
    the family module (spec, config space, shared-memory estimate, launch code) and the dzc.targets modules it
    uses, transitively (legality, kernel_config, helpers such as another family's config spaces), the launcher and
    the codegen module (with its version), and the templates the family names. Any edit there retunes; the
    generated-source hash alone misses a config space, a legality rule or a launch that changed."""
    from dzc.targets import kernel_config, launch, legality  # dzc.targets.launch imports this module

    family_modules = _targets_modules_used([family])
    modules = {**family_modules, **_targets_modules_used([codegen, legality, kernel_config, launch])}
    digest = hashlib.sha256(f"{codegen.__name__} {getattr(codegen, 'VERSION', '')}".encode())
    sources = {name: Path(module.__file__).read_text() for name, module in sorted(modules.items())}
    # The templates the family's own code names ("add_rms_norm.triton.py.tmpl", or a stem formatted in), from
    # the directories it reads them from (its TEMPLATES).
    named = set(re.findall(r"[A-Za-z_][A-Za-z0-9_]*", "\n".join(sources[name] for name in family_modules)))
    directories = {Path(m.TEMPLATES) for m in family_modules.values() if hasattr(m, "TEMPLATES")}
    for path in sorted(p for directory in directories for p in directory.glob("*.tmpl")):
        if path.name.split(".")[0] in named:
            sources[path.name] = path.read_text()
    for name, text in sources.items():
        digest.update(f"\0{name}\0{text}".encode())
    return digest.hexdigest()[:16]


@dataclass(frozen=True)
class ExternalCandidate:
    """A vendor library's kernel for an op, offered to the tuner next to dzc's configs (e.g. MATE on MUSA).

    fn has the op's signature (its arguments without kernel_id) and returns the op's results.
    """

    name: str  # "mate.flash_attn_varlen_func": stable, recorded in the database
    fn: Callable[..., object]


# The device facts a shipped database was tuned on; a device differing in any of them is refused.
IDENTITY_FIELDS = ("device_type", "device", "arch", "multiprocessors", "toolkit", "triton", "tilelang")


class TuningDatabaseError(ValueError):
    """A shipped tuning database that cannot be used: missing, unreadable, not one, or from another device."""


class TuningDatabaseMismatch(TuningDatabaseError):
    """A shipped tuning database was made on another device than the one tuning asks about."""


class ShippedTuningDatabase:
    """dzc-tune's output: entries tuned on one device (its identity is the file's `device`), read-only."""

    KIND = "dzc shipped tuning database"

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)
        try:
            data = json.loads(self.path.read_text())
        except FileNotFoundError:
            raise TuningDatabaseError(f"dzc: tuning database {self.path} does not exist") from None
        except OSError as err:  # a directory, no permission
            raise TuningDatabaseError(f"dzc: cannot read tuning database {self.path} ({err.strerror or err})"
                                      ) from None
        except ValueError as err:
            raise TuningDatabaseError(f"dzc: tuning database {self.path} is not JSON ({err})") from None
        if not isinstance(data, dict) or data.get("kind") != self.KIND:
            raise TuningDatabaseError(f"dzc: {self.path} is not a shipped tuning database (dzc-tune --out writes "
                                      f"them; the local cache's tuning.json is not one)")
        if data.get("format") != FORMAT_VERSION:
            raise TuningDatabaseError(f"dzc: tuning database {self.path} has format {data.get('format')!r}; this "
                                      f"dzc reads format {FORMAT_VERSION}")
        device, entries = data.get("device"), data.get("entries")
        if not isinstance(device, dict) or set(device) != set(IDENTITY_FIELDS) or not isinstance(entries, dict):
            raise TuningDatabaseError(f"dzc: tuning database {self.path} lacks its device identity or entries")
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
    # What went wrong around the tuning and was worked around: a stored config no longer legal (ignored,
    # retuned), a database that could not be written (the result is used, not saved).
    notes: list[str] = field(default_factory=list)

    @property
    def how(self) -> str:
        if self.shipped_from:
            how = f"shipped tuning database {self.shipped_from}"
        elif self.from_cache:
            how = "tuning database"
        else:
            how = f"timed {len(self.timings) + len(self.failures)} candidates"
        return "; ".join([how, *self.notes])


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
    check_external: Callable[[object], str | None] | None = None,
    before_timing: Callable[[], None] | None = None,
) -> TuningResult:
    """Pick the fastest config: from the database when the key is known, else by timing each one.

    run(config) launches the kernel once on real arguments. A config that fails to compile or run is skipped
    and logged; so is one for which check(config), called after its timed runs, says why its result is wrong.
    Tuning fails only when every config does. externals are timed the same way, through run_external(candidate)
    (which calls candidate.fn on the same arguments and returns its results, which check_external(results) judges
    as check judges a config's); one wins only if it beats every config, and a config is always kept as the
    fallback. before_timing() runs once before the first candidate is timed (not on a database hit).
    """
    notes: list[str] = []
    for record in database.records(key):
        where = f"shipped tuning database {record['shipped']}" if "shipped" in record else "tuning database"
        try:
            best_config = KernelConfig.from_json(record["config"])
        except (KeyError, TypeError, ValueError) as err:  # a hand-edited entry: tune again and overwrite it
            warnings.warn(f"dzc: ignoring a malformed {where} entry for {label} ({err!r}); retuning",
                          RuntimeWarning, stacklevel=2)
            notes.append(f"ignored a malformed {where} entry")
            continue
        if best_config not in configs:  # legal when it was stored; the config space or legality changed since
            notes.append(f"ignored the {where}'s config {best_config}: not a legal config now")
            warnings.warn(f"dzc: {label}: {notes[-1]}; retuning", RuntimeWarning, stacklevel=2)
            continue
        external = next((e for e in externals if e.name == record.get("external")), None)
        return TuningResult(best_config, True, 0.0, {}, {}, external=external, shipped_from=record.get("shipped"),
                            notes=notes)
    if externals and run_external is None:
        raise ValueError("external candidates need run_external")
    if before_timing is not None:
        before_timing()
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
        last: list = []  # an external candidate's results from its last timed run, for check_external

        if is_external:
            def call(candidate=candidate, last=last):
                last[:] = [run_external(candidate)]
        else:
            def call(candidate=candidate):
                return run(candidate)
        try:
            seconds = bench(call)
            if is_external:
                wrong = None if check_external is None else check_external(last[0])
            else:
                wrong = None if check is None else check(candidate)
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
    try:
        database.store(key, {"config": best[1].to_json(), "seconds_per_call": best[0], "tuning_seconds": elapsed,
                             "configs_tried": len(configs), "configs_failed": len(failures),
                             "external": external.name if external else None,
                             "external_seconds_per_call": best_external[0] if best_external else None})
    except OSError as err:  # a read-only cache or a full disk: the result stands, it is only not remembered
        notes.append(f"not saved to {database.path}: {type(err).__name__}: {err}")
        warnings.warn(f"dzc: tuned {label} but could not save it to {database.path} ({err}); it will be tuned "
                      f"again in the next process", RuntimeWarning, stacklevel=2)
    return TuningResult(best[1], False, elapsed, timings, failures, external=external, notes=notes)
