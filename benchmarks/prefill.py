"""Prefill benchmark: what the target's forward over an N-token prompt costs with each prefill kernel.

    python -m eval.bench prefill                                  # default target, fp32, N = 65, 128, 300, 600
    python -m eval.bench prefill --tokens 128,512 --rounds 5 --out bench_prefill.json
    python -m eval.bench prefill --batch 4 --tokens 384          # training's read: [4, 384] through the public forward
    python -m eval.bench prefill --tokens 8,24,46,64,150         # short prompts too (the compiled step reads them on oneDNN)
    python -m eval.bench prefill --batch 4 --tokens 384 --compile-read --dtype bfloat16   # the read by torch.compile too

A prompt's products run over more rows than any tree step (over `few_row_linear.MAX_ROWS`), on oneDNN's pack where
torch runs it (`few_row_linear.py`). A copy of the target with its own `nn.Linear` layers, one with the few-row layers
and one reading on oneDNN's pack from two rows (the compiled step's prompts) prefill random prompts of each length
alternately, round after round (the forward alone, into an empty KV cache: decoding projects only a prompt's last
row); the median round is reported. With `--batch B`, each round instead reads B rows of N tokens through the
target's public forward with every hidden state returned, as training reads the frozen target (`DrafterModule
.target_hidden`, the target cache's build); `--compile-read` adds that read by `torch.compile` (Inductor's default
settings, one shape: training's batches are padded to one length), its compile timed apart: what compiling training's
read would buy.
"""

import copy
from types import SimpleNamespace
from typing import Annotated

import torch

from medusa_like.decoding.attention import pick_backend
from medusa_like.decoding.step import EagerStep
from medusa_like.evaluation.timing import alternating_medians, ms_table
from medusa_like.forward.cpu.few_row_linear import use_few_row_linears
from medusa_like.forward.cpu.read_kernel import use_read_kernel
from medusa_like.targets import DEFAULT_TARGET

from .harness import Report, load, timed


@torch.inference_mode()
def prefill_ms(target, ids: torch.Tensor) -> float:
    """ms of the target's forward over `ids` [1, N] into an empty KV cache."""
    step = EagerStep(target, pick_backend("auto", ids.device))
    cache = step.new_cache(ids.shape[1])
    positions = torch.arange(ids.shape[1], device=ids.device)[None]
    return timed(lambda: step.forward(ids, positions, None, cache, last=True))[0]


@torch.inference_mode()
def read_ms(target, ids: torch.Tensor) -> float:
    """ms of training's read of `ids` [B, N]: the public forward, every hidden state returned."""
    mask = torch.ones_like(ids)
    return timed(lambda: target.base_model(input_ids=ids, attention_mask=mask, output_hidden_states=True))[0]


def prefill_targets(stock) -> dict:
    """`stock` (its own nn.Linear layers) and its few-row copies, by name."""
    few_row = copy.deepcopy(stock)
    use_few_row_linears(few_row)
    targets = {"nn.Linear": stock, "few_row": few_row}
    reads = copy.deepcopy(stock)  # how the compiled step reads a prompt: oneDNN's pack from two rows on
    if use_read_kernel(reads, "auto", from_rows=2):
        targets["few_row, oneDNN from 2 rows (the compiled step's prompts)"] = reads
    return targets


def run(
    *,
    target: str = DEFAULT_TARGET,
    dtype: str = "float32",
    rounds: Annotated[int, "alternating rounds; the median round is reported"] = 5,
    tokens: Annotated[tuple[int, ...], "prompt lengths"] = (65, 128, 300, 600),
    batch: Annotated[int | None, "time training's read of B rows instead of a prefill"] = None,
    compile_read: Annotated[bool, "with --batch: also the read by torch.compile (Inductor's defaults)"] = False,
    out: str = "bench_prefill.json",
) -> Report:
    """The target's forward over an N-token prompt per prefill kernel against nn.Linear (or training's read)."""
    if compile_read and not batch:
        raise ValueError("--compile-read times training's read: give --batch too")
    lengths = sorted(set(tokens))
    stock, _, _ = load(target, dtype=dtype, device=None)
    targets = prefill_targets(stock)
    if compile_read:  # the stock layers, compiled: one graph per length (each compiled in the warm-up below)
        targets["nn.Linear, torch.compile"] = SimpleNamespace(base_model=torch.compile(stock.base_model, dynamic=False))
    vocab = stock.config.get_text_config().vocab_size
    rows = batch or 1
    prompts = [torch.randint(0, vocab, (rows, n), generator=torch.Generator().manual_seed(n)) for n in lengths]
    measure = read_ms if batch else prefill_ms
    warmup = {name: sum(measure(model, ids) for ids in prompts) / 1000 for name, model in targets.items()}
    median = alternating_medians(lambda model: [measure(model, ids) for ids in prompts], targets, rounds)
    what = f"training's read of {rows} x N tokens" if batch else "target forward over an N-token prompt"
    shown = ms_table(f"{what}, ms ({dtype}, {torch.get_num_threads()} threads)", "linears", lengths, median)
    result = {"target": target, "dtype": dtype, "batch": batch, "tokens": lengths, "prefill_ms": median}
    notes = []
    if compile_read:
        result["compile_s"] = round(warmup["nn.Linear, torch.compile"], 1)  # the first read of every length
        notes.append(f"torch.compile's first reads, its compile included: {result['compile_s']} s")
    return Report(result, [shown], notes, out=out)
