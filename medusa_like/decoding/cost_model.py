"""What a decoding step costs on this machine: the target's verification forward against the number of tree nodes,
as plain data that is checked, saved in a machine profile (`forward/profile.py`) and read back.

    cost.verify(12)                                             # ms, interpolated between measured sizes
    cost = CostModel.from_json(data, source="file:profile.json")    # checked for form

A budgeted tree (`drafters/budget.py`) picks each step's node budget to maximise expected tokens per second from it:
where a forward over many nodes costs little more than one over a single token, deep trees pay; where it costs much
more, shallow ones.

Where a cost model comes from and whether it holds for a target is the business of `medusa_like.forward` (the room
for the forward's machine-specific parts): it measures one, caches it, refuses one measured for other weights, dtype,
device, machine or forward (`mismatches` compares the fields it is given), and sets the kernels it was measured with
(`kernels`, an opaque record only that room reads). The decoding core sees milliseconds against node counts.

`verify_ms` is a non-decreasing curve (`non_decreasing_fit`; `measured_ms` keeps the medians it was fitted to), so
that no leftover blip makes more nodes look cheaper.
"""

import math
from dataclasses import asdict, dataclass

REQUIRED = ("nodes", "verify_ms", "target_fingerprint", "dtype", "device", "machine", "step")
# what a cost model must share with the forward it sizes trees for (`medusa_like.forward` supplies the values)
IDENTITY = ("target_fingerprint", "dtype", "device", "machine", "step")


class CostModelError(ValueError):
    """A cost model that cannot be used: the message names the field and value, and what to do."""


class InvalidCostModelError(CostModelError):
    """A cost model that is not one: a missing, malformed or impossible field."""


class CostModelMismatchError(CostModelError):
    """A cost model measured for another target, dtype, device, machine or other layers."""


@dataclass
class CostModel:
    nodes: list[int]  # tree sizes measured, root included: unique, ascending, >= 1
    verify_ms: list[float]  # milliseconds of one target forward over that many nodes: the fitted, non-decreasing curve
    target_fingerprint: str  # the target's weights (`targets.weights_fingerprint`)
    dtype: str
    device: str  # the device type: "cpu", "cuda"
    machine: str  # where it was measured (`forward.cpu.machine.machine_identity()`)
    step: str  # what computed the forward ("eager", "compiled (...)": `TargetStep.describe`)
    kernels: dict | None = (
        None  # the kernels the layers ran (an opaque record of `medusa_like.forward`; None: as they were)
    )
    measured_ms: list[float] | None = None  # the per-size medians before the fit
    threads: int | None = None  # torch's intra-op threads during the measurement
    quick: bool = False  # a first estimate (few sizes and rounds), replaced by a full measurement when one is made
    note: str | None = None  # what the plausibility checks said, where a measurement was repeated or fell back
    measured_at: str | None = None  # when it was measured (UTC, ISO 8601)
    source: str = "measured"  # where this copy came from: "measured", "cache:<path>" or "file:<path>"

    def __post_init__(self):
        check_sizes("nodes", self.nodes)
        check_times("verify_ms", self.verify_ms, len(self.nodes))
        if self.measured_ms is not None:
            check_times("measured_ms", self.measured_ms, len(self.nodes))
        for name in (*IDENTITY, "source"):
            if not isinstance(getattr(self, name), str) or not getattr(self, name):
                raise InvalidCostModelError(
                    f"cost model: {name} must be a non-empty string, got {getattr(self, name)!r}"
                )
        for name in ("note", "measured_at"):
            if getattr(self, name) is not None and not isinstance(getattr(self, name), str):
                raise InvalidCostModelError(f"cost model: {name} must be a string or null, got {getattr(self, name)!r}")
        if self.threads is not None and (type(self.threads) is not int or self.threads < 1):
            raise InvalidCostModelError(f"cost model: threads must be an integer >= 1 or null, got {self.threads!r}")
        if not isinstance(self.quick, bool):
            raise InvalidCostModelError(f"cost model: quick must be true or false, got {self.quick!r}")
        if self.kernels is not None and not isinstance(self.kernels, dict):
            raise InvalidCostModelError(f"cost model: kernels must be a JSON object or null, got {self.kernels!r}")

    def verify(self, num_nodes: int) -> float:
        """Milliseconds to verify `num_nodes` nodes: linear between measured sizes, extrapolated beyond them."""
        nodes, ms = self.nodes, self.verify_ms
        if num_nodes <= nodes[0]:
            return ms[0]
        for i in range(1, len(nodes)):
            if num_nodes <= nodes[i]:
                share = (num_nodes - nodes[i - 1]) / (nodes[i] - nodes[i - 1])
                return ms[i - 1] + share * (ms[i] - ms[i - 1])
        slope = (ms[-1] - ms[-2]) / (nodes[-1] - nodes[-2]) if len(nodes) > 1 else 0.0
        return ms[-1] + slope * (num_nodes - nodes[-1])

    def describe(self) -> str:
        """One line for logs and reports: what it is and where it came from."""
        what = "quick first estimate" if self.quick else "full measurement"
        when = f", measured {self.measured_at}" if self.measured_at else ""
        return f"cost model ({what}, {len(self.nodes)} sizes) from {self.source}{when}"

    def to_json(self) -> dict:
        data = asdict(self)
        data["verify_ms"] = [round(x, 4) for x in self.verify_ms]
        if self.measured_ms is not None:
            data["measured_ms"] = [round(x, 4) for x in self.measured_ms]
        return data

    @classmethod
    def from_json(cls, data, source: str = "file") -> "CostModel":
        """The cost model `to_json` wrote, checked field by field (whether it holds for a target is for
        `medusa_like.forward` to say). `source` says where it was read from."""
        if not isinstance(data, dict):
            raise InvalidCostModelError(f"a cost model must be a JSON object, got {type(data).__name__}: {data!r}")
        missing = [name for name in REQUIRED if name not in data]
        if missing:
            raise InvalidCostModelError(
                f"cost model: missing fields {missing} (written by an earlier version? measure it again: "
                "model.forward.measure_cost_model(), or eval.tree_search)"
            )
        unknown = set(data) - set(cls.__dataclass_fields__)
        if unknown:
            raise InvalidCostModelError(f"cost model: unknown fields {sorted(unknown)}")
        cost = cls(**{**data, "source": source})
        cost.verify_ms = non_decreasing_fit(cost.verify_ms)  # a hand-edited or foreign curve must not dip either
        return cost

    def mismatches(self, expected: dict) -> list[str]:
        """How this cost model's setup differs from `expected` ({IDENTITY field: value here}); empty: it fits."""
        return [
            f"{name} {getattr(self, name)!r} (here {value!r})"
            for name, value in expected.items()
            if getattr(self, name) != value
        ]


@dataclass(frozen=True)
class BatchShare:
    """What the other rows of a batch put into the same verification forward, for a row that sizes its tree by a cost
    model (`drafters/budget.py`): `rows` other rows, the widest of their trees (`widest` nodes, root included), all
    their nodes (`nodes`), and the tokens they are expected to commit (`tokens`, the bonus included).

    A cost model measures a forward over n nodes of one row, and a batch's forward is priced as a one-row forward
    over the nodes it computes. A step that packs (`step.TargetStep.packs`: the eager one) computes the rows' real
    nodes alone, so a row's extra node costs one more node of the batch's forward. A step that pads every row to the
    widest (the compiled one) computes rows x widest nodes: a row's extra node costs nothing while it stays within the
    widest tree, and the batch's whole step when it widens it. The step's tokens are the whole batch's, so a row's tree
    is chosen for the batch's tokens per ms, not its own."""

    rows: int
    widest: int
    tokens: float
    nodes: int = 0  # the other rows' nodes, roots included (0: `rows` roots)
    packed: bool = False

    def verify(self, cost: CostModel, num_nodes: int) -> float:
        """Milliseconds of the batch's forward when this row verifies `num_nodes` nodes."""
        if self.packed:
            return cost.verify(max(self.nodes, self.rows) + num_nodes)
        return cost.verify((self.rows + 1) * max(self.widest, num_nodes))


def mismatch_error(cost: CostModel, found: list[str]) -> CostModelMismatchError:
    """The refusal of `cost` for the differences `found` (`CostModel.mismatches` and the forward's own checks)."""
    return CostModelMismatchError(
        f"{cost.describe()} was measured for another setup: {'; '.join(found)}. Measure it again on this machine for "
        "this target: model.forward.measure_cost_model(), or eval.tree_search"
    )


def check_sizes(name: str, sizes) -> None:
    if not isinstance(sizes, list) or not sizes:
        raise InvalidCostModelError(f"cost model: {name} must be a non-empty list of tree sizes, got {sizes!r}")
    for i, size in enumerate(sizes):
        if type(size) is not int or size < 1:
            raise InvalidCostModelError(f"cost model: {name}[{i}] must be an integer >= 1, got {size!r}")
        if i and size <= sizes[i - 1]:
            raise InvalidCostModelError(
                f"cost model: {name} must be unique and ascending, got {sizes[i - 1]!r} then {size!r}"
            )


def check_times(name: str, times, count: int) -> None:
    if not isinstance(times, list) or len(times) != count:
        raise InvalidCostModelError(f"cost model: {name} must be a list of {count} times (one per size), got {times!r}")
    for i, ms in enumerate(times):
        if type(ms) not in (int, float) or not math.isfinite(ms) or ms <= 0:
            raise InvalidCostModelError(f"cost model: {name}[{i}] must be a finite positive number of ms, got {ms!r}")


def non_decreasing_fit(values: list[float]) -> list[float]:
    """The least-squares non-decreasing fit of `values` (pool adjacent violators): each run that dips is replaced by
    its mean."""
    blocks: list[list[float]] = []  # [mean, count]
    for value in values:
        blocks.append([value, 1.0])
        while len(blocks) > 1 and blocks[-2][0] > blocks[-1][0]:
            (mean_a, n_a), (mean_b, n_b) = blocks.pop(-2), blocks.pop()
            blocks.append([(mean_a * n_a + mean_b * n_b) / (n_a + n_b), n_a + n_b])
    return [mean for mean, count in blocks for _ in range(int(count))]
