"""The target's step compiled for this machine: static weights, one KV buffer, Inductor's generated kernels.

An eager forward of a small target at batch 1 spends as long between operators (Python, dispatch, unfused norms,
rotary and activations) as in its weight products, and its products stream the weights well below the machine's
bandwidth at a few rows. Compiled, the whole forward is one graph: Inductor fuses the elementwise work into
generated loops, freezes the weights as constants, and (on CPUs, with `max_autotune`) computes the products by its
C++ GEMM template over weights it packs once, which streams them near the memory's speed at one to a few rows.

How it is compiled: on CPUs ahead of time (`torch.export`, then AOTInductor), into a package on disk
(`compile_cache.py`) that any later process of the same target, settings and machine loads in seconds; on GPUs by
`torch.compile` with CUDA graphs, in the process (AOTInductor has no CUDA graphs).

    step = CompiledStep(target, options, label)   # compiles on first use (logged), or loads an earlier package
    cache = step.new_cache(capacity)              # one buffer [layers, 2, 1, heads_kv, capacity, head_dim]
    logits, features = step.forward(input_ids, position_ids, tree_mask, cache, feature_layers)

What stays static and what does not: the weights are constants; the node count T and the live cache length are dynamic
dimensions of one graph, so every tree size and every position runs the same compiled code, with no padding beyond one
row (a single node is computed with a masked dummy row: a dimension of 1 would be specialised). A prompt's prefill runs
the target's forward eagerly over the same cache (compute-bound over hundreds of rows: compiling it buys little and
would double the compile). The attention sees a [1, 2, T, S] boolean mask over the live cache (the full-attention
layers' visibility, then the sliding-window layers'), built here from the loop's tree mask and the nodes' positions, so
sliding-window families compile too. On CPUs it runs `cpu/tree_attention.py`'s kernel, which computes each row alone:
with the products (the GEMM template, and bf16's dot-product kernel `cpu/bf16_linear.py`, give a row the same bits at
any row count), a node gets the same bits in a one-node step as in any tree, so tree methods equal greedy decoding on
the step in bf16 too, where SDPA's rounding differences flipped near-ties.

A batch (`decoding/batch.py`) runs the same graph over a static [L, 2, B, H_kv, capacity, D] buffer (`static_cache.py`)
for bucketed batch sizes (`BUCKETS`; a batch between two runs in the next, its padding rows seeing only their own
slots, and moves into a smaller bucket as its rows finish): one graph per bucket for one node a row (plain decoding, a
static node count: a dimension of 1 is not padded to two there) and one for trees, each compiled on first use and
keyed by its bucket (`BatchGraph`). Each row writes and attends over its own slots; the
attention kernel computes each row of each sequence alone, so a row of a batch gets the bits of its batch-1 step.

The output is what this compiled forward computes, which rounds differently from the eager one: greedy decoding on the
same step is the reference every method is compared with (`tree="none"`), as it is for any other kernel.
"""

import logging
from contextlib import contextmanager

import torch
import torch.nn.functional as F
from transformers import AttentionInterface
from transformers.utils.output_capturing import maybe_install_capturing_hooks

from medusa_like.decoding.attention import batch_visible
from medusa_like.decoding.kv_cache import write_slots
from medusa_like.decoding.step import TargetStep
from medusa_like.targets import cache_keyword, output_logits

from . import compile_cache
from .cpu import tree_attention
from .static_cache import BUCKETS, MIN_ROWS, LiveCache, StaticBatchCache, StaticTreeCache

log = logging.getLogger(__name__)

ATTENTION = "medusa_like_static"  # the attention function the compiled step's target runs (registered below)
MAX_ROWS = 64  # steps of up to this many nodes run compiled; larger forwards (prefills) run the same code eagerly
MAX_CONTEXT = 1 << 20  # the longest live cache the compiled graph is built for (a bound the compiler needs)


# ---------------------------------------------------------------------------------------------------------------------
# Masks and attention


@contextmanager
def attention_traced(config):
    """A model of `config` attends through `static_attention` (`ATTENTION`) for the block: how every compiled graph
    (the target's step, a drafter's level) is traced and run."""
    previous, config._attn_implementation = config._attn_implementation, ATTENTION
    try:
        yield
    finally:
        config._attn_implementation = previous


def window_mask(visible: torch.Tensor, q_pos: torch.Tensor, k_pos: torch.Tensor, window: int | None) -> torch.Tensor:
    """visible [T, S] -> [1, 2, T, S]: as it is (full-attention layers), and limited to keys less than `window`
    positions back (sliding-window layers; the same as the first without a window)."""
    windowed = visible if not window else visible & ((q_pos[:, None] - k_pos[None, :]) < window)
    return torch.stack([visible, windowed])[None]


def static_attention(module, query, key, value, attention_mask, scaling=None, sliding_window=None, softcap=None, **_):
    """transformers' attention-function signature over the step's [1, 2, T, S] mask (`window_mask`). A step's rows
    on a CPU attend by the row-invariant kernel (`cpu/tree_attention.py`), so that a tree row gets the bits of its
    one-node step; a prompt's prefill, and anything the kernel does not run, by SDPA."""
    visible = attention_mask[:, 1:2] if sliding_window else attention_mask[:, :1]  # [1, 1, T, S]
    if query.shape[2] <= MAX_ROWS and tree_attention.supports(query, softcap):
        scale = scaling if scaling is not None else query.shape[-1] ** -0.5
        out = torch.ops.medusa_like.tree_attention(query, key, value, visible, scale)  # [1, H, T, D]
    elif softcap:  # scaled_dot_product_attention has no logit soft-capping
        scores = torch.matmul(query, key.repeat_interleave(query.shape[1] // key.shape[1], 1).transpose(-1, -2))
        scores = torch.tanh(scores * (scaling or query.shape[-1] ** -0.5) / softcap) * softcap
        probs = scores.masked_fill(~visible, float("-inf")).softmax(-1)
        out = torch.matmul(probs, value.repeat_interleave(query.shape[1] // value.shape[1], 1))
    else:
        gqa = query.shape[1] != key.shape[1]
        out = F.scaled_dot_product_attention(query, key, value, attn_mask=visible, scale=scaling, enable_gqa=gqa)
    return out.transpose(1, 2), None


AttentionInterface.register(ATTENTION, static_attention)


# ---------------------------------------------------------------------------------------------------------------------
# The step


class CompiledStep(TargetStep):
    """`TargetStep` (decoding/step.py) of a target compiled by `torch.compile` with Inductor `options`
    (`platform.compile_settings`). Steps of up to `MAX_ROWS` nodes run compiled; a prompt's prefill, and any larger
    forward, run the same function eagerly over the same cache (on `eager_target`'s layers where one is given). A
    compile or run that fails logs why and falls back to that eager run for good (`failed`): never a wrong token, only
    a slower one."""

    what = "the target's step"  # what the log calls it

    def __init__(self, target, options: dict, label: str, eager_target=None):
        self.target, self.options, self.label = target, dict(options), label
        # what the eager runs compute with: `eager_target`, the same weights behind other layers (the few-row CPU
        # layers, whose prompt-sized products run on oneDNN's pack, faster than F.linear), else the compiled target
        self.eager_target = eager_target if eager_target is not None else target
        text = target.config.get_text_config()
        self.window = getattr(text, "sliding_window", None) if _slides(text) else None
        self.num_layers = text.num_hidden_layers
        self.heads = text.num_key_value_heads
        self.head_dim = getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads
        self.min_rows, self.max_rows = MIN_ROWS, MAX_ROWS  # the node counts that run compiled
        self.cache_keyword = cache_keyword(target.base_model)  # looked up here: the compiled graph reads a string
        # the compiled functions, by (batch bucket, one node a row), each for every drafter (it returns every layer's
        # states): (1, False) the single-row step's
        self.graphs: dict = {}
        self.compile_seconds = 0.0
        self.failed: str | None = None  # why the compiled function stopped being used, if it did

    @property
    def compiled(self):
        """The single-row step's compiled function, once compiled or loaded (None before its first use)."""
        return self.graphs.get((1, False))

    @compiled.setter
    def compiled(self, function) -> None:  # None: compiled or loaded again on next use, as by a new process
        if function is None:
            self.graphs.pop((1, False), None)
        else:
            self.graphs[(1, False)] = function

    def describe(self) -> str:
        return f"compiled ({self.label})"

    def graph_key(self) -> dict:
        """What the compiled graph computes, for its cache's key (`compile_cache.cache_key`)."""
        return compile_cache.model_key(self.target, "target", self.target.config.to_json_string(use_diff=False))

    def new_cache(self, capacity: int) -> StaticTreeCache:
        dtype = self.target.get_input_embeddings().weight.dtype
        return StaticTreeCache(self.num_layers, self.heads, self.head_dim, capacity, dtype, self.target.device)

    def new_batch_cache(self, rows: int, capacity: int) -> StaticBatchCache:
        dtype = self.target.get_input_embeddings().weight.dtype
        return StaticBatchCache(self.num_layers, self.heads, self.head_dim, rows, capacity, dtype, self.target.device)

    def forward(self, input_ids, position_ids, tree_mask, cache: StaticTreeCache, feature_layers=None, last=False):
        real = input_ids.shape[1]
        cache.check_room(real)
        layers = None if feature_layers is None else tuple(feature_layers)
        if last or real > self.max_rows or self.failed:  # a prefill, a large forward, or after a failure: eagerly
            mask, slots, positions = self._inputs(cache, position_ids, tree_mask, real)
            ends = torch.tensor([real - 1], device=input_ids.device) if last else None
            logits, hidden, states, new = self._eager(input_ids, positions, slots, mask, cache.buffer, layers, ends)
            cache.write(new)
            return logits if last else logits[0], _features(hidden, states, layers)[0]
        rows = max(real, MIN_ROWS)
        ids = torch.cat([input_ids, input_ids.new_zeros(1, rows - real)], dim=1)  # [1, T]: a dummy row after one node
        mask, slots, positions = self._inputs(cache, position_ids, tree_mask, rows)
        try:
            with self.traced_attention():
                # the whole buffer goes in, sliced to the live length inside: any capacity and length, one graph (a
                # view's strides would name its buffer's capacity, and another capacity would compile again)
                logits, hidden, states, new = self._compiled()(ids, positions, slots, mask, cache.buffer)
        except Exception as err:  # the compiler's errors have many types; the eager run below is always correct
            self._fail(err)
            return self.forward(input_ids, position_ids, tree_mask, cache, feature_layers, last)
        cache.write(new)
        return logits[0, :real], _features(hidden, states, layers)[0, :real]

    def forward_batch(self, input_ids, position_ids, mask, cache, feature_layers=None, last=None, nodes=None):
        """`TargetStep.forward_batch` over a `StaticBatchCache`: R rows run the graph of their bucket (`bucket`: B >= R
        rows, padding rows after the real ones, each padding node seeing only its own slot), of one node a row or of T
        (padding nodes computed too: `nodes` unused); a prefill chunk, a larger forward or a batch past the largest
        bucket runs eagerly. Each row attends by the row-invariant kernel over its own slots, so a row's step computes
        the bits of its batch-1 step (`forward`) where the products are row-invariant."""
        rows, real = input_ids.shape
        cache.check_room(real, rows)
        layers = None if feature_layers is None else tuple(feature_layers)
        size = cache.buffer.shape[2]
        if last is not None or real > self.max_rows or self.failed or size not in BUCKETS:
            ids, positions, slots, both = self._batch_inputs(cache, input_ids, position_ids, mask, rows, real)
            logits, hidden, states, new = self._eager(
                ids, positions, slots, both, cache.buffer[:, :, :rows], layers, last
            )
            cache.write(new, slots)
            return logits, _features(hidden, states, layers)
        nodes = 1 if real == 1 and size > 1 else max(real, MIN_ROWS)  # one node per row compiles as its own graph
        ids, positions, slots, both = self._batch_inputs(cache, input_ids, position_ids, mask, size, nodes)
        try:
            with self.traced_attention():
                if size == 1:  # one row: the single-row graph, over its slots [T]
                    logits, hidden, states, new = self._compiled()(ids, positions, slots[0], both, cache.buffer)
                else:
                    logits, hidden, states, new = self._compiled(size, nodes == 1)(
                        ids, positions, slots, both, cache.buffer
                    )
        except Exception as err:  # as in `forward`: the eager run is always correct
            self._fail(err)
            return self.forward_batch(input_ids, position_ids, mask, cache, feature_layers, last)
        cache.write(new[:, :, :rows], slots[:rows])
        return logits[:rows, :real], _features(hidden, states, layers)[:rows, :real]

    def _eager(self, ids, positions, slots, mask, buffer, layers, last):
        """The step's function run eagerly on `eager_target`'s layers (a prefill, a large forward, after a failure)."""
        with torch.inference_mode(), attention_traced(self.eager_target.config):
            graph = _Graph(self.eager_target, self.cache_keyword, every_state=layers is not None)
            return graph(ids, positions, slots, mask, buffer, last)

    def _fail(self, err: Exception) -> None:
        self.failed = compile_cache.failure(err)
        log.warning("the compiled step failed (%s): the eager step runs from now on", self.failed)

    def traced_attention(self):
        """The target's attention through `static_attention` for the block (as the compiled graph was traced)."""
        return attention_traced(self.target.config)

    def _inputs(self, cache: StaticTreeCache, position_ids, tree_mask, rows: int):
        """The [1, 2, T, S] mask of a forward of `rows` nodes (the first `position_ids.shape[1]` real, the others
        dummies that see only themselves) after the committed entries, the slots they take and their positions
        [1, T]."""
        length, real, device = cache.length, position_ids.shape[1], position_ids.device
        block = torch.eye(rows, dtype=torch.bool, device=device)  # [T, T]
        causal = torch.ones(real, real, dtype=torch.bool, device=device).tril()
        block[:real, :real] = tree_mask[0, 0] if tree_mask is not None else causal
        visible = torch.cat([torch.ones(rows, length, dtype=torch.bool, device=device), block], dim=1)  # [T, S]
        q_pos = torch.cat([position_ids[0], position_ids[0, -1:].expand(rows - real)])  # [T]
        k_pos = torch.cat([torch.arange(length, device=device), q_pos])  # [S]
        slots = torch.arange(length, length + rows, device=device)  # [T]
        return window_mask(visible, q_pos, k_pos, self.window), slots, q_pos[None]

    def _batch_inputs(self, cache: StaticBatchCache, input_ids, position_ids, mask, size: int, nodes: int):
        """The loop's batch inputs (R rows of T nodes under `mask` [R, 1, T, S]) padded to `size` rows of `nodes`
        nodes, every padding row and node seeing only its own slot -> (ids, positions, slots [size, nodes], the mask
        [size, 2, nodes, S'] of the full-attention layers and the sliding-window ones)."""
        rows, real = input_ids.shape
        device = input_ids.device
        lengths = torch.tensor(cache.lengths[:rows] + [0] * (size - rows), device=device)  # [size]
        slots = write_slots(lengths, nodes)  # [size, nodes]
        visible = torch.zeros(size, nodes, max(cache.lengths[:rows]) + nodes, dtype=torch.bool, device=device)
        visible.scatter_(2, slots[:, :, None], True)  # each node its own slot
        visible[:rows, :real, : mask.shape[-1]] = mask[:, 0]  # the real nodes as the loop says
        ids = input_ids.new_zeros(size, nodes)
        ids[:rows, :real] = input_ids
        positions = lengths[:, None].repeat(1, nodes)  # [size, nodes]
        positions[:rows, :real] = position_ids
        windowed = batch_visible(visible[:, None], self.window)[:, 0]
        return ids, positions, slots, torch.stack([visible, windowed], 1)

    def _compiled(self, size: int = 1, one_node: bool = False):
        """The compiled function of the single-row step (`size` 1), or of a batch bucket's step of `size` rows (one
        node per row where `one_node`), compiled (or loaded) on first use."""
        key = (size, one_node)
        if key not in self.graphs:
            # transformers installs its hidden-state hooks on the first forward that asks for them, under a lock
            # the compiler cannot trace: installed here, before tracing
            maybe_install_capturing_hooks(self.target.base_model)
            graph = _Graph(self.target, self.cache_keyword, every_state=True)
            variant = self if size == 1 else BatchGraph(self, size, one_node)
            run = compile_cache.Package if self.target.device.type == "cpu" else compile_cache.InProcess
            self.graphs[key] = run(graph, variant)
            self.compile_seconds += variant.compile_seconds if variant is not self else 0.0
        return self.graphs[key]

    def dynamic_sizes(self) -> dict:
        """The graph's dynamic dimensions, by input: the node count T, the live cache length S, the buffer's
        capacity (each a `torch.export.Dim`, with its bounds)."""
        Dim = torch.export.Dim
        rows = Dim("rows", min=MIN_ROWS, max=self.max_rows)
        live, capacity = Dim("live", min=MIN_ROWS, max=MAX_CONTEXT), Dim("capacity", min=MIN_ROWS, max=MAX_CONTEXT)
        return {"input_ids": {1: rows}, "position_ids": {1: rows}, "slots": {0: rows}, "mask": {2: rows, 3: live},
                "buffer": {4: capacity}}  # fmt: skip

    def example_inputs(self) -> tuple:
        """Inputs of the graph's shapes for tracing it: 3 nodes after 5 committed entries in a buffer of 11 slots
        (three different sizes, so that the tracer takes none for another)."""
        length, rows, capacity = 5, 3, 11
        cache = StaticTreeCache(self.num_layers, self.heads, self.head_dim, capacity - MIN_ROWS + 1,
                                self.target.get_input_embeddings().weight.dtype, self.target.device)  # fmt: skip
        cache.length = length
        device = self.target.device
        positions = torch.arange(length, length + rows, device=device)[None]
        mask, slots, positions = self._inputs(cache, positions, None, rows)
        return torch.zeros(1, rows, dtype=torch.long, device=device), positions, slots, mask, cache.buffer


class BatchGraph:
    """What `compile_cache` compiles for one bucket of a batched step (`CompiledStep.forward_batch`): the step's graph
    over `size` rows, each of one node (`one_node`: plain decoding, a static dimension) or of T nodes (trees,
    dynamic), with per-row slots [B, T]. Its key is the step's and its bucket."""

    what = "the target's batched step"

    def __init__(self, step: CompiledStep, size: int, one_node: bool):
        self.step, self.size, self.one_node = step, size, one_node
        self.options, self.label = step.options, f"{step.label}, batch {size}{', one node a row' if one_node else ''}"
        self.min_rows, self.max_rows = (1, 1) if one_node else (MIN_ROWS, step.max_rows)
        self.compile_seconds = 0.0

    def graph_key(self) -> dict:
        return {**self.step.graph_key(), "batch": self.size, "one_node": self.one_node}

    def traced_attention(self):
        return self.step.traced_attention()

    def dynamic_sizes(self) -> dict:
        Dim = torch.export.Dim
        live, capacity = Dim("live", min=MIN_ROWS, max=MAX_CONTEXT), Dim("capacity", min=MIN_ROWS, max=MAX_CONTEXT)
        if self.one_node:
            return {"input_ids": {}, "position_ids": {}, "slots": {}, "mask": {3: live}, "buffer": {4: capacity}}
        rows = Dim("rows", min=MIN_ROWS, max=self.max_rows)
        return {"input_ids": {1: rows}, "position_ids": {1: rows}, "slots": {1: rows}, "mask": {2: rows, 3: live},
                "buffer": {4: capacity}}  # fmt: skip

    def example_inputs(self) -> tuple:
        """Inputs of the graph's shapes: `size` rows of 1 or 3 nodes after 5 committed entries each, in a buffer of
        11 slots."""
        step, nodes, device = self.step, 1 if self.one_node else 3, self.step.target.device
        cache = StaticBatchCache(
            step.num_layers,
            step.heads,
            step.head_dim,
            self.size,
            11 - MIN_ROWS + 1,
            step.target.get_input_embeddings().weight.dtype,
            device,
        )
        cache.lengths = [5] * self.size
        ids = torch.zeros(self.size, nodes, dtype=torch.long, device=device)
        positions = torch.arange(5, 5 + nodes, device=device)[None].repeat(self.size, 1)
        mask = torch.ones(self.size, nodes, 5 + nodes, dtype=torch.bool, device=device)
        mask[:, :, 5:] = torch.ones(nodes, nodes, dtype=torch.bool, device=device).tril()
        ids, positions, slots, both = step._batch_inputs(cache, ids, positions, mask[:, None], self.size, nodes)
        return ids, positions, slots, both, cache.buffer


class _Graph(torch.nn.Module):
    """What is compiled: the target's public forward over the live part of a KV buffer, its logits and the features a
    drafter reads. A module holding the target, so that the compiler sees the target's weights as parameters, which
    freezing turns into constants (reached through a plain object, they would be ordinary inputs: nothing packed).
    Compiled, it returns every layer's hidden states (`every_state`), so that one graph serves every drafter, whatever
    layers it reads: a few rows of them cost next to nothing beside the weights."""

    def __init__(self, target, cache_keyword: str, every_state: bool):
        super().__init__()
        self.target, self.cache_keyword, self.every_state = target, cache_keyword, every_state

    def forward(self, input_ids, position_ids, slots, mask, buffer, last=None):
        """input_ids, position_ids [B, T]; slots: the new entries' slots, [T] (one sequence: the last T of the S live
        slots) or [B, T] (each row's own); mask [B, 2, T, S]; buffer [L, 2, B, H_kv, capacity, D] -> (logits
        [B, T, V] (or [B, V] of the nodes `last` [B], eagerly), the last hidden state [B, T, H], every layer's hidden
        states [L + 1, B, T, H] (with `every_state`; else [0]), the new entries [L, 2, B, H_kv, T, D], which the step
        writes at `slots` after the graph)."""
        cache = LiveCache(buffer[:, :, :, :, : mask.shape[-1]], slots)
        out = self.target.base_model(
            input_ids=input_ids,
            position_ids=position_ids,
            attention_mask=mask,
            use_cache=True,
            **{self.cache_keyword: cache},
            output_hidden_states=self.every_state,
        )
        hidden = out.last_hidden_state  # [B, T, H]
        states = torch.stack(out.hidden_states) if self.every_state else hidden.new_empty(0)  # [L + 1, B, T, H]
        picked = hidden if last is None else hidden[torch.arange(hidden.shape[0], device=hidden.device), last]
        logits = output_logits(self.target, picked)  # [B, T, V] or [B, V]
        return logits, hidden, states, torch.stack(cache.new)  # ..., [L, 2, B, H_kv, T, D]


def _features(hidden: torch.Tensor, states: torch.Tensor, layers: tuple[int, ...] | None) -> torch.Tensor:
    """What a drafter reads: the last hidden state [B, T, H] (`layers` None), else the hidden states of `layers`
    (`states` [L + 1, B, T, H]) side by side [B, T, len(layers) * H]."""
    return hidden if layers is None else torch.cat([states[i] for i in layers], -1)


def _slides(text) -> bool:
    """Whether any layer of a target of this text config attends through a sliding window."""
    if not getattr(text, "sliding_window", None):
        return False
    if getattr(text, "layer_types", None) is not None:
        return "sliding_attention" in text.layer_types
    return getattr(text, "use_sliding_window", True)
