"""The public API: a frozen target model and its drafter, wrapped (not subclassed) for speculative decoding.

    model = MedusaLikeModel.from_pretrained("smollm2-135m-instruct", drafter="runs/.../drafter")
    ids = model.chat_ids([{"role": "user", "content": "Hi!"}])
    out = model.generate(ids, max_new_tokens=128, tree="dynamic")
    print(model.tokenizer.decode(out.new_tokens), out.stats.tau)

The drafter is Medusa heads or the EAGLE-3-style draft model; without one, zero-initialised Medusa heads are used:
decoding is still lossless, only slower.
"""

from pathlib import Path

import torch

from medusa_like.decoding.attention import pick_backend
from medusa_like.decoding.generate import GenerateOutput, StopChecker, speculative_generate
from medusa_like.decoding.tree import resolve_tree
from medusa_like.drafters.base import check_fits, drafter_dims
from medusa_like.drafters.eagle3 import Eagle3Drafter, Eagle3Proposer
from medusa_like.drafters.medusa import HeadsConfig, MedusaHeads, MedusaProposer
from medusa_like.drafters.vocab import DraftVocab
from medusa_like.formats import load_drafter
from medusa_like.targets import DEFAULT_TARGET, chat_input_ids, eos_token_ids, freeze, load_target


class MedusaLikeModel:
    def __init__(
        self,
        target,
        tokenizer,
        drafter: MedusaHeads | Eagle3Drafter,
        backend: str = "auto",
        target_name: str | None = None,
        draft_vocab: DraftVocab | None = None,
    ):
        check_fits(*drafter_dims(drafter), target)
        if draft_vocab is not None and not isinstance(drafter, MedusaHeads):
            raise ValueError("draft_vocab restricts Medusa heads; an EAGLE-3 drafter carries its own vocabulary")
        self.target = freeze(target)
        self.tokenizer = tokenizer
        self.drafter = drafter.to(device=self.device, dtype=self.target.dtype).eval()
        self.draft_vocab = draft_vocab
        self.backend = pick_backend(backend, self.device)
        self.target_name = target_name or getattr(target.config, "name_or_path", None)

    @classmethod
    def from_pretrained(
        cls,
        target=DEFAULT_TARGET,
        drafter: str | Path | MedusaHeads | Eagle3Drafter | None = None,
        tokenizer=None,
        num_heads: int = 4,
        num_layers: int = 1,
        shared_lm_head: bool = True,
        backend: str = "auto",
        dtype: torch.dtype | str | None = None,
        device: torch.device | str | None = None,
        draft_vocab: DraftVocab | None = None,
    ) -> "MedusaLikeModel":
        """`target`: a hub id, a local directory, the default's name, or a loaded model (then pass `tokenizer`).

        `drafter`: a drafter directory (native Medusa heads or EAGLE-3 drafter, the Medusa, vLLM, TGI or EAGLE-3
        serving layouts), a training checkpoint, a `MedusaHeads` or `Eagle3Drafter`, or None for fresh
        zero-initialised heads of `num_heads` x `num_layers`.
        """
        if isinstance(target, (str, Path)):
            target_name = str(target)
            target, tokenizer = load_target(target_name, dtype=dtype, device=device)
        else:
            target_name = getattr(target.config, "name_or_path", None)
        if drafter is None:
            config = target.config.get_text_config()
            drafter = MedusaHeads(
                HeadsConfig(config.hidden_size, config.vocab_size, num_heads, num_layers, shared_lm_head),
                target.get_output_embeddings().weight,
            )
        elif isinstance(drafter, (str, Path)):
            drafter = load_drafter(drafter, target)
        return cls(target, tokenizer, drafter, backend=backend, target_name=target_name, draft_vocab=draft_vocab)

    @property
    def device(self) -> torch.device:
        return self.target.device

    @property
    def drafter_kind(self) -> str:
        return "medusa" if isinstance(self.drafter, MedusaHeads) else "eagle3"

    @property
    def max_depth(self) -> int | None:
        """The deepest static tree the drafter can fill (Medusa: its number of heads; EAGLE-3: unbounded)."""
        return self.drafter.num_heads if isinstance(self.drafter, MedusaHeads) else None

    def proposer(self):
        """A fresh proposer for one generation (see `drafters/protocol.py`)."""
        if isinstance(self.drafter, MedusaHeads):
            return MedusaProposer(self.drafter, self.target, self.draft_vocab)
        return Eagle3Proposer(self.drafter, self.target)

    def chat_ids(self, messages: list[dict]) -> torch.Tensor:
        """Prompt ids [1, T] under the target's own chat template."""
        return chat_input_ids(self.tokenizer, messages).to(self.device)

    def eos_token_ids(self) -> list[int]:
        return eos_token_ids(self.target, self.tokenizer)

    def resolve_tree(self, tree):
        """A static `TokenTree` or a `DynamicTreeSpec` from a preset name, a tree file, rank paths or a spec."""
        return resolve_tree(tree, self.max_depth)

    def generate(
        self,
        input_ids: torch.Tensor,
        max_new_tokens: int = 256,
        tree="dynamic",
        temperature: float = 0.0,
        top_k: int = 0,
        top_p: float = 1.0,
        seed: int | None = None,
        eos_token_id: int | list[int] | None = None,
        stop_strings: list[str] | None = None,
        streamer=None,
        max_cache_len: int | None = None,
    ) -> GenerateOutput:
        """Speculative decoding, lossless: at temperature 0 the output equals the target's own greedy decoding token
        for token; above it, tokens are drawn from exactly the target's (temperature, top_k, top_p) distribution.

        `tree`: a preset ('dynamic' for EAGLE-2's dynamic tree, 'chain', 'small', 'medusa', 'none' for plain
        decoding), a `DynamicTreeSpec` or a dict of its fields, a list of rank paths, a tree file (JSON from the tree
        search) or a `TokenTree`. `streamer`: a callable taking each step's new token ids, or a transformers streamer.
        """
        if temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {temperature}")
        generator = None
        if temperature > 0 and seed is not None:
            generator = torch.Generator(self.device).manual_seed(seed)
        if input_ids.dim() == 1:
            input_ids = input_ids[None]
        eos = (
            self.eos_token_ids()
            if eos_token_id is None
            else [eos_token_id]
            if isinstance(eos_token_id, int)
            else eos_token_id
        )
        stop = StopChecker(eos, stop_strings or (), self.tokenizer)
        return speculative_generate(
            self.target,
            self.proposer(),
            input_ids.to(self.device),
            self.resolve_tree(tree),
            max_new_tokens,
            backend=self.backend,
            stop=stop,
            streamer=streamer,
            max_cache_len=max_cache_len,
            temperature=temperature,
            top_k=top_k,
            top_p=top_p,
            generator=generator,
        )
