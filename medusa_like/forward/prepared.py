"""A target prepared for this machine: the step the loop runs, this machine's cost model of it, and the layers a
drafter computes with beside it.

    prepared = prepare_target(target, compile=False)   # one per target object: asked again, the same one
    prepared.step                    # the `TargetStep` the decoding loop runs (eager, or compiled)
    prepared.use_profile(profile)    # a machine profile (`profile.py`): refused for another setup
    prepared.settle(drafter)         # before a generation: this machine's cost model, for a drafter sized by one
    prepared.measure_cost_model()    # a full measurement, cached and made active
    prepared.adopt(drafter, "auto")  # a drafter cast to its drafting dtype, its layers this machine's (or compiled)
    prepared.stock()                 # the target as transformers ships it, sharing every weight (a baseline)

Eager, on CPUs (fp32 where the fp32 kernel runs, bf16 where the CPU computes bf16), the target's and the drafter's
`nn.Linear` layers are replaced in place by few-row layers sharing their parameters (`cpu/few_row_linear.py`: this
project's kernels, the same bits for a row at any row count), and the target attends by the row-invariant kernel
(`eager_backend`), so that its tree rows round as its one-node steps do. Compiled
(`compiled.py`), the target keeps its own layers and Inductor computes them (bf16 ones on the dot-product kernel, where
the CPU has one); where the compiled step cannot run, the eager one does, and the log says why. Either rounds
differently from transformers as it ships: the reference of every comparison is greedy decoding on the same step.
"""

import functools
import logging
import weakref
from typing import Protocol, runtime_checkable

import torch

from medusa_like.decoding.attention import pick_backend
from medusa_like.decoding.cost_model import CostModel, CostModelError, CostModelMismatchError, mismatch_error
from medusa_like.decoding.step import EagerStep, TargetStep
from medusa_like.drafters.protocol import sized_by_cost_model
from medusa_like.targets import floating_dtype, weights_fingerprint

from . import cost_cache
from .compiled import CompiledStep
from .compiled_draft import DraftCompiler
from .cpu import tree_attention
from .cpu.few_row_linear import (
    KernelMismatchError,
    KernelRecordError,
    check_kernels,
    use_few_row_linears,
    with_stock_linears,
    worth_swapping,
)
from .cpu.machine import machine_identity
from .cpu.read_kernel import use_read_kernel
from .platform import CompileUnsupported, compile_settings, native_bf16, traced_layers
from .profile import COMPILE_CHOICES, MachineProfile, ProfileMismatchError, parse_cost_model

log = logging.getLogger(__name__)

_PREPARED: "weakref.WeakKeyDictionary[torch.nn.Module, PreparedTarget]" = weakref.WeakKeyDictionary()
_announced = []  # a layer swap was announced in this process: the first is a warning, later ones info


@runtime_checkable
class TunedDrafter(Protocol):
    """What this room asks of a drafter that computes with weights beside the target (every learned drafter: Medusa
    heads, EAGLE-3); a drafter without these (lookup) computes nothing here."""

    # casts the target's states it reads to its own dtype, so it may compute in another dtype than the target
    # (`PreparedTarget.drafting_dtype`)
    computes_in_own_dtype: bool

    def compile_drafting(self, compiler) -> None:
        """Draft through what `compiler` (`compiled_draft.DraftCompiler`) compiles from now on: it asks for what its
        kind drafts with (`compiler.level(module)` for an EAGLE-3-style level, `compiler.heads(module, rows)` for
        Medusa-style heads)."""
        ...


class PreparedTarget:
    """One target on this machine (see the module docstring); made by `prepare_target`."""

    def __init__(self, target, backend: str, tuned_layers: bool | None, fp32_kernel: bool = True):
        self.target = target
        swap = worth_swapping(target) if tuned_layers is None else tuned_layers
        self.tuned = bool(swap) and target.device.type == "cpu"
        if self.tuned:  # `fp32_kernel`: fp32 layers on the fp32 kernel, where the eager step decodes
            _announce(use_few_row_linears(target, fp32_kernel=fp32_kernel), "target")
        self.backend = eager_backend(backend, target)
        self.eager = EagerStep(target, self.backend)
        self.compiled: CompiledStep | None = None
        self.active: CostModel | None = None  # the cost model the drafters size their trees by
        self.profile: MachineProfile | None = None  # the machine profile it runs as (`use_profile`), if any

    # ---- the step ----

    @property
    def step(self) -> TargetStep:
        """The compiled step where one was asked for and runs here (until it fails: then the eager one)."""
        return self.compiled if self.compiled is not None and not self.compiled.failed else self.eager

    def use_compiled(self, compile: bool | str) -> None:
        """Run the compiled step from now on (`compile` True or "auto") where this platform runs it; where it does
        not, the eager step runs on, and the log says why (a warning when compile=True asked for it)."""
        if compile not in COMPILE_CHOICES:
            raise ValueError(f"compile must be one of {COMPILE_CHOICES}, got {compile!r}")
        if not compile or self.compiled is not None:
            return
        try:
            options, label = compile_settings(self.target)
        except CompileUnsupported as why:
            log.log(logging.WARNING if compile is True else logging.INFO, "compile: %s; the eager step runs", why)
            return
        # the compiled graph traces a copy of the target sharing every weight (`traced_layers`: transformers' own
        # layers, bf16 ones on this project's kernel where it runs); prompts are read eagerly on the few-row layers,
        # on oneDNN's pack from two rows where it runs and fits
        model = traced_layers(self.target, self.tuned)
        if self.tuned:
            use_read_kernel(self.target, "auto", from_rows=2)
        self.compiled = CompiledStep(
            model, options, label, eager_target=self.target if model is not self.target else None
        )
        self.active = None  # a cost model of the eager step does not hold for the compiled one

    def describe(self) -> str:
        layers = "few-row CPU layers" if self.tuned and self.step is self.eager else "its own layers"
        return f"{self.step.describe()} step, {layers}"

    @property
    def differs_from_stock(self) -> bool:
        """Whether the step computes otherwise than transformers as it ships (other kernels round differently)."""
        return self.tuned or self.step is not self.eager

    def stock(self):
        """The target as transformers ships it (`nn.Linear` layers), sharing every parameter and buffer: a baseline."""
        return with_stock_linears(self.target) if self.tuned else self.target

    # ---- drafters ----

    def drafting_dtype(self, drafter, requested: torch.dtype | str | None = "auto") -> torch.dtype:
        """The dtype a learned drafter computes in beside this target: `requested` (a torch dtype or its name; None:
        the target's), or for "auto" bfloat16 where a drafting level then reads half the bytes at no cost: a drafter
        that casts what it reads (`computes_in_own_dtype`: EAGLE-3) beside an fp32 target whose layers run bf16
        natively here; the target's dtype elsewhere. Only the drafts change: the target verifies in its own dtype."""
        target, own = self.target, isinstance(drafter, TunedDrafter) and drafter.computes_in_own_dtype
        if requested == "auto":
            native = native_bf16(target.device) and (self.tuned or target.device.type != "cpu")
            return torch.bfloat16 if own and native and target.dtype == torch.float32 else target.dtype
        if requested is None:
            return target.dtype
        dtype = floating_dtype(requested)
        if dtype is None:
            raise ValueError(
                f"drafter dtype {requested!r}: expected auto, null or a floating torch dtype (e.g. bfloat16)"
            )
        if dtype != target.dtype and not own:
            raise ValueError(
                f"a {drafter.kind} drafter computes with the target's own states and layers: it runs in the target's "
                f"dtype ({target.dtype}), not {dtype} (drafter dtype auto or null)"
            )
        return dtype

    def adopt(self, drafter, dtype: torch.dtype | str | None = "auto"):
        """`drafter` on this target's device in its drafting dtype (`drafting_dtype`), in eval mode, its layers this
        machine's where the target's are (changed in place, as the target's); where the target's step is compiled,
        what it drafts with is compiled too (`compiled_draft.py`: an EAGLE-3 level, Medusa heads; compiled on its
        first draft, or loaded)."""
        drafter = drafter.to(device=self.target.device, dtype=self.drafting_dtype(drafter, dtype))
        for module in drafter.modules():
            module.train(False)
        if self.tuned and worth_swapping_drafter(drafter):
            _announce(use_few_row_linears(drafter, fp32_kernel=False), "drafter")  # drafts need no row-invariance
        self.compile_drafting(drafter)
        return drafter

    def compile_drafting(self, drafter) -> None:
        """Where the target's step is compiled, `drafter` drafts compiled too (its kind decides what it asks the
        `DraftCompiler` for, if anything: `Drafter.compile_drafting`)."""
        if self.compiled is not None and isinstance(drafter, TunedDrafter):
            traced = functools.partial(traced_layers, tuned=self.tuned)
            drafter.compile_drafting(DraftCompiler(self.target, self.compiled.options, self.compiled.label, traced))

    # ---- cost models ----

    def identity(self) -> dict:
        """What a cost model of this step must have been measured under (`CostModel.IDENTITY`'s fields)."""
        return {
            "target_fingerprint": weights_fingerprint(self.target),
            "dtype": str(self.target.dtype),
            "device": self.target.device.type,
            "machine": machine_identity(),
            "step": self.step.describe(),
        }

    def mismatches(self, cost: CostModel) -> list[str]:
        return cost.mismatches(self.identity()) + self._kernel_mismatches(cost.kernels)

    def _kernel_mismatches(self, record) -> list[str]:
        try:
            check_kernels(record, self.target)
        except (KernelMismatchError, KernelRecordError) as err:
            return [str(err)]
        return []

    def fits(self, cost: CostModel) -> bool:
        return not self.mismatches(cost)

    def activate(self, cost: CostModel) -> CostModel:
        """Make `cost` (checked to fit) the active cost model."""
        self.active = cost
        return cost

    def load_cost_model(self, data, source: str) -> CostModel:
        """A stored cost model (JSON, `source` naming it): checked for form, refused for another setup (another step
        included: nothing compiles here) with every difference named; made active."""
        try:
            cost = parse_cost_model(data, source)
        except CostModelError as err:
            raise type(err)(f"{source}: {err}") from err
        found = self.mismatches(cost)
        if found:
            raise CostModelMismatchError(f"{source}: {mismatch_error(cost, found)}")
        return self.activate(cost)

    def use_profile(self, profile: MachineProfile, compile: bool | str | None = None) -> None:
        """Run as the machine profile `profile` says: its compile choice (unless `compile` names one), refused when it
        was measured for another setup (weights, dtype, device, machine, step, kernels), every difference named
        (`ProfileMismatchError`; this target then runs on as it did), else its cost model made active. Where it holds
        none, this target's cost model is left as it is."""
        before = self.compiled, self.active
        self.use_compiled(profile.compile if compile is None else compile)
        cost = profile.cost_model
        found = profile.mismatches(self.identity()) + (self._kernel_mismatches(cost.kernels) if cost else [])
        if found:
            self.compiled, self.active = before
            raise ProfileMismatchError(
                f"{profile.source} was measured for another setup: {'; '.join(found)}. Search again on this machine "
                "for this target (python -m eval.tree_search writes a profile), or pass none (a step that differs: "
                "compile= as the profile says, or left to it)"
            )
        if cost is not None:
            self.activate(cost)
        self.profile = profile

    def cost_model(self, own: CostModel | None = None) -> CostModel:
        """This step's cost model here: the active one (a profile's, a measurement's), else `own` (a drafter's) where
        it fits (made active), else the one cached on disk, else a quick first estimate measured now
        (logged, with a progress bar) and cached."""
        if self.active is not None and self.fits(self.active):
            return self.active
        if own is not None and self.fits(own):
            return self.activate(own)
        cached = cost_cache.cached(self)
        if cached is not None:
            return self.activate(cached)
        self.active = cost_cache.quick(self)
        return self.active

    def measure_cost_model(self, **options) -> CostModel:
        """A full measurement (every tree size, several rounds), cached in place of any earlier one and made active: a
        drafter sized by a cost model gets it before its next generation (`settle`). `options`:
        `cost_measure.measure_cost_model`'s."""
        self.active = cost_cache.full(self, **options)
        return self.active

    def settle(self, drafter) -> None:
        """Before a generation of `drafter`: a drafter that sizes its trees by a cost model gets this machine's
        (`cost_model`, the one it holds where none is active)."""
        if sized_by_cost_model(drafter):
            cost = self.cost_model(drafter.cost_model)
            if drafter.cost_model is not cost:
                drafter.use_cost_model(cost)


def worth_swapping_drafter(drafter) -> bool:
    module = next(iter(drafter.modules()), None)
    return module is not None and worth_swapping(module)


def _announce(count: int, what: str) -> None:
    if count:
        log.log(
            logging.INFO if _announced else logging.WARNING,
            "replaced %d nn.Linear layers of the %s, in place, by few-row layers sharing their parameters (this CPU's "
            "kernels, a row's bits at any row count; results may differ from nn.Linear's in rounding); "
            "tuned_layers=False keeps them",
            count,
            what,
        )
        _announced.append(True)


def eager_backend(backend: str, target) -> str:
    """The eager step's attention backend for `backend` ("auto" or a name, `decoding/attention.py`): "auto" on a
    bf16 CPU target, or an fp32 one whose few-row layers run the fp32 kernel, is the row-invariant kernel's
    (`cpu/tree_attention.py`), where it builds: SDPA's rounding moves with a step's row count, which can flip a near-tie
    between a tree row and greedy decoding's one-node step (in bf16 it did)."""
    row_invariant = target.dtype == torch.bfloat16 or any(getattr(m, "fp32_kernel", False) for m in target.modules())
    if backend == "auto" and target.device.type == "cpu" and row_invariant:
        if tree_attention.unavailable() is None:  # else it logged why, and SDPA attends
            return tree_attention.BACKEND
    return pick_backend(backend, target.device)


def prepare_target(
    target, backend: str = "auto", tuned_layers: bool | None = None, compile: bool | str = False
) -> PreparedTarget:
    """`target` prepared for this machine (see the module docstring): the same object for the same target, whose
    compiled step, once made, is kept; `tuned_layers` (None: where this CPU has a kernel for its dtype) applies when it is first
    prepared. A model you pass is changed in place where its layers are swapped: the log says so."""
    prepared = _PREPARED.get(target)
    if prepared is None:
        # a compiled step decodes on its own kernels: its eager layers read prompts, and need no fp32 kernel
        prepared = _PREPARED[target] = PreparedTarget(target, backend, tuned_layers, fp32_kernel=compile is False)
    elif (chosen := eager_backend(backend, target)) != prepared.backend:  # another attention backend; layers stay
        prepared.backend, prepared.eager = chosen, EagerStep(target, chosen)
    prepared.use_compiled(compile)
    return prepared
