"""External kernels: other libraries' implementations of a dzc op, offered to the autotuner next to dzc's configs.

A provider is a function (op name, kernel spec, device profile) -> [ExternalCandidate]: an empty list where it
has nothing for that op, spec or device (or is not installed). Each candidate's fn takes the op's arguments
(without kernel_id) and returns the op's exact result. GeneratedKernel (targets/launch.py) asks every provider
when it is built; the tuner times the candidates like configs and records a winner by name, and the launch then
calls it (dzc/autotune.py: a process where the winner is not offered falls back to the best config).

PROVIDERS is the one explicit list. MATE (targets/mate_kernels.py) is its only entry; tests add a provider of
their own to exercise the wiring on machines without MATE.
"""

from __future__ import annotations

from collections.abc import Callable

from dzc.autotune import ExternalCandidate
from dzc.targets import mate_kernels
from dzc.targets.profiles import DeviceProfile

ExternalProvider = Callable[[str, object, DeviceProfile], list[ExternalCandidate]]

PROVIDERS: list[ExternalProvider] = [mate_kernels.candidates]


def candidates_for(op: str, spec, profile: DeviceProfile) -> list[ExternalCandidate]:
    """Every provider's candidates for `op` with `spec` on `profile`; names must be unique (the database keys
    a winner by name)."""
    found = [candidate for provider in PROVIDERS for candidate in provider(op, spec, profile)]
    names = [candidate.name for candidate in found]
    if len(set(names)) != len(names):
        raise ValueError(f"dzc: external kernel providers offer {op} candidates with duplicate names: {names}")
    return found
