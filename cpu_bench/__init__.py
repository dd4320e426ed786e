"""The CPU test bench: emulated device types on this machine, wrapped around the runtime's ranks at setup."""

from cpu_bench.emulation import wrap_rank

__all__ = ["wrap_rank"]
