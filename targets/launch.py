"""The launcher: a generated kernel bound to its spec, codegen, profile and tuner, called with the op's arguments.

A GeneratedKernel is what a lowered dzc op runs. It reshapes the arguments to the kernel's 2-D view, allocates
outputs, picks the config for the call's token bucket (tuning it on first use, or reading the tuning database),
and launches through the codegen's launch function.
"""

from __future__ import annotations

import contextvars
import dataclasses
import functools
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType

import torch
import torch.utils._pytree as pytree

import dzc
from dzc import config as dzc_config
from dzc.autotune import ExternalCandidate, TuningDatabase, config_fingerprint, tune
from dzc.targets import external_kernels
from dzc.targets.kernel_config import KernelConfig
from dzc.targets.legality import config_problems
from dzc.targets.profiles import DeviceProfile


# Set on a precompile's thread (triton_codegen.Precompile): a GeneratedKernel call there only compiles what the
# call would launch (GeneratedKernel.precompile), and the codegen's launches compile without running anything.
COMPILE_ONLY: contextvars.ContextVar[bool] = contextvars.ContextVar("dzc_compile_only", default=False)


@dataclass
class KernelRecord:
    """What the compile report says about one generated kernel; filled in as the kernel gets used."""

    kernel_id: str
    op: str
    codegen: str
    profile: str
    spec: str
    source_path: str
    execution: str  # "gpu" | "triton interpreter (cpu)" | "not runnable here: <why>"
    configs_considered: int
    configs_illegal: int
    uses: int = 1  # dzc op nodes of the graph that run this kernel
    # token bucket -> {"config": str, "from_cache": bool, "tuning_seconds": float, "failed_configs": int}
    tuned: dict[int, dict] = field(default_factory=dict)
    # Other libraries' kernels for the op (targets/external_kernels.py) timed next to the configs; a bucket's
    # entry names the one that won ("external"), which then runs instead of the generated kernel.
    external_candidates: list[str] = field(default_factory=list)
    # What went wrong around this kernel and was worked around (a cache directory that could not be written).
    notes: list[str] = field(default_factory=list)
    # The op's kernels from its other codegens (codegen "auto" with tuning), timed against this kernel's configs
    # as the candidates "dzc.<codegen>"; a bucket whose winner is one runs it ("external" names it).
    alternatives: list[KernelRecord] = field(default_factory=list)
    # Legal configs left out of tuning because their kernels have not run on a GPU yet: {why: count}
    # (tuning_candidates; DZC_TUNE_UNVALIDATED=1 times them too).
    configs_unvalidated: dict[str, int] = field(default_factory=dict)

    def to_json(self) -> dict:
        return dataclasses.asdict(self)


def unvalidated_reason(family: ModuleType, config: KernelConfig) -> str | None:
    """Why `config` has not run on a GPU yet (None where it has): the first entry of the family's UNVALIDATED list,
    (params, why) pairs, whose params all hold in `config`. A kernel that never ran may hang or fault the device,
    which the tuner's agreement check cannot catch: a hung launch never returns, and a faulting one leaves the
    process's CUDA context unusable for every candidate after it. An entry goes once its GPU numerics pass."""
    params = dict(config.params)
    for match, why in getattr(family, "UNVALIDATED", ()):
        if all(params.get(name) == value for name, value in match.items()):
            return f"{' '.join(f'{name}={value}' for name, value in match.items())}: {why}"
    return None


def check_default_validated(family: ModuleType, default: KernelConfig) -> None:
    why = unvalidated_reason(family, default)
    if why is not None:  # a family bug: the untuned choice must be a config that has run on a GPU
        raise AssertionError(f"{family.__name__}: the untuned default {default} has not run on a GPU ({why})")


def tuning_candidates(family: ModuleType, configs: Sequence[KernelConfig], default: KernelConfig,
                      ) -> tuple[list[KernelConfig], dict[str, int]]:
    """(the configs the tuner times, {why: count} of those left out): configs that have not run on a GPU yet are
    left out unless DZC_TUNE_UNVALIDATED=1. The untuned default is never one (a family that made it one is an
    error here, not a silent fallback)."""
    check_default_validated(family, default)
    if dzc_config.TUNE_UNVALIDATED.get() == "1":
        return list(configs), {}
    kept, left_out = [], {}
    for candidate in configs:
        why = unvalidated_reason(family, candidate)
        if why is None:
            kept.append(candidate)
        else:
            left_out[why] = left_out.get(why, 0) + 1
    return kept, left_out


def legal_configs(family: ModuleType, codegen: str, spec, profile: DeviceProfile) -> tuple[list[KernelConfig], int]:
    """The family's config space for `codegen`, pruned by the profile; returns (legal configs, number dropped)."""
    configs = getattr(family, f"{codegen}_configs")(spec, profile)
    smem = getattr(family, f"{codegen}_shared_memory_bytes")
    legal = [c for c in configs
             if not config_problems(profile, threads=c.num_warps * profile.warp_size,
                                    num_warps=c.num_warps if codegen == "triton" else None,
                                    shared_memory_bytes=smem(spec, c), dtypes=spec.dtypes)]
    return legal, len(configs) - len(legal)


# A candidate config whose outputs differ from the first config's by more than this share of their largest
# magnitude (or in where they are NaN or infinite) computes something else: a miscompile, not rounding (rounding
# differences between tilings stay below 1% for every family's dtypes).
DISAGREEMENT = 2.0 ** -4


def _floating(values) -> list[torch.Tensor]:
    return [v for v in pytree.tree_leaves(values) if isinstance(v, torch.Tensor) and v.is_floating_point()]


def agreement_check(outputs: tuple, results=None, values: Callable | None = None):
    """(check(config), check_external(returned)) for autotune.tune: the floating outputs a config wrote, or the
    results an external candidate returned, against what the first config that ran wrote (the launcher times the
    untuned default first; `results` are the op's results that its outputs hold). Integer outputs are not compared
    as they are (top-k positions, whose ties may legitimately differ): a family whose results are integers gives
    `values` (its agreement_values: results -> tensors that every right answer makes equal, e.g. each row's
    selected logits, sorted), compared instead, exactly. Each returns why a candidate disagrees, or None."""
    def compared(returned) -> list[torch.Tensor]:
        return list(values(returned)) if values is not None else _floating(returned)

    disagreement = _difference if values is not None else _disagreement
    floating = _floating(outputs)
    first: list[torch.Tensor] = []
    first_results: list[torch.Tensor] = []

    def check(config: KernelConfig) -> str | None:
        current = compared(results) if values is not None else floating
        if not first:
            first.extend(o.detach().clone() for o in current)
            first_results.extend(r.detach().clone() for r in compared(results))
            return None
        return disagreement(first, current)

    def check_external(returned) -> str | None:
        got = compared(returned)
        if len(got) != len(first_results) or any(g.shape != e.shape for g, e in zip(got, first_results)):
            return (f"returned {[tuple(g.shape) for g in got]}, the first config's results are "
                    f"{[tuple(e.shape) for e in first_results]}")
        return disagreement(first_results, got)

    return check, check_external


def _disagreement(first: list[torch.Tensor], floating: list[torch.Tensor]) -> str | None:
    for expected, got in zip(first, floating):
        expected, got = expected.float(), got.float()
        finite = expected.isfinite()
        if not torch.equal(finite, got.isfinite()):
            return "NaN or infinite values where the first config's outputs have none, or the reverse"
        if finite.any():
            error = (got[finite] - expected[finite]).abs().max().item()
            scale = expected[finite].abs().max().item()
            if error > DISAGREEMENT * scale:
                return f"max difference {error:.3g} from the first config's outputs (their largest: {scale:.3g})"
    return None


def _difference(first: list[torch.Tensor], got: list[torch.Tensor]) -> str | None:
    """Exact comparison of a family's agreement_values (NaN where NaN)."""
    for expected, actual in zip(first, got):
        differs = (expected != actual) & ~(expected.isnan() & actual.isnan())
        if differs.any():
            rows = differs.reshape(differs.shape[0], -1).any(dim=1).sum().item() if differs.dim() else 1
            return f"{differs.sum().item()} values in {rows} rows differ from the first config's"
    return None


class GeneratedKernel:
    def __init__(self, *, family: ModuleType, spec, codegen: ModuleType, profile: DeviceProfile, runtime,
                 compiled, source_path: Path, source_hash: str, record: KernelRecord, autotune: bool,
                 database: TuningDatabase, alternatives: Sequence[GeneratedKernel] = ()):
        self.family = family
        self.spec = spec
        self.codegen = codegen
        self.profile = profile
        self.runtime = runtime
        self.compiled = compiled  # the codegen's loaded kernel object
        self.source_path = source_path
        self.source_hash = source_hash
        self.record = record
        self.autotune = autotune
        self.database = database
        self._launch = getattr(family, f"{codegen.NAME}_launch")
        self._default = getattr(family, f"{codegen.NAME}_default_config")(spec, profile)
        self._configs, left_out = tuning_candidates(family, legal_configs(family, codegen.NAME, spec, profile)[0],
                                                    self._default)
        record.configs_unvalidated = left_out
        self._config_by_bucket: dict[int, KernelConfig] = {}
        self._alternatives = list(alternatives)
        self._externals = external_kernels.candidates_for(record.op, spec, profile) + [
            ExternalCandidate(f"dzc.{kernel.codegen.NAME}", kernel) for kernel in self._alternatives]
        record.external_candidates = [candidate.name for candidate in self._externals]
        record.alternatives = [kernel.record for kernel in self._alternatives]
        self._external_by_bucket: dict[int, ExternalCandidate | None] = {}
        self._by_tokens: dict[int, tuple[KernelConfig, ExternalCandidate | None]] = {}

    def _tuning_key(self, bucket: int, device: torch.device) -> dict:
        return {
            "dzc": dzc.__version__, "profile": self.profile.name, "profile_hash": self.profile.fingerprint,
            "device": self.runtime.tuning_identity(device), "codegen": self.codegen.NAME,
            "codegen_version": self.codegen.VERSION, "source_hash": self.source_hash, "op": self.record.op,
            "config_fingerprint": config_fingerprint(self.family, self.codegen),
            "spec": self.spec.describe(), "token_bucket": bucket,
            # Only where there are any, so that the keys of kernels without alternatives stay as they were.
            **({"alternatives": [f"{kernel.codegen.NAME}:{kernel.source_hash}" for kernel in self._alternatives]}
               if self._alternatives else {}),
        }

    def _config_for(self, bucket: int, inputs: tuple, outputs: tuple, results, op_args: tuple) -> KernelConfig:
        config = self._config_by_bucket.get(bucket)
        if config is not None:
            return config
        start = time.perf_counter()
        configs, default = self._candidates(bucket)
        external = None
        if not self._tuned(configs):
            config = default
            entry = {"config": str(config), "from_cache": False, "tuning_seconds": 0.0, "failed_configs": 0,
                     "how": "untuned default"}
        else:
            args = inputs + outputs
            device = args[0].device
            if default in configs:  # timed first, so that its outputs are what the others are checked against
                configs = [default, *(c for c in configs if c != default)]
            derive = getattr(self.family, "agreement_values", None)  # integer results: what is compared instead
            check, check_external = agreement_check(
                outputs, results, None if derive is None else functools.partial(derive, inputs))
            result = tune(
                f"{self.record.kernel_id}[tokens<={bucket}]", self._tuning_key(bucket, device), configs,
                run=lambda cfg: self._launch(self.compiled, cfg, *args),
                bench=lambda fn: self.runtime.bench(fn, device), database=self.database,
                externals=self._externals, run_external=lambda candidate: candidate.fn(*op_args),
                check=check, check_external=check_external,
                before_timing=lambda: self._prepare_alternatives(op_args))
            config, external = result.config, result.external
            # tune() names an external candidate's entries "external <name>"
            external_failures = {name: why for name, why in result.failures.items() if name.startswith("external ")}
            entry = {"config": str(config), "from_cache": result.from_cache,
                     "tuning_seconds": round(time.perf_counter() - start, 3),
                     "failed_configs": len(result.failures) - len(external_failures),
                     "failures": {name: why for name, why in result.failures.items() if name not in external_failures},
                     "how": result.how}
            if self._externals:  # why a vendor kernel was skipped is what its owner needs to know
                entry["external_failures"] = external_failures
        describe = getattr(self.family, "describe_config", None)
        if describe is not None:  # e.g. which path (online dequant or workspace) the chosen config runs
            entry["path"] = describe(config)
        if self._externals:
            entry["external"] = external.name if external is not None else None
        self.record.tuned[bucket] = entry
        self._config_by_bucket[bucket] = config
        self._external_by_bucket[bucket] = external
        return config

    def _candidates(self, bucket: int) -> tuple[list[KernelConfig], KernelConfig]:
        """(the configs tuning times for `bucket`, the untuned default among them)."""
        configs, default = self._configs, self._default
        narrow = getattr(self.family, "configs_for_bucket", None)
        if narrow is not None:  # a family whose tiles (or path) depend on the token count times only those
            configs, default = narrow(self.spec, self.profile, bucket, configs, default)
            check_default_validated(self.family, default)
        return configs, default

    def _tuned(self, configs: list[KernelConfig]) -> bool:
        return self.autotune and (len(configs) > 1 or bool(self._externals))

    def precompile(self, *op_args) -> None:
        """Launch, with the codegen's compile-only mode on (triton_codegen.Precompile's jobs), what a call with
        `op_args` launches: its kernels compile and nothing runs. Raises where the call's config is not known
        before the call (it is tuned then)."""
        inputs, outputs, tokens, _ = self.family.prepare(self.spec, *op_args)
        if not tokens:
            return
        configs, default = self._candidates(self.family.token_bucket(tokens))
        if self._tuned(configs):
            raise LookupError("its config is tuned at the first call")
        self._launch(self.compiled, default, *inputs, *outputs)

    def _prepare_alternatives(self, op_args: tuple) -> None:
        """Each alternative picks its config for the call's bucket (tuning it, or from the database) outside the
        timing of the candidates."""
        for kernel in self._alternatives:
            try:
                kernel(*op_args)
            except Exception:  # tune() runs it again as a candidate and records why it fails
                pass

    def __call__(self, *op_args):
        if COMPILE_ONLY.get():
            return self.precompile(*op_args)
        inputs, outputs, tokens, results = self.family.prepare(self.spec, *op_args)
        if tokens:
            # (config, external) per token count, so that a repeated count costs one lookup
            chosen = self._by_tokens.get(tokens)
            if chosen is None:
                if len(self._by_tokens) >= 4096:  # prefill of ever new lengths: bounded
                    self._by_tokens.clear()
                bucket = self.family.token_bucket(tokens)
                config = self._config_for(bucket, inputs, outputs, results, op_args)
                chosen = self._by_tokens[tokens] = (config, self._external_by_bucket[bucket])
            config, external = chosen
            if external is not None:  # another library's kernel beat every config (prepare's outputs go unused)
                return external.fn(*op_args)
            self._launch(self.compiled, config, *inputs, *outputs)
        return results
