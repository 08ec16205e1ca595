"""Which machine a measurement was made on: what a cost model's timings hold for, and nowhere else.

    machine_identity()      # "x86_64 AMD EPYC 7B13": the architecture and the CPU model where /proc/cpuinfo names it
    cpu_name()              # the CPU model, else what `platform` knows (a measurement's key)

Timings hold for the machine that made them: a cost model names its machine, and one from another is refused.
"""

import platform
from functools import cache
from pathlib import Path

CPUINFO = Path("/proc/cpuinfo")
CPU_NAME_FIELDS = ("model name", "Model", "Hardware", "cpu model")  # x86, then the names ARM and others use


@cache
def cpu_model() -> str | None:
    """The CPU's model name from /proc/cpuinfo (Linux), None where it names none."""
    if not CPUINFO.exists():
        return None
    fields = {}
    for line in CPUINFO.read_text(errors="replace").splitlines():
        name, _, value = line.partition(":")
        fields.setdefault(name.strip(), value.strip())
    return next((fields[name] for name in CPU_NAME_FIELDS if fields.get(name)), None)


def cpu_name() -> str:
    """The CPU model, else what `platform` says of the processor or the architecture (a measurement's key)."""
    return cpu_model() or platform.processor() or platform.machine()


def machine_identity() -> str:
    """The architecture and the CPU model where known: two machines with the same identity run the same kernels at
    comparable speeds, so a cost model measured on one holds on the other."""
    model = cpu_model()
    return f"{platform.machine()} {model}" if model else platform.machine()


def architecture(identity: str) -> str:
    """The architecture part of a `machine_identity` (all of it when it names no CPU model)."""
    return identity.split(" ", 1)[0]
