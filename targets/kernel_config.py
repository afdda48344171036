"""KernelConfig: one point of a kernel's tuning space, as frozen, hashable, printable data."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class KernelConfig:
    # Compile-time block parameters, sorted by name: Triton constexprs or TileLang factory arguments.
    params: tuple[tuple[str, int], ...]
    # Triton: warps per program (each warp is profile.warp_size lanes). TileLang: unused (threads is a param).
    num_warps: int = 4
    num_stages: int = 1

    @staticmethod
    def make(num_warps: int = 4, num_stages: int = 1, **params: int) -> "KernelConfig":
        return KernelConfig(tuple(sorted(params.items())), num_warps, num_stages)

    def __getitem__(self, name: str) -> int:
        return dict(self.params)[name]

    def __str__(self) -> str:
        blocks = " ".join(f"{k}={v}" for k, v in self.params)
        return f"{blocks} num_warps={self.num_warps} num_stages={self.num_stages}"

    def to_json(self) -> dict:
        return {"params": dict(self.params), "num_warps": self.num_warps, "num_stages": self.num_stages}

    @staticmethod
    def from_json(data: dict) -> "KernelConfig":
        return KernelConfig.make(data["num_warps"], data["num_stages"], **data["params"])
