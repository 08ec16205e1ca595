"""The kernels a cost model's times were measured with: named in an opaque record, checked, set, and chosen.

The decoding core sees a cost model as milliseconds against node counts; which kernels computed those milliseconds is
this package's business. A cost model carries them as a record that only this module reads:

    record = current_kernels(target, sizes)      # what the target's layers run now, for those tree sizes
    check_kernels(record, target)                # KernelRecordError if malformed, KernelMismatchError if foreign
    apply_kernels(record, target)                # set them, so that the cost model's times hold
    choice = KernelChoice(target, sizes, prefix) # a measurement's alternatives: timed per size, the fastest kept

A record is a dict: `linears` ("few_row" or "nn.Linear": what computes the linear layers), `rows` ({tree size as a
string: row kernel of `few_row_linear.ROW_KERNELS`}, or None) and `prefill` (a kernel of `PREFILL_KERNELS`, or None).
None for rows or prefill leaves the layers as they are.

Why a whole forward picks the kernel: a row plan is the best guess of one layer timed alone, while a whole forward
shares caches and threads; per tree size, whole forwards are timed with each row kernel this machine can run and the
fastest is kept, `F.linear` (transformers' own product) unless another is over KERNEL_MARGIN faster.
"""

from torch import nn

from .few_row_linear import (
    KERNEL_ROWS,
    MAX_ROWS,
    ONEDNN,
    PREFILL_KERNELS,
    ROW_KERNELS,
    FewRowLinear,
    has_row_plans,
    kernel_rows,
    linear_kernel,
    measure_row_plans,
    set_prefill_kernel,
    set_row_kernel,
    sync_packs,
    usable_row_kernels,
)
from .row_plans import cached_row_plan

KERNEL_MARGIN = 1.03  # another row kernel replaces F.linear for a size only if over 3% faster
LINEARS = ("few_row", "few_row_fp32_kernel", "nn.Linear")
RECORD_FIELDS = ("linears", "rows", "prefill")


class KernelRecordError(ValueError):
    """A kernel record that is not one: the message names the field and its value."""


class KernelMismatchError(ValueError):
    """A kernel record of other layers than the target's, or naming kernels this machine cannot run."""


# ---- records ----


def validate_record(record) -> dict | None:
    """`record` checked for form (None: nothing recorded)."""
    if record is None:
        return None
    if not isinstance(record, dict):
        raise KernelRecordError(f"kernels must be a JSON object with {list(RECORD_FIELDS)}, got {record!r}")
    unknown = set(record) - set(RECORD_FIELDS)
    if unknown:
        raise KernelRecordError(f"kernels: unknown fields {sorted(unknown)}; known: {list(RECORD_FIELDS)}")
    record = {"linears": record.get("linears"), "rows": record.get("rows"), "prefill": record.get("prefill")}
    if record["linears"] not in LINEARS:
        raise KernelRecordError(f"kernels.linears must be one of {list(LINEARS)}, got {record['linears']!r}")
    rows = record["rows"]
    if rows is not None:
        if not isinstance(rows, dict):
            raise KernelRecordError(f"kernels.rows must map tree sizes to row kernels, got {rows!r}")
        for size, kernel in rows.items():
            if not (isinstance(size, str) and size.isdigit() and 1 <= int(size) <= KERNEL_ROWS):
                raise KernelRecordError(f"kernels.rows: tree size {size!r} is not one of 1..{KERNEL_ROWS}")
            if kernel not in ROW_KERNELS:
                raise KernelRecordError(f"kernels.rows[{size}]: row kernel {kernel!r} is not one of {ROW_KERNELS}")
    if record["prefill"] is not None and record["prefill"] not in PREFILL_KERNELS:
        raise KernelRecordError(f"kernels.prefill must be one of {PREFILL_KERNELS} or null, got {record['prefill']!r}")
    return record


def check_kernels(record, target: nn.Module) -> None:
    """Refuse a record of other layers than `target`'s, or one naming kernels this machine cannot run for it."""
    record = validate_record(record)
    if record is None:
        return
    if record["linears"] != linear_kernel(target):
        raise KernelMismatchError(
            f"measured with linears {record['linears']!r}, but this target's are {linear_kernel(target)!r}"
        )
    if has_row_plans(target):
        named = {*(record["rows"] or {}).values(), *([record["prefill"]] if record["prefill"] else [])}
        unusable = named - set(usable_row_kernels(target))
        if unusable:
            raise KernelMismatchError(
                f"its kernels {sorted(unusable)} cannot run here (no MKL or oneDNN, or too little memory for their "
                "packs)"
            )


def apply_kernels(record, target: nn.Module) -> None:
    """Set the record's kernels on `target`'s planned layers (after `check_kernels`), for every row count it covers
    (`every_row_count`), and make the packs they run."""
    record = validate_record(record)
    if record is None or not has_row_plans(target):
        return
    for rows, kernel in every_row_count(record["rows"] or {}).items():
        set_row_kernel(target, rows, kernel)
    if record["prefill"] is not None:
        set_prefill_kernel(target, record["prefill"])
    sync_packs(target)


def every_row_count(rows: dict[str, str]) -> dict[int, str]:
    """A record's row kernels (tree size as a string -> kernel) for every row count from 1 to KERNEL_ROWS: a count it
    does not name runs the kernel of the next larger size it names (of the largest, past it). A cost model measures
    some sizes (1-16, 20, 24, 32) and interpolates the times between them; a verification of 17 nodes must run the
    kernel whose times it interpolates, not the layers' own plans (slower where oneDNN's pack wins: measured in
    docs/cpu-kernels.md)."""
    named = sorted((int(size), kernel) for size, kernel in rows.items())
    if not named:
        return {}
    return {
        count: next((kernel for size, kernel in named if size >= count), named[-1][1])
        for count in range(1, KERNEL_ROWS + 1)
    }


def layers_identity(target: nn.Module) -> str:
    """What computes `target`'s linear layers: part of a cost model cache's key."""
    return linear_kernel(target)


def current_kernels(target: nn.Module, sizes) -> dict:
    """The record of what `target` runs now for the tree sizes of `sizes` up to KERNEL_ROWS: per size the first row
    kernel that gives every planned layer its present plan entry (None when none does: sizes set one layer at a time),
    and the prefill kernel they share. Never measures a plan: "planned" is named only where the plans are cached."""
    layers = [m for m in target.modules() if isinstance(m, FewRowLinear) and m.plan]
    record = {"linears": linear_kernel(target), "rows": None, "prefill": None}
    if not layers:
        return record
    own = [cached_row_plan(m.weight) for m in layers]
    kernels = [k for k in usable_row_kernels(target) if k != "planned" or all(p is not None for p in own)]
    rows = {}
    for size in (s for s in sizes if 1 <= s <= KERNEL_ROWS):
        named = (
            k
            for k in kernels
            if all(
                m.plan[size - 1] == kernel_rows(k, size, p[size - 1] if p else 0)
                for m, p in zip(layers, own, strict=True)
            )
        )
        rows[str(size)] = next(named, None)
    record["rows"] = None if None in rows.values() else rows
    prefills = {m.prefill for m in layers}
    if len(prefills) == 1:
        record["prefill"] = "onednn" if prefills == {ONEDNN} else "linear"
    return record


# ---- choosing by whole forwards ----


def fastest_kernel(medians: dict, kernels) -> str:
    """The kernel of `kernels` with the least median ms (`medians[kernel]`), `F.linear` (transformers' own product)
    unless another is more than KERNEL_MARGIN faster."""
    kernel = min(kernels, key=lambda k: medians[k])
    return kernel if medians[kernel] * KERNEL_MARGIN <= medians["linear"] else "linear"


def pick_row_kernels(target: nn.Module, sizes, medians: dict, kernels: tuple[str, ...]) -> list[str]:
    """Per size, the fastest row kernel of `kernels` by `fastest_kernel` (`medians[(size, kernel)]`); sets the target's
    layers to them, for the row counts between the sizes too (`every_row_count`), and drops unused packs."""
    picked = [fastest_kernel({k: medians[(size, k)] for k in kernels}, kernels) for size in sizes]
    for rows, kernel in every_row_count({str(s): k for s, k in zip(sizes, picked, strict=True)}).items():
        set_row_kernel(target, rows, kernel)
    sync_packs(target)
    return picked


class KernelChoice:
    """What a cost model's measurement times for `target` at each of `sizes` (ascending): `options` per size (opaque
    to the caller; (None,): the layers as they are) and `prefill_options` for the context's prefill of `prefix`
    tokens (empty unless a prefill kernel computes it). With `pick`, every row kernel this machine runs but those
    named in `without` is an option, the layers' plans are measured first (what "planned" names), and `choose` keeps
    the fastest."""

    def __init__(self, target: nn.Module, sizes, prefix: int, pick: bool = True, without: tuple[str, ...] = ()):
        self.target, self.sizes = target, list(sizes)
        picking = pick and has_row_plans(target) and max(self.sizes) <= KERNEL_ROWS
        if picking:
            measure_row_plans(target)
        self.options = tuple(k for k in usable_row_kernels(target) if k not in without) if picking else (None,)
        # a context over MAX_ROWS tokens runs the prefill kernel; a shorter one would time the row plans instead
        self.prefill_options = tuple(k for k in PREFILL_KERNELS if k in self.options) if prefix > MAX_ROWS else ()
        self.picked: dict | None = None

    def use(self, size: int, option) -> None:
        """Let the target compute `size` rows by `option` for the next forward."""
        if option is not None:
            set_row_kernel(self.target, size, option)

    def use_prefill(self, option) -> None:
        set_prefill_kernel(self.target, option)

    def choose(self, medians: dict, prefill_medians: dict) -> dict:
        """Per size, the option kept by the medians (`medians[(size, option)]`, `prefill_medians[option]` in ms), set
        on the target; returns {size: option}."""
        rows, prefill = None, None
        if self.prefill_options:
            prefill = fastest_kernel(prefill_medians, self.prefill_options)
            set_prefill_kernel(self.target, prefill)
        if self.options == (None,):
            picked = dict.fromkeys(self.sizes)
        else:
            picked = dict(
                zip(self.sizes, pick_row_kernels(self.target, self.sizes, medians, self.options), strict=True)
            )
            rows = {str(size): kernel for size, kernel in picked.items()}
        self.picked = {"rows": rows, "prefill": prefill}
        return picked

    def record(self) -> dict:
        """The record of the kernels the measured times hold for: the picks, else what the layers run now."""
        record = current_kernels(self.target, self.sizes)
        for field in ("rows", "prefill"):
            if self.picked and self.picked[field] is not None:
                record[field] = self.picked[field]
        return record
