"""Autotuning: time each legal config of a kernel once, keep the winner in a persistent JSON database.

The database key names everything that invalidates a result (dzc version, profile and device, codegen and its
version, generated-source hash, dtypes and shape bucket), so a stale entry is never used; it is just not found.
Writers take a file lock and replace the file atomically, so concurrent compiles cannot corrupt it; a file that
is corrupt anyway (a crash elsewhere, a hand edit) is set aside with a warning and rebuilt.
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
    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)
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
        return self._load().get(self.key_string(key))

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


@dataclass
class TuningResult:
    config: KernelConfig
    from_cache: bool
    seconds_tuning: float
    timings: dict[str, float]  # config text -> seconds per call; empty when from the cache
    failures: dict[str, str]  # config text -> why it was skipped


def tune(
    label: str,
    key: dict,
    configs: Sequence[KernelConfig],
    run: Callable[[KernelConfig], object],
    bench: Callable[[Callable[[], object]], float],
    database: TuningDatabase,
) -> TuningResult:
    """Pick the fastest config: from the database when the key is known, else by timing each one.

    run(config) launches the kernel once on real arguments. A config that fails to compile or run is skipped
    and logged; tuning fails only when every config does.
    """
    record = database.lookup(key)
    if record is not None:
        try:
            return TuningResult(KernelConfig.from_json(record["config"]), True, 0.0, {}, {})
        except (KeyError, TypeError, ValueError) as err:  # a hand-edited entry: tune again and overwrite it
            warnings.warn(f"dzc: ignoring a malformed tuning-database entry for {label} ({err!r}); retuning",
                          RuntimeWarning, stacklevel=2)
    start = time.perf_counter()
    timings: dict[str, float] = {}
    failures: dict[str, str] = {}
    best: tuple[float, KernelConfig] | None = None
    show_progress = False
    for index, cfg in enumerate(configs):
        try:
            seconds = bench(lambda: run(cfg))
        except Exception as err:  # a config that does not compile or launch is skipped, never fatal
            failures[str(cfg)] = f"{type(err).__name__}: {err}".splitlines()[0][:300]
            log.info("dzc: %s config %s failed: %s", label, cfg, failures[str(cfg)])
            continue
        timings[str(cfg)] = seconds
        if best is None or seconds < best[0]:
            best = (seconds, cfg)
        if config.AUTOTUNE_LOG.get() == "1":
            print(f"dzc autotune {label}: {cfg}: {seconds * 1e6:.1f} us", file=sys.stderr)
        show_progress = show_progress or time.perf_counter() - start > PROGRESS_AFTER_S
        if show_progress and sys.stderr.isatty():
            print(f"\rdzc: tuning {label}: {index + 1}/{len(configs)} configs", end="", file=sys.stderr)
    if show_progress:
        print(("\r" if sys.stderr.isatty() else "") + f"dzc: tuned {label}: {len(configs)} configs in "
              f"{time.perf_counter() - start:.1f} s", file=sys.stderr)
    if best is None:
        raise RuntimeError(f"dzc: every config of {label} failed: {failures}")
    elapsed = time.perf_counter() - start
    database.store(key, {"config": best[1].to_json(), "seconds_per_call": best[0], "tuning_seconds": elapsed,
                         "configs_tried": len(configs), "configs_failed": len(failures)})
    return TuningResult(best[1], False, elapsed, timings, failures)
