"""A drafter's drafting step compiled for this machine, on the same footing as the target's compiled step: an EAGLE-3
level (its layer and draft-vocabulary projection over one static KV buffer), or Medusa heads over the target's own
vocabulary projection.

An eager level over a few rows costs two to three times the bytes of its weights at the memory's speed: the products
at one to eight rows and the Python between a dozen small operators. Compiled like the target's step (`compiled.py`:
frozen weights, Inductor's C++ GEMM template on CPUs, one graph whose row count and live cache length are dynamic),
a level streams the weights near the memory's speed. The package is cached on disk by `compile_cache`, keyed by the
drafter's weights, dtype, code and the machine, so a later process loads it in about a second.

    compiler = DraftCompiler(target, options, label, traced)  # what `Drafter.compile_drafting` is handed
    level = compiler.level(drafter)                   # compiles on first use (logged), or loads an earlier package
    cache = level.new_cache(capacity)                 # [1, 2, 1, heads_kv, capacity, head_dim]
    state, logits = level(feature, embeds, positions, visible, cache)   # the drafter's `level` interface

The drafter's `level` interface (`drafters/eagle3.py`, `EagerLevel`): feature, embeds [T, h], positions [T],
visible [T, S] (which of the cache's S - T entries and the T new ones each row sees) -> the rows' output states
[T, h] and draft-vocabulary logits [T, N] ([1, N] of the last row with `last`); the T new entries are written after
the cache's committed ones, which the caller commits. A single row runs as two (a dimension of 1 would be
specialised), the dummy row seeing only itself. Where the compiled level cannot run, the same graph runs eagerly over
the same buffer, with a log line: only a slower draft, and drafts never change what the target outputs.

    heads = compiler.heads(medusa_heads, rows)        # rows: a draft vocabulary's token ids, or None
    logits = heads(hidden)                            # the target's last hidden state [H] -> every head's [K, N]

    step = compiler.graph(graph, drafter, example_inputs, dynamic, what)   # any drafter's own graph (the block's)
    outputs = step(*inputs)

Medusa heads read one row, the target's last hidden state, so their graph has no dynamic dimension; it holds the
target's projection (or its draft vocabulary's rows) as a constant of its own, and is keyed by the target's weights
too. Every head is computed: a step that drafts fewer levels keeps the first ones (the projection's weights are read
once whatever the row count).
"""

import hashlib
import inspect
import json
import logging
from contextlib import nullcontext

import torch
import torch.nn.functional as F

from medusa_like.targets import logit_softcap, softcap, weights_fingerprint

from . import compile_cache
from .compiled import MAX_CONTEXT, MAX_ROWS, attention_traced
from .cpu import bf16_linear
from .static_cache import MIN_ROWS, LiveCache, StaticTreeCache

log = logging.getLogger(__name__)


class DraftCompiler:
    """What the forward room compiles for a drafter, with the target's compiled step's settings: handed to
    `Drafter.compile_drafting`, which asks for what its kind drafts with. `traced` gives the module the compiler traces
    for a drafter (`platform.traced_layers`: a copy sharing every weight, its layers transformers' own or the bf16
    kernel's)."""

    def __init__(self, target, options: dict, label: str, traced):
        self.target, self.options, self.label, self.traced = target, dict(options), label, traced

    def level(self, drafter) -> "CompiledLevel":
        """An EAGLE-3-style drafter's level (`CompiledLevel`)."""
        traced = self.traced(drafter)
        return CompiledLevel(traced, self.options, products_label(traced, self.label))

    def heads(self, heads, rows: torch.Tensor | None) -> "CompiledHeads":
        """Medusa-style heads over the target's projection, restricted to `rows` (token ids) or not."""
        traced = self.traced(heads)
        return CompiledHeads(traced, self.target, rows, self.options, products_label(traced, self.label))

    def graph(
        self, graph: torch.nn.Module, drafter, example_inputs: tuple, dynamic: dict, what: str
    ) -> "CompiledGraph":
        """Any drafter's own graph (`graph`, an `nn.Module` of tensors in, tensors out, holding `drafter`), compiled
        with the target's step's settings: `example_inputs` to trace it with, `dynamic` its dynamic dimensions by
        input name ({input: {dim: (size name, min, max)}}: the same name, the same size), `what` what the log calls
        it."""
        traced = self.traced(graph)
        return CompiledGraph(
            traced, drafter, example_inputs, dynamic, what, self.options, products_label(traced, self.label)
        )


def products_label(module, label: str) -> str:
    """The compiled step's `label`, naming the bf16 kernel where `module`'s traced layers run it (a bf16 drafter
    beside an fp32 target)."""
    if bf16_linear.LABEL in label or not any(isinstance(m, bf16_linear.PackedLinear) for m in module.modules()):
        return label
    return f"{label}; bf16 layers on the {bf16_linear.LABEL}"


class CompiledLevel:
    """One drafting level of `drafter` (whose `forward(feature, embeds, position_ids, mask, cache)` and `logits(state)`
    are the EAGLE-3 drafter's) compiled with Inductor `options` (`platform.compile_settings`)."""

    what = "the drafter's level"  # what the log calls it

    def __init__(self, drafter, options: dict, label: str):
        self.drafter, self.options, self.label = drafter, dict(options), label
        config = drafter.self_attn.config
        self.attention_config = config
        self.heads = config.num_key_value_heads
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        self.min_rows, self.max_rows = MIN_ROWS, MAX_ROWS
        self.compiled = None
        self.compile_seconds = 0.0
        self.failed: str | None = None  # why the compiled level stopped being used, if it did

    def graph_key(self) -> dict:
        """What the compiled graph computes, for its cache's key (`compile_cache.cache_key`)."""
        text = json.dumps(self.drafter.config.to_dict(), sort_keys=True, default=str)
        return compile_cache.model_key(self.drafter, "drafter", text, code_of=type(self.drafter))

    def new_cache(self, capacity: int) -> StaticTreeCache:
        dtype, device = self.drafter.fc.weight.dtype, self.drafter.fc.weight.device
        return StaticTreeCache(1, self.heads, self.head_dim, capacity, dtype, device)

    def __call__(self, feature, embeds, positions, visible, cache: StaticTreeCache, last: bool = False):
        """feature, embeds [T, h], positions [T], visible [T, S] -> (states [T, h], logits [T, N] or [1, N])."""
        real = feature.shape[0]
        cache.check_room(real)
        eager = real > self.max_rows or self.failed is not None
        rows = real if eager else max(real, MIN_ROWS)
        inputs = self._inputs(feature, embeds, positions, visible, cache, rows)
        if not eager:
            try:
                with self.traced_attention():
                    state, logits, new = self._compiled()(*inputs)
            except Exception as err:  # the compiler's errors have many types; the eager run is always correct
                self.failed = compile_cache.failure(err)
                log.warning("the drafter's compiled level failed (%s): its eager level runs from now on", self.failed)
                return self(feature, embeds, positions, visible, cache, last)
        else:
            with torch.inference_mode(), self.traced_attention():
                state, logits, new = _LevelGraph(self.drafter)(*inputs)
        cache.write(new)
        return state[:real], logits[real - 1 : real] if last else logits[:real]

    def _inputs(self, feature, embeds, positions, visible, cache: StaticTreeCache, rows: int) -> tuple:
        """The graph's inputs for `rows` rows (the first T real, the others dummies seeing only themselves)."""
        real, length, device = feature.shape[0], cache.length, feature.device
        pad = rows - real
        feature = torch.cat([feature, feature.new_zeros(pad, feature.shape[1])])[None]  # [1, rows, h]
        embeds = torch.cat([embeds.to(feature.dtype), feature.new_zeros(pad, embeds.shape[1])])[None]
        positions = torch.cat([positions, positions[-1:].expand(pad)])  # [rows]
        seen = torch.zeros(rows, length + rows, dtype=torch.bool, device=device)  # [rows, S]
        seen[:real, : length + real] = visible
        seen[real:, length + real :] = torch.eye(pad, dtype=torch.bool, device=device)
        slots = torch.arange(length, length + rows, device=device)  # [rows]
        mask = torch.stack([seen, seen])[None]  # [1, 2, rows, S]: the drafter's layer attends in full, no window
        return feature, embeds, positions[None], slots, mask, cache.buffer

    def traced_attention(self):
        """The drafter's attention through the compiled step's attention function for the block."""
        return attention_traced(self.attention_config)

    def _compiled(self):
        if self.compiled is None:
            graph = _LevelGraph(self.drafter)
            on_cpu = self.drafter.fc.weight.device.type == "cpu"
            self.compiled = (compile_cache.Package if on_cpu else compile_cache.InProcess)(graph, self)
        return self.compiled

    def dynamic_sizes(self) -> dict:
        """The graph's dynamic dimensions, by input: the row count, the live cache length, the buffer's capacity."""
        Dim = torch.export.Dim
        rows = Dim("rows", min=MIN_ROWS, max=self.max_rows)
        live, capacity = Dim("live", min=MIN_ROWS, max=MAX_CONTEXT), Dim("capacity", min=MIN_ROWS, max=MAX_CONTEXT)
        return {"feature": {1: rows}, "embeds": {1: rows}, "position_ids": {1: rows}, "slots": {0: rows},
                "mask": {2: rows, 3: live}, "buffer": {4: capacity}}  # fmt: skip

    def example_inputs(self) -> tuple:
        """Inputs of the graph's shapes for tracing it: 3 rows after 5 committed entries in a buffer of 11 slots."""
        length, rows, capacity = 5, 3, 11
        cache = self.new_cache(capacity - MIN_ROWS + 1)
        cache.length = length
        hidden, device = self.drafter.config.hidden_size, self.drafter.fc.weight.device
        feature = torch.zeros(rows, hidden, dtype=self.drafter.fc.weight.dtype, device=device)
        positions = torch.arange(length, length + rows, device=device)
        visible = torch.ones(rows, length + rows, dtype=torch.bool, device=device)
        return self._inputs(feature, feature, positions, visible, cache, rows)


class _LevelGraph(torch.nn.Module):
    """What is compiled: the drafter's public forward over the live part of its KV buffer, then its projection. A
    module holding the drafter, so that freezing makes its weights constants (as `compiled._Graph` does the
    target's)."""

    def __init__(self, drafter):
        super().__init__()
        self.drafter = drafter

    def forward(self, feature, embeds, position_ids, slots, mask, buffer):
        """feature, embeds [1, T, h]; position_ids [1, T]; slots [T]; mask [1, 2, T, S]; buffer
        [1, 2, 1, H_kv, capacity, D] -> (states [T, h], logits [T, N], the new entries [1, 2, 1, H_kv, T, D])."""
        cache = LiveCache(buffer[:, :, :, :, : mask.shape[-1]], slots)
        state = self.drafter(feature, embeds, position_ids, mask, cache)[0]  # [T, h]
        return state, self.drafter.logits(state), torch.stack(cache.new)


class CompiledGraph:
    """A drafter's own graph (a drafter kind's drafting step: the block drafter's block) compiled with Inductor
    `options` like the target's step, loaded from disk by a later process; where it cannot run, the same graph runs
    eagerly, with a log line: only a slower draft. The caller pads its inputs to the dynamic dimensions' ranges."""

    def __init__(self, graph, drafter, example_inputs: tuple, dynamic: dict, what: str, options: dict, label: str):
        self.graph, self.drafter, self.inputs, self.dynamic = graph, drafter, example_inputs, dynamic
        self.what, self.options, self.label = what, dict(options), label
        self.min_rows, self.max_rows = MIN_ROWS, MAX_ROWS
        self.compiled = None
        self.compile_seconds = 0.0
        self.failed: str | None = None  # why the compiled graph stopped being used, if it did

    def graph_key(self) -> dict:
        text = json.dumps(self.drafter.config.to_dict(), sort_keys=True, default=str)
        return compile_cache.model_key(self.drafter, "drafter", text, code_of=type(self.drafter))

    def __call__(self, *inputs):
        if self.failed is None:
            try:
                return self._compiled()(*inputs)
            except Exception as err:  # the compiler's errors have many types; the eager run is always correct
                self.failed = compile_cache.failure(err)
                log.warning("%s compiled failed (%s): it runs eagerly from now on", self.what, self.failed)
        with torch.inference_mode():
            return self.graph(*inputs)

    def traced_attention(self):
        return nullcontext()  # the drafter's layers attend by their own attention function

    def _compiled(self):
        if self.compiled is None:
            on_cpu = next(self.drafter.parameters()).device.type == "cpu"
            self.compiled = (compile_cache.Package if on_cpu else compile_cache.InProcess)(self.graph, self)
        return self.compiled

    def dynamic_sizes(self) -> dict:
        """Every input of the graph's forward, in order, with its dynamic dimensions ({} for a static input); inputs
        whose dimensions share a name share one size."""
        sizes = {name: torch.export.Dim(name, min=low, max=high) for dims in self.dynamic.values()
                 for name, low, high in dims.values()}  # fmt: skip
        names = inspect.signature(self.graph.forward).parameters
        return {name: {dim: sizes[size[0]] for dim, size in self.dynamic.get(name, {}).items()} for name in names}

    def example_inputs(self) -> tuple:
        return self.inputs


class CompiledHeads:
    """Medusa heads (`features(hidden) -> [K, ..., H]`) and the target's vocabulary projection compiled as one graph
    with Inductor `options`: the target's last hidden state [H] -> every head's logits [K, N]."""

    what = "the Medusa heads"  # what the log calls them

    def __init__(self, heads, target, rows: torch.Tensor | None, options: dict, label: str):
        self.heads, self.target, self.options, self.label = heads, target, dict(options), label
        self.rows = None if rows is None else rows.to(target.device)
        self.min_rows = self.max_rows = 1  # one row: the last hidden state
        self.compiled = self.eager = None  # the compiled graph; the same graph run eagerly, after a failure
        self.compile_seconds = 0.0
        self.failed: str | None = None

    def graph_key(self) -> dict:
        """What the compiled graph computes: the heads, and the target's projection (its weights and the rows kept)."""
        text = json.dumps(self.heads.config.to_dict(), sort_keys=True, default=str)
        rows = "all" if self.rows is None else hashlib.sha256(self.rows.cpu().numpy().tobytes()).hexdigest()[:16]
        key = compile_cache.model_key(self.heads, "drafter", text, code_of=type(self.heads))
        return {**key, "target_fingerprint": weights_fingerprint(self.target), "projection_rows": rows}

    def __call__(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [H] -> logits [K, N]."""
        if self.failed is None:
            try:
                return self._compiled()(hidden[None])[:, 0]
            except Exception as err:  # the compiler's errors have many types; the eager run is always correct
                self.failed = compile_cache.failure(err)
                log.warning("the compiled Medusa heads failed (%s): they run eagerly from now on", self.failed)
        if self.eager is None:
            self.eager = self._graph()
        with torch.inference_mode():
            return self.eager(hidden[None])[:, 0]

    def traced_attention(self):
        return nullcontext()  # no attention in the heads' graph

    def _graph(self) -> "_HeadsGraph":
        output = self.target.get_output_embeddings()
        weight, bias = output.weight, getattr(output, "bias", None)
        if self.rows is not None:
            weight, bias = weight[self.rows], None if bias is None else bias[self.rows]
        return _HeadsGraph(self.heads, weight, bias, logit_softcap(self.target.config))

    def _compiled(self):
        if self.compiled is None:
            on_cpu = self.target.device.type == "cpu"
            self.compiled = (compile_cache.Package if on_cpu else compile_cache.InProcess)(self._graph(), self)
        return self.compiled

    def dynamic_sizes(self) -> dict:
        return {"hidden": {}}  # one row: nothing dynamic

    def example_inputs(self) -> tuple:
        weight = self.target.get_output_embeddings().weight
        return (torch.zeros(1, weight.shape[1], dtype=weight.dtype, device=weight.device),)


class _HeadsGraph(torch.nn.Module):
    """What is compiled for Medusa heads: every head's features, then the projection (the target's weights, or its
    draft vocabulary's rows, held here as parameters so that freezing packs them)."""

    def __init__(self, heads, weight: torch.Tensor, bias: torch.Tensor | None, cap: float | None):
        super().__init__()
        self.heads, self.cap = heads, cap
        self.weight = torch.nn.Parameter(weight.detach(), requires_grad=False)  # [N, H]
        self.bias = None if bias is None else torch.nn.Parameter(bias.detach(), requires_grad=False)

    def forward(self, hidden):
        """hidden [1, H] -> logits [K, 1, N]."""
        feats = self.heads.features(hidden.to(self.weight.dtype))  # [K, 1, H]
        return softcap(F.linear(feats, self.weight, self.bias), self.cap)
