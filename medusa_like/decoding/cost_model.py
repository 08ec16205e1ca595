"""What a decoding step costs on this machine: the target's verification forward against the number of tree nodes.

    cost = measure_cost_model(target)               # ~40 s: forwards of 1..32 nodes after a 128-token prefix
    cost.verify(12)                                 # ms, fitted (interpolated past 16)
    save_tree(spec, "tree.json", cost_model=cost.to_json())
    cost = CostModel.from_json(data, target)        # refused for another target or dtype

A budgeted tree (`drafters/merge.py`) picks each step's node budget to maximise expected tokens per second from
it: on a 2-core CPU in fp32 a forward over 16 nodes costs ~1.6x one over a single token with `nn.Linear`, less with
`few_row_linear.py`'s layers; ~1x in bf16 where the CPU computes in it; on a GPU ~1x up to 64.

A shared CPU's speed drifts by 20-40% over seconds, longer than one size takes to time, so the sizes are timed in
interleaved rounds (a slow spell lands on every size alike) and the per-size medians are fitted by a non-decreasing
curve, so that no leftover blip makes more nodes look cheaper. Timed one size after another, one slow spell made 5
nodes cost 1.4x 4 nodes here, and the budget then stopped every step at 3 drafted tokens. The fit also smooths the
few real dips (4 nodes measured ~10% cheaper than 3 in every run here; `measured_ms` keeps the medians).

With row-planned few-row layers, every size is timed with each row kernel of `few_row_linear.ROW_KERNELS` this machine
can run (`F.linear` as transformers runs it, the layers' own plans, weight-first, padded to a power of two, MKL's
packed sgemm, oneDNN's pack) and keeps the fastest, `F.linear` unless another is over 3% faster: a plan is timed one
layer at a time, and in a whole forward another kernel was up to ~15% faster at some sizes on a Xeon (packed sgemm up
to ~20% from 4 nodes on), and oneDNN's pack up to 2x on an AMD EPYC. The context's prefill is timed the same way with
each of `PREFILL_KERNELS` (a prompt's forward: F.linear or oneDNN), which every method, greedy included, then runs.
The cost model saves the kernels and sets them on the target it is loaded for, so that the times it holds are the
times of the kernels that run; one that names a kernel this machine cannot run is refused.
"""

import platform
import time
from dataclasses import dataclass

import torch

from medusa_like.targets import target_fingerprint

from .attention import pick_backend, tree_attention
from medusa_like.cpu.few_row_linear import (
    KERNEL_ROWS,
    MAX_ROWS,
    PREFILL_KERNELS,
    ROW_KERNELS,
    has_row_plans,
    linear_kernel,
    set_prefill_kernel,
    set_row_kernel,
    sync_packs,
    usable_row_kernels,
)
from .generate import target_forward
from .kv_cache import TreeKVCache
from .projection import VocabProjection

# every size a step picks from: the cost of a forward is not monotonic in the nodes (few_row_linear.py)
SIZES = (*range(1, 17), 20, 24, 32)
KERNEL_MARGIN = 1.03  # another row kernel replaces F.linear for a size only if over 3% faster


class CostModelMismatchError(ValueError):
    """A cost model measured for another target, dtype or device."""


@dataclass
class CostModel:
    nodes: list[int]  # tree sizes measured, root included, ascending
    verify_ms: list[float]  # milliseconds of one target forward over that many nodes: the fitted, non-decreasing curve
    target_fingerprint: str
    dtype: str
    device: str
    linears: str = "nn.Linear"  # what computed the linear layers (`few_row_linear.linear_kernel`)
    machine: str = platform.machine()
    measured_ms: list[float] | None = None  # the per-size medians before the fit
    row_kernels: list[str] | None = None  # per size, the few-row kernel it was timed with (`few_row_linear.py`)
    prefill_kernel: str | None = None  # what computed prefills, `few_row_linear.PREFILL_KERNELS` (None: F.linear)

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

    def to_json(self) -> dict:
        return {
            "nodes": list(self.nodes),
            "verify_ms": [round(x, 4) for x in self.verify_ms],
            "target_fingerprint": self.target_fingerprint,
            "dtype": self.dtype,
            "device": self.device,
            "linears": self.linears,
            "machine": self.machine,
            "measured_ms": None if self.measured_ms is None else [round(x, 4) for x in self.measured_ms],
            "row_kernels": self.row_kernels,
            "prefill_kernel": self.prefill_kernel,
        }

    @classmethod
    def from_json(cls, data: dict, target) -> "CostModel":
        """The cost model `to_json` wrote, refused unless it was measured for this target, dtype and device type; the
        target's few-row layers are set to the row kernels it was timed with, so that its times hold."""
        try:
            model = cls(**data)
        except TypeError as err:
            raise CostModelMismatchError(f"not a cost model: {err}") from err
        if len(model.nodes) != len(model.verify_ms) or not model.nodes:
            raise CostModelMismatchError("a cost model needs one time per measured tree size")
        kernels = model.row_kernels
        if kernels is not None and (
            len(kernels) != len(model.nodes)
            or not set(kernels) <= set(ROW_KERNELS)
            or max(model.nodes) > KERNEL_ROWS
            or min(model.nodes) < 1
        ):
            raise CostModelMismatchError(f"a cost model's row kernels must be one of {ROW_KERNELS} per tree size")
        if model.prefill_kernel is not None and model.prefill_kernel not in PREFILL_KERNELS:
            raise CostModelMismatchError(f"a cost model's prefill kernel must be one of {PREFILL_KERNELS}")
        model.check_fits(target)
        model.verify_ms = non_decreasing_fit(model.verify_ms)  # files written before the fit hold raw medians
        if kernels is not None and has_row_plans(target):
            unusable = {*kernels, model.prefill_kernel or "linear"} - set(usable_row_kernels(target))
            if unusable:
                raise CostModelMismatchError(
                    f"the cost model's row kernels {sorted(unusable)} cannot run here (no MKL or oneDNN, or too little "
                    "memory for its packs): measure it again (eval.tree_search) on this machine"
                )
            for size, kernel in zip(model.nodes, kernels, strict=True):
                set_row_kernel(target, size, kernel)
            set_prefill_kernel(target, model.prefill_kernel or "linear")
            sync_packs(target)
        return model

    def check_fits(self, target) -> None:
        wanted = (target_fingerprint(target.config), str(target.dtype), target.device.type, linear_kernel(target))
        have = (self.target_fingerprint, self.dtype, self.device, self.linears)
        if wanted != have:
            raise CostModelMismatchError(
                f"cost model measured for (fingerprint, dtype, device, linears) {have}, but this target is {wanted}: "
                "measure it again (eval.tree_search) for this target"
            )


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


def fastest_kernel(medians: dict, kernels) -> str:
    """The kernel of `kernels` with the least median ms (`medians[kernel]`), `F.linear` (transformers' own product)
    unless another is more than KERNEL_MARGIN faster."""
    kernel = min(kernels, key=lambda k: medians[k])
    return kernel if medians[kernel] * KERNEL_MARGIN <= medians["linear"] else "linear"


def pick_row_kernels(target, sizes, medians: dict, kernels: tuple[str, ...]) -> list[str]:
    """Per size, the fastest row kernel of `kernels` by `fastest_kernel` (`medians[(size, kernel)]`); sets the target's
    layers to them and drops unused packs."""
    picked = []
    for size in sizes:
        kernel = fastest_kernel({k: medians[(size, k)] for k in kernels}, kernels)
        set_row_kernel(target, size, kernel)
        picked.append(kernel)
    sync_packs(target)
    return picked


@torch.inference_mode()
def measure_cost_model(
    target, sizes=SIZES, prefix: int = 128, repeats: int = 5, pick_kernels: bool = True, without: tuple[str, ...] = ()
) -> CostModel:
    """What verifying a tree of each of `sizes` nodes costs: the target's forward and vocabulary projection over a
    chain-shaped tree after a `prefix`-token context, timed in `repeats` interleaved rounds over all sizes (after a
    warm-up round); the per-size medians, fitted non-decreasing. With `pick_kernels` and row-planned layers, every
    size is timed with each of `few_row_linear.ROW_KERNELS` this machine runs but those named in `without`, and the
    fastest is kept (set on the target, and saved); so is the fastest of `PREFILL_KERNELS` for the context's
    prefill, timed in the same rounds (a context over MAX_ROWS tokens; else None: F.linear)."""
    sizes = sorted(sizes)
    device = target.device
    vocab = target.config.get_text_config().vocab_size
    picking = pick_kernels and has_row_plans(target) and max(sizes) <= KERNEL_ROWS
    # None: the layers as they are
    kernels = tuple(k for k in usable_row_kernels(target) if k not in without) if picking else (None,)
    # a context over MAX_ROWS tokens runs the prefill kernel; a shorter one would time the row plans instead
    prefill_kernels = tuple(k for k in PREFILL_KERNELS if k in kernels) if picking and prefix > MAX_ROWS else ()
    generator = torch.Generator().manual_seed(0)
    context = torch.randint(0, vocab, (1, prefix), generator=generator).to(device)
    cache = TreeKVCache.for_model(target, prefix + max(sizes))
    lm_head = VocabProjection(target)
    samples: dict[tuple, list[float]] = {(size, kernel): [] for size in sizes for kernel in kernels}
    prefill_samples: dict[str, list[float]] = {kernel: [] for kernel in prefill_kernels}

    def prefill() -> float:
        """ms of the context's forward, from an empty cache."""
        cache.rewind(0)
        start = time.perf_counter()
        target_forward(target, context, torch.arange(prefix, device=device)[None], cache, None)
        cache.commit_all(prefix)
        return 1000 * (time.perf_counter() - start)

    with tree_attention(target, pick_backend("auto", device)):
        if not prefill_kernels:
            prefill()
        for _ in range(repeats + 1):  # the first round is a warm-up
            for kernel in prefill_kernels:
                set_prefill_kernel(target, kernel)
                prefill_samples[kernel].append(prefill())
            for size, kernel in samples:
                if kernel is not None:
                    set_row_kernel(target, size, kernel)
                tokens = torch.randint(0, vocab, (1, size), generator=generator).to(device)
                positions = torch.arange(prefix, prefix + size, device=device)[None]
                mask = torch.ones(size, size, dtype=torch.bool, device=device).tril()[None, None]
                start = time.perf_counter()
                hidden, _ = target_forward(target, tokens, positions, cache, mask)
                lm_head(hidden).argmax(-1)
                if device.type == "cuda":
                    torch.cuda.synchronize()
                samples[(size, kernel)].append(1000 * (time.perf_counter() - start))
                cache.rewind(prefix)
    medians = {key: sorted(times[1:])[repeats // 2] for key, times in samples.items()}
    prefill_kernel = None
    if prefill_kernels:
        prefill_kernel = fastest_kernel(
            {k: sorted(t[1:])[repeats // 2] for k, t in prefill_samples.items()}, prefill_kernels
        )
        set_prefill_kernel(target, prefill_kernel)
    row_kernels = pick_row_kernels(target, sizes, medians, kernels) if picking else None
    chosen = [medians[(size, row_kernels[i] if picking else None)] for i, size in enumerate(sizes)]
    return CostModel(
        sizes,
        non_decreasing_fit(chosen),
        target_fingerprint(target.config),
        str(target.dtype),
        device.type,
        linear_kernel(target),
        measured_ms=chosen,
        row_kernels=row_kernels,
        prefill_kernel=prefill_kernel,
    )
