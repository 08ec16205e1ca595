"""The public API: a frozen target model and its drafter, wrapped (not subclassed) for speculative decoding.

    model = MedusaLikeModel.from_pretrained("smollm2-135m-instruct", drafter="runs/.../drafter")
    ids = model.chat_ids([{"role": "user", "content": "Hi!"}])
    out = model.generate(ids, max_new_tokens=128, tree="dynamic")
    print(model.tokenizer.decode(out.new_tokens), out.stats.tau)
    outs = model.generate([ids, other_ids], max_new_tokens=128)     # a batch: one output per prompt, each its own

How the target computes on this machine (its compiled step, its layers, the cost model that sizes a lookup or
combined drafter's trees) is `model.forward`'s (`forward.PreparedTarget`), set by `compile=` and a machine profile
(`profile=`, the tree search's `profile.json`); a tree argument only says which tree to draft.

The drafter is any kind of `drafters/registry.py`: Medusa heads, the EAGLE-3-style draft model, lookup, or a learned
drafter and lookup combined in one tree. Without one, training-free lookup drafting (context and output store) is
used. Every drafter is lossless; a good one is only faster; each row of a batch gets the output it gets alone.
"""

import threading
from contextlib import contextmanager
from pathlib import Path

import torch

from medusa_like.decoding.batch import PREFILL_CHUNK_SIZE, decode_batch
from medusa_like.decoding.checks import (
    batch_prompts,
    check_batch,
    check_inputs,
    check_integer,
    is_batch,
    prompt_tensor,
    row_seeds,
    sampling_generator,
    token_ids,
)
from medusa_like.decoding.generate import GenerateOutput, PlainProposer, StopChecker, decode
from medusa_like.decoding.tree import TreeSpec, is_plain
from medusa_like.decoding.tree_files import resolve_tree
from medusa_like.drafters.protocol import Drafter, Proposer
from medusa_like.formats import resolve_drafter
from medusa_like.forward import MachineProfile, PreparedTarget, prepare_target
from medusa_like.forward.profile import as_profile
from medusa_like.targets import DEFAULT_TARGET, chat_input_ids, eos_token_ids, freeze, load_target, target_dtype

DEFAULT_DRAFTER = "lookup"  # without a trained drafter: lookup drafting from the context and earlier outputs


class MedusaLikeModel:
    def __init__(
        self,
        target,
        tokenizer,
        drafter: Drafter,
        backend: str = "auto",
        target_name: str | None = None,
        tuned_layers: bool | None = None,
        drafter_dtype: torch.dtype | str | None = "auto",
        compile: bool | str | None = None,
        profile: MachineProfile | str | Path | None = None,
    ):
        """Wrap `target` (frozen: eval mode, no gradients) and `drafter` for speculative decoding. `target` may be a
        model or a `forward.PreparedTarget` (another `MedusaLikeModel`'s `.forward`: the same step, kernels and
        compiled code, shared).

        How the target computes on this machine is `medusa_like.forward`'s (`prepare_target`): `compile` (False,
        True or "auto"; None: as `profile` says, else False) runs a compiled step where this platform supports one,
        and the drafter's own step (an EAGLE-3 level, Medusa heads) compiled beside it (minutes of compiling on first
        use, logged, then loaded from disk by later processes; eager otherwise, with a log line saying why);
        `tuned_layers` (None: where this CPU has a kernel for the dtype, forward/cpu/few_row_linear.py) computes an eager
        step's linear layers on this project's CPU kernels.
        That changes the model you pass: its `nn.Linear` layers, and the drafter's, are replaced in place by layers
        that share their parameters (same state dict, no copy) and differ from `nn.Linear` only in rounding; the log
        says so. Pass False to keep them.

        `profile`: a machine profile (`forward.profile`, the tree search's `profile.json`, or its path: read once)
        measured here for this target: its compile choice is taken and a lookup or combined drafter sizes its trees by its
        cost model; one measured for other weights, dtype, device, machine or step is refused with the differences
        named (`forward.ProfileMismatchError`). Without one, such a drafter measures a quick cost model on first use
        (logged, cached).

        `drafter_dtype`: what a learned drafter computes in (`PreparedTarget.drafting_dtype`; "auto": bf16 where that
        is cheaper and the drafter allows it, else the target's dtype). The drafter you pass is cast in place."""
        profile = as_profile(profile)
        self.forward: PreparedTarget = (
            target if isinstance(target, PreparedTarget) else prepare_target(freeze(target), backend, tuned_layers)
        )
        if profile is not None:
            self.forward.use_profile(profile, compile)
        else:
            self.forward.use_compiled(False if compile is None else compile)
        self.target = self.forward.target
        drafter.check_fits(self.target)
        self.drafter = self.forward.adopt(drafter, drafter_dtype)
        self.tokenizer = tokenizer
        self.target_name = target_name or getattr(self.target.config, "name_or_path", None)
        self._lock, self._generating = threading.Lock(), None  # `generate` serves one thread at a time

    @classmethod
    def from_pretrained(
        cls,
        target=DEFAULT_TARGET,
        drafter: str | Path | Drafter | None = DEFAULT_DRAFTER,
        tokenizer=None,
        backend: str = "auto",
        dtype: torch.dtype | str | None = None,
        device: torch.device | str | None = None,
        tuned_layers: bool | None = None,
        drafter_dtype: torch.dtype | str | None = "auto",
        compile: bool | str | None = None,
        profile: MachineProfile | str | Path | None = None,
        **drafter_options,
    ) -> "MedusaLikeModel":
        """`target`: a hub id, a local directory, the default's name, or a loaded model (then pass `tokenizer`). A
        model you pass is changed in place: its `nn.Linear` layers become this CPU's tuned layers sharing their
        parameters, unless `tuned_layers=False`, and a learned drafter is cast to `drafter_dtype`. `compile=True`
        compiles the target's step (and the drafter's) on first use; `profile=` is this machine's profile of the
        target (the tree search's `profile.json`); see `__init__`.

        `drafter`: a drafter directory (native Medusa heads or EAGLE-3 drafter, the Medusa, vLLM, TGI or EAGLE-3
        serving layouts), a training checkpoint, a drafter object, or the name of a drafter kind for a fresh one built
        with `drafter_options`: "lookup" (the default: training-free context and output-store lookup), "medusa"
        (zero-initialised heads: `num_heads=`, `num_layers=`, `shared_lm_head=`), "eagle3" (random weights).
        """
        if isinstance(target, (str, Path)):
            target_name = str(target)
            target, tokenizer = load_target(target_name, dtype=dtype, device=device)
        else:
            _check_as_loaded(target, dtype, device)
            target_name = getattr(target.config, "name_or_path", None)
        if drafter is None:
            drafter = DEFAULT_DRAFTER
        drafter = resolve_drafter(drafter, target, **drafter_options)
        return cls(
            target,
            tokenizer,
            drafter,
            backend=backend,
            target_name=target_name,
            tuned_layers=tuned_layers,
            drafter_dtype=drafter_dtype,
            compile=compile,
            profile=profile,
        )

    @property
    def device(self) -> torch.device:
        return self.target.device

    @property
    def backend(self) -> str:
        """The eager step's attention backend (`decoding/attention.py`)."""
        return self.forward.backend

    @property
    def drafter_kind(self) -> str:
        return self.drafter.kind

    @property
    def drafter_dtype(self) -> torch.dtype | None:
        """What the learned drafter computes in (None: lookup alone, no weights)."""
        weight = next((p for m in self.drafter.modules() for p in m.parameters(recurse=False)), None)
        return None if weight is None else weight.dtype

    @property
    def max_depth(self) -> int | None:
        """The deepest static tree the drafter can fill (Medusa: its number of heads; others: unbounded)."""
        return self.drafter.max_depth

    def proposer(self) -> Proposer:
        """A fresh proposer for one generation (see `drafters/protocol.py`)."""
        return self.drafter.proposer(self.target)

    def chat_ids(self, messages: list[dict]) -> torch.Tensor:
        """Prompt ids [1, T] under the target's own chat template."""
        if self.tokenizer is None:
            raise ValueError("chat_ids needs the target's tokenizer: pass tokenizer= with a loaded model")
        return chat_input_ids(self.tokenizer, messages).to(self.device)

    def eos_token_ids(self) -> list[int]:
        return eos_token_ids(self.target, self.tokenizer)

    def resolve_tree(self, tree) -> TreeSpec:
        """The tree spec generation uses for `tree` (a preset name, a tree file, rank paths, a dict or a spec), as
        this drafter decodes with it (a lookup or combined drafter merges its sources into a budgeted tree; plain
        decoding, `"none"`, stays plain whatever the drafter). A tree file is read as a tree, nothing else."""
        return self._as_drafted(resolve_tree(tree, self.max_depth))

    def _as_drafted(self, spec: TreeSpec) -> TreeSpec:
        """`spec` as this drafter decodes with it; plain decoding stays plain, whatever the drafter."""
        return spec if is_plain(spec) else self.drafter.adapt_tree(spec)

    def generate(
        self,
        input_ids: torch.Tensor | list,
        max_new_tokens: int = 256,
        tree="dynamic",
        temperature: float = 0.0,
        top_k: int = 0,
        top_p: float = 1.0,
        seed: int | list[int] | None = None,
        eos_token_id: int | list[int] | None = None,
        stop_strings: str | list[str] | None = None,
        streamer=None,
        max_cache_len: int | None = None,
        remember: bool = True,
        prefill_chunk_size: int = PREFILL_CHUNK_SIZE,
        batch_size: int | None = None,
    ) -> GenerateOutput | list[GenerateOutput]:
        """Speculative decoding, lossless: at temperature 0 the output equals the target's own greedy decoding token
        for token; above it, tokens are drawn from exactly the target's (temperature, top_k, top_p) distribution.

        `input_ids`: the prompt, [1, T] or [T], a tensor or a list of ints; or a batch, a list of prompts (each a
        tensor [T] or [1, T] or a list of ints, of any lengths), decoded at once: one `GenerateOutput` per prompt, in
        order, each with its own stats and finish reason, each the one that prompt gets alone (decoding/batch.py).
        `batch_size`: at most this many of a batch's prompts decode at once (None: all); the others wait, in order,
        and take the place of a row that finished (continuous batching: a KV cache of `batch_size` rows).
        `tree`: a preset ('dynamic' for EAGLE-2's dynamic tree, 'chain', 'small', 'medusa', 'none' for plain
        decoding), a `DynamicTreeSpec` or a dict of its fields, a list of rank paths, a tree file (JSON from the tree
        search) or a spec. `eos_token_id`: an id or a list of ids (None: the target's). `stop_strings`: a string or a
        list of strings; generation stops once one appears in the output. `streamer`: a callable taking each step's
        new token ids, or a transformers streamer (given the prompt first, as transformers' `generate` gives it); one
        prompt only.

        `seed` (temperature > 0): the same prompt, settings and seed give the same tokens on the same device and
        dtype, whatever the drafter, the tree, the output store's contents or the machine's timings, and the same as
        plain decoding (`tree="none"`) with that seed: each position's token is drawn with that position's own noise
        (`decoding/sampling.py`), so drafts decide how many tokens a step commits, never which. The match is as
        exact as greedy decoding's. Without a seed, torch's default generator draws. A batch takes one seed for
        every row or a list of one per prompt: each row then draws as that prompt alone with its seed.

        `remember`: hand the finished output to the drafter (a lookup store learns from it; an evaluation that runs
        several methods on one prompt passes False and adds the answer once every method is done, so none sees it).
        Seeded calls are remembered too: a store only changes how fast a later call runs. A batch's outputs are
        remembered once each, in order, after the whole batch (no row drafts from another row's answer).

        `max_cache_len`: tokens of KV cache per row; a batch whose longest prompt, new tokens and tree do not fit it
        (or the target's positions) is refused before any work, saying what fits. `prefill_chunk_size`: prompt
        tokens a batch's prefill forward reads, over all its rows (longer prompts are read in several forwards).

        Calls from several threads are served one at a time (the target, its attention and the drafter's state serve
        one generation); a call from inside a generation on the same model (its streamer) is refused. Arguments are
        checked before any work: a bad one raises a TypeError or ValueError naming it.
        """
        batch = is_batch(input_ids)
        prompts = batch_prompts(input_ids) if batch else [prompt_tensor(input_ids)]
        generators = [sampling_generator(s, self.device) for s in row_seeds(seed, len(prompts), batch)]
        if not isinstance(remember, bool):
            raise TypeError(f"remember must be True or False, got {remember!r}")
        if batch and streamer is not None:
            raise ValueError("a streamer follows one sequence: decode a batch without one (or its prompts one by one)")
        check_integer("prefill_chunk_size", prefill_chunk_size, 1)
        check_integer("batch_size", batch_size, 1, optional=True)
        vocab = self.target.config.get_text_config().vocab_size
        eos = self.eos_token_ids() if eos_token_id is None else token_ids("eos_token_id", eos_token_id, vocab)
        stop = StopChecker(eos, () if stop_strings is None else stop_strings, self.tokenizer)
        with self._one_generation():
            spec = self._as_drafted(resolve_tree(tree, self.max_depth))
            plain = is_plain(spec)  # tree="none": the target alone, nothing drafted, whatever the drafter
            proposers = [PlainProposer() if plain else self.proposer() for _ in prompts]
            sampling = dict(temperature=temperature, top_k=top_k, top_p=top_p)
            if batch:
                capacity = check_batch(self.target, proposers, prompts, spec, max_new_tokens, max_cache_len, **sampling)
            else:
                capacity = check_inputs(
                    self.target, proposers[0], prompts[0], spec, max_new_tokens, max_cache_len, **sampling
                )
            self.forward.settle(self.drafter)  # a drafter sized by a cost model gets this machine's
            prompts = [p.to(self.device) for p in prompts]
            if batch:
                outs = decode_batch(
                    self.forward.step,
                    proposers,
                    prompts,
                    spec,
                    max_new_tokens,
                    capacity,
                    [stop] * len(prompts),
                    generators=generators,
                    prefill_chunk_size=prefill_chunk_size,
                    batch_size=batch_size,
                    **sampling,
                )
            else:
                outs = [
                    decode(
                        self.forward.step,
                        proposers[0],
                        prompts[0],
                        spec,
                        max_new_tokens,
                        capacity,
                        stop=stop,
                        streamer=streamer,
                        generator=generators[0],
                        **sampling,
                    )
                ]
            if remember:
                for out in outs:
                    self.drafter.remember(out.new_tokens.tolist())
        return outs if batch else outs[0]

    @contextmanager
    def _one_generation(self):
        """Hold the model for one generation: other threads wait; the same thread (a streamer) is refused, since it
        would wait for itself."""
        if self._generating == threading.get_ident():
            raise RuntimeError(
                "generate was called from inside a generation on the same model (from its streamer?); it would wait "
                "for itself: call it after this generation returns"
            )
        with self._lock:
            self._generating = threading.get_ident()
            try:
                yield
            finally:
                self._generating = None


def _check_as_loaded(target, dtype, device) -> None:
    """A loaded model is used as it is: `dtype=` or `device=` asking for another one is refused, not ignored."""
    if not isinstance(target, torch.nn.Module):
        raise TypeError(f"target: expected a hub id, a directory, the default's name or a loaded model, got {target!r}")
    asked = target_dtype(dtype)
    if asked not in (None, "auto") and asked != target.dtype:
        raise ValueError(
            f"dtype={dtype!r} for a model already loaded in {target.dtype}: a loaded model is used as it is; cast it "
            "first (model.to(dtype)) or pass its name or directory"
        )
    if device is not None and not _same_device(torch.device(device), target.device):
        raise ValueError(
            f"device={str(device)!r} for a model already on {target.device}: a loaded model is used as it is; move it "
            "first (model.to(device)) or pass its name or directory"
        )


def _same_device(asked: torch.device, actual: torch.device) -> bool:
    return asked.type == actual.type and (asked.index is None or asked.index == (actual.index or 0))
