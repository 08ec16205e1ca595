"""What every engine comparison records beside its rows: the machine and the date, and a batch size's figures read
back."""

import os
import time

from medusa_like.forward.cpu.machine import cpu_name


def machine() -> str:
    """The CPU model and the cores this process may use."""
    return f"{cpu_name()}, {len(os.sched_getaffinity(0))} cores"


def stamp() -> str:
    return time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())


def batch_entry(batches: dict, size: int) -> dict | None:
    """One batch size's figures in a {batch size: figures} dict, read back from JSON or not (int keys become
    strings there)."""
    return batches.get(size) or batches.get(str(size))
