"""The decoding methods an evaluation times, written once: name -> label, description and runner factory.

Each factory takes a `MethodContext` and returns a `timing.Runner`. Adding a method (another proposer, another
baseline) is one entry in `METHODS`; the report, its tables and the speed summary follow it.
"""

import logging
from collections.abc import Callable
from dataclasses import dataclass

import torch

from medusa_like.drafters.protocol import sized_by_cost_model
from medusa_like.engines.llamacpp import plain as llamacpp_plain
from medusa_like.evaluation.timing import Runner

log = logging.getLogger(__name__)

REFERENCE = "hf_greedy"  # the output every method must reproduce token for token: greedy on the same forward
LLAMACPP_PLAIN = "llamacpp_plain"  # llama.cpp's plain decoding, where it is built
STOCK = "hf_greedy_stock"  # transformers' greedy as it ships: every output is compared with it too
BASELINES = ("hf_greedy", "hf_prompt_lookup")  # speedups are reported against each of these
SPECULATIVE = "speculative"  # the method under evaluation: its acceptance and losslessness are reported


@dataclass(frozen=True)
class MethodContext:
    """What the runner factories need: the model, the evaluated tree, EOS/pad ids and the baselines' settings."""

    model: object  # MedusaLikeModel
    tree: object  # a resolved tree spec (`model.resolve_tree`)
    eos: list[int]
    pad: int | None
    prompt_lookup_num_tokens: int
    learned_tree: object = None  # the tree the learned drafter decodes with alone (`learned_alone_tree`)

    @property
    def combined(self) -> bool:
        return combined(self.model)

    def alone(self, part: str):
        return alone(self.model, part)


def combined(model) -> bool:
    """Whether `model`'s drafter merges parts that can each decode alone (a learned drafter and lookup)."""
    return sized_by_cost_model(model.drafter) and bool(model.drafter.parts())


def alone(model, part: str):
    """A combined model's learned drafter or lookup decoding alone (`Drafter.parts`), on the same prepared target (its
    step, kernels, compiled code and cost model shared: lookup alone budgets its trees by the one the combined drafter
    was settled on, `PreparedTarget.settle`). The learned drafter alone fills a dynamic or static tree and consults no
    cost model."""
    drafter = model.drafter.parts()[part]
    # drafter_dtype: the learned drafter's dtype stays the evaluated model's
    return type(model)(
        model.forward,
        model.tokenizer,
        drafter,
        target_name=model.target_name,
        drafter_dtype=model.drafter_dtype if part == "learned" else None,
    )


def hf_runner(target, eos: list[int], pad: int | None, prompt_lookup: int | None = None) -> Runner:
    """transformers `generate`, greedy (with prompt-lookup decoding when `prompt_lookup` is set)."""
    kwargs = dict(do_sample=False, num_beams=1, eos_token_id=eos or None, pad_token_id=pad)
    if prompt_lookup:
        kwargs["prompt_lookup_num_tokens"] = prompt_lookup

    def run(ids: torch.Tensor, max_new_tokens: int):
        # an all-ones mask: ids equal to the pad id (random models, EOS-as-pad templates) must not be masked out
        out = target.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens, **kwargs)
        return out[0, ids.shape[1] :].tolist(), None

    return run


def greedy_runner(c: "MethodContext") -> Runner:
    """Method (a), greedy on the forward every method of this project runs: transformers' `generate` over the same
    layers where that forward is eager, this project's loop without a drafter where it is compiled (transformers'
    loop cannot call a compiled step, and compiled code rounds otherwise than eager code)."""
    if c.model.forward.step is c.model.forward.eager:
        return hf_runner(c.model.target, c.eos, c.pad)
    loop = loop_runner(c.model, c.model.resolve_tree("none"), c.eos)

    def run(ids: torch.Tensor, max_new_tokens: int):
        return loop(ids, max_new_tokens)[0], None  # a reference, reported as the baselines are: no decoding stats

    def batch(prompts: list[torch.Tensor], max_new_tokens: int):
        return [(tokens, None, seconds) for tokens, _, seconds in loop.batch(prompts, max_new_tokens)]

    run.batch = batch
    return run


def hf_compiled_runner(target, eos: list[int], pad: int | None, bucket: int = 256) -> Runner:
    """transformers `generate`, greedy, over a static cache with its forward compiled by `torch.compile` (Inductor's
    defaults): what a transformers user can do alone. The cache holds the prompt and its new tokens rounded up to
    `bucket` tokens: a few graphs serve every prompt (one per length met), and no step reads far more cache than it
    uses (a static cache's attention reads its whole length at every step)."""
    from transformers import CompileConfig, StaticCache

    compile_config = CompileConfig(fullgraph=True, mode="default")
    compile_config._compile_all_devices = True  # transformers compiles on GPUs only unless told
    kwargs = dict(do_sample=False, num_beams=1, eos_token_id=eos or None, pad_token_id=pad)

    def run(ids: torch.Tensor, max_new_tokens: int):
        length = -(-(ids.shape[1] + max_new_tokens) // bucket) * bucket
        cache = StaticCache(config=target.config, max_cache_len=length)
        out = target.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=max_new_tokens,
            cache=cache,
            compile_config=compile_config,
            **kwargs,
        )
        return out[0, ids.shape[1] :].tolist(), None

    return run


def loop_runner(model, tree, eos: list[int], batch_size: int | None = None) -> Runner:
    """This project's decoding loop with `tree` (any spec `model.generate` takes; "none": no drafter); its `batch`
    form decodes a batch of prompts at once, at most `batch_size` rows at a time (None: all; `generate`'s), each
    row's seconds its own, prefill included (`timing.BatchRunner`)."""

    def run(ids: torch.Tensor, max_new_tokens: int):
        # remember=False: the prompt loop hands each prompt's answer to the output store after every method ran it
        out = model.generate(ids, max_new_tokens=max_new_tokens, tree=tree, eos_token_id=eos, remember=False)
        return out.new_tokens.tolist(), out.stats.as_dict()

    def batch(prompts: list[torch.Tensor], max_new_tokens: int):
        outs = model.generate(
            prompts, max_new_tokens=max_new_tokens, tree=tree, eos_token_id=eos, remember=False, batch_size=batch_size
        )
        return [
            (o.new_tokens.tolist(), o.stats.as_dict(), o.stats.prefill_seconds + o.stats.decode_seconds) for o in outs
        ]

    run.batch = batch
    return run


def learned_alone_tree(model, tree, learned_tree=None):
    """The tree a combined model's learned drafter decodes with alone (method (e)): `learned_tree` (any tree
    `generate` takes: the tree search's own tree for it, a file read here once) resolved by the learned drafter itself
    (a combined drafter would merge lookup into it), else the part of the evaluated `tree` it fills."""
    return tree.learned_part if learned_tree is None else alone(model, "learned").resolve_tree(learned_tree)


def learned_alone_runner(c: MethodContext) -> Runner:
    """Method (e): the learned drafter alone, with `c.learned_tree` (`learned_alone_tree`), else with the part of the
    combined tree it fills."""
    return loop_runner(c.alone("learned"), c.tree.learned_part if c.learned_tree is None else c.learned_tree, c.eos)


def llamacpp_why_not(c: MethodContext) -> str | None:
    return llamacpp_plain.why_not(c.model.forward.stock())


def llamacpp_runner(c: MethodContext) -> Runner:
    """Method (l): llama.cpp's plain decoding of the target's own weights (`engines/llamacpp/plain.py`)."""
    return llamacpp_plain.plain_runner(c.model.forward.stock(), c.model.tokenizer, c.eos)


@dataclass(frozen=True)
class Method:
    label: str  # short, for tables
    description: str  # for the report's setup section
    make: Callable[[MethodContext], Runner]
    applies: Callable[[MethodContext], bool] = lambda c: True
    by_default: bool = True  # run when eval.methods names none; else only when named
    why_not: Callable[[MethodContext], str] = lambda c: "it does not apply to this drafter"  # logged when named


METHODS: dict[str, Method] = {
    "hf_greedy": Method(
        "(a) greedy, same forward",
        "(a) greedy on the forward every method of this project runs, the reference: transformers generate over the "
        "same layers where that forward is eager, this project's loop without a drafter where it is compiled",
        greedy_runner,
    ),
    "hf_prompt_lookup": Method(
        "(b) transformers prompt lookup",
        "(b) transformers prompt-lookup decoding",
        lambda c: hf_runner(c.model.target, c.eos, c.pad, c.prompt_lookup_num_tokens),
    ),
    STOCK: Method(
        "(g) transformers greedy, stock nn.Linear",
        "(g) transformers generate, greedy, with the target's own nn.Linear layers (not the few-row layers every other "
        "method shares): what transformers does as it ships; a speed baseline, and every output is compared with it "
        "as well as with (a)",
        lambda c: hf_runner(c.model.forward.stock(), c.eos, c.pad),
        lambda c: c.model.forward.differs_from_stock,
    ),
    "hf_greedy_compiled": Method(
        "(h) transformers greedy, static cache, torch.compile",
        "(h) transformers generate, greedy, over a static cache with its forward compiled by torch.compile "
        "(Inductor's defaults), on the target's own nn.Linear layers: what a transformers user can do alone; a speed "
        "baseline (its compiled code rounds otherwise than (a)'s, so its outputs are not compared)",
        lambda c: hf_compiled_runner(c.model.forward.stock(), c.eos, c.pad),
        by_default=False,  # minutes of compiling: make run and make mt-bench name it
    ),
    LLAMACPP_PLAIN: Method(
        "(l) llama.cpp plain, same precision",
        "(l) llama.cpp's plain greedy decoding (llama-server, one slot) of the target converted by llama.cpp's own "
        "converter in the target's precision, prompt processing included: the fastest plain decoding a CPU user can "
        "pick; a speed baseline (its kernels round otherwise than (a)'s, so its outputs are reported, not asserted); "
        "run where llama.cpp is built (`make llamacpp-build`)",
        llamacpp_runner,
        lambda c: llamacpp_why_not(c) is None,
        by_default=False,
        why_not=llamacpp_why_not,
    ),
    "plain_loop": Method(
        "(c) our loop, no drafter",
        "(c) this project's loop without a drafter (same cache and backend)",
        lambda c: loop_runner(c.model, c.model.resolve_tree("none"), c.eos),
    ),
    "learned": Method(
        "(e) learned drafter alone",
        "(e) the combined drafter's learned drafter alone, with its own searched tree (`learned_tree`), else with "
        "its part of the combined tree",
        learned_alone_runner,
        lambda c: c.combined,
    ),
    "lookup": Method(
        "(f) lookup alone",
        "(f) lookup alone (context and output store), no training, the same node budget",
        lambda c: loop_runner(c.alone("lookup"), c.tree, c.eos),
        lambda c: c.combined,
    ),
    SPECULATIVE: Method(
        "(d) speculative",
        "(d) speculative decoding with the drafter (for a combined drafter: learned + lookup in one tree)",
        lambda c: loop_runner(c.model, c.tree, c.eos),
    ),
}


def label(name: str) -> str:
    """A method's table label; its name when it is not registered (a report written by another version)."""
    return METHODS[name].label if name in METHODS else name


def not_run(context: MethodContext, names) -> dict[str, str]:
    """The methods `names` asks for that do not apply here, each with why (`Method.why_not`)."""
    return {name: METHODS[name].why_not(context) for name in sorted(names or ()) if not METHODS[name].applies(context)}


def not_run_for(model, tree, names) -> dict[str, str]:
    """`not_run` for `model` and `tree`, where no runner is made (the report's setup)."""
    return not_run(MethodContext(model, tree, [], None, 0), names)


def make_runners(model, tree, prompt_lookup_num_tokens: int, names=None, learned_tree=None) -> dict[str, Runner]:
    """One runner per registered method that applies to `model`'s drafter (or per method of `names`), with the
    evaluated `tree` (and `learned_tree`, the resolved tree the learned drafter alone decodes with,
    `learned_alone_tree`; None: `tree`'s learned part). The reference, stock greedy (where it differs from the
    reference's layers), the baselines and the speculative method always run. The target is settled first
    (`PreparedTarget.settle`: a combined or lookup drafter gets this machine's cost model), so that no method measures
    one of its own while others are timed."""
    model.forward.settle(model.drafter)
    eos = model.eos_token_ids()
    pad = model.tokenizer.pad_token_id
    context = MethodContext(
        model, tree, eos, pad if pad is not None else (eos[0] if eos else None), prompt_lookup_num_tokens, learned_tree
    )
    unknown = set(names or ()) - set(METHODS)
    if unknown:
        raise ValueError(f"eval.methods: unknown methods {sorted(unknown)}; known: {list(METHODS)}")
    default = [name for name, method in METHODS.items() if method.by_default]
    wanted = set(names or default) | {REFERENCE, STOCK, SPECULATIVE, *BASELINES}
    for name, reason in not_run(context, names).items():
        log.warning("eval.methods names %s, not run: %s", name, reason)
    return {
        name: method.make(context) for name, method in METHODS.items() if name in wanted and method.applies(context)
    }
