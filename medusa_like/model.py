"""The public API: a frozen target model and its draft heads, wrapped (not subclassed) for speculative decoding.

    model = MedusaLikeModel.from_pretrained("smollm2-135m-instruct", heads="runs/.../heads")
    ids = model.chat_ids([{"role": "user", "content": "Hi!"}])
    out = model.generate(ids, max_new_tokens=128, tree="small")
    print(model.tokenizer.decode(out.new_tokens), out.stats.tau)

Without trained heads the heads are zero-initialised: decoding is still lossless, only slower.
"""

from pathlib import Path

import torch

from .attention import pick_backend
from .generate import GenerateOutput, StopChecker, speculative_generate
from .heads import HeadsConfig, MedusaHeads
from .targets import DEFAULT_TARGET, chat_input_ids, freeze, load_target
from .tree import TokenTree, resolve_tree


class MedusaLikeModel:
    def __init__(self, target, tokenizer, heads: MedusaHeads, backend: str = "auto", target_name: str | None = None):
        config = target.config.get_text_config()
        if heads.config.hidden_size != config.hidden_size or heads.config.vocab_size != config.vocab_size:
            raise ValueError(
                f"heads (hidden {heads.config.hidden_size}, vocab {heads.config.vocab_size}) do not fit the target "
                f"(hidden {config.hidden_size}, vocab {config.vocab_size})"
            )
        self.target = freeze(target)
        self.tokenizer = tokenizer
        self.heads = heads.to(device=self.device, dtype=self.target.dtype).eval()
        self.backend = pick_backend(backend, self.device)
        self.target_name = target_name or getattr(target.config, "name_or_path", None)

    @classmethod
    def from_pretrained(
        cls,
        target=DEFAULT_TARGET,
        heads: str | Path | MedusaHeads | None = None,
        tokenizer=None,
        num_heads: int = 4,
        num_layers: int = 1,
        shared_lm_head: bool = True,
        backend: str = "auto",
        dtype: torch.dtype | str | None = None,
        device: torch.device | str | None = None,
    ) -> "MedusaLikeModel":
        """`target`: a hub id, a local directory, the default's name, or a loaded model (then pass `tokenizer`).

        `heads`: a heads directory (native, Medusa, vLLM or TGI layout), a `MedusaHeads`, or None for fresh
        zero-initialised heads of `num_heads` x `num_layers`.
        """
        if isinstance(target, (str, Path)):
            target_name = str(target)
            target, tokenizer = load_target(target_name, dtype=dtype, device=device)
        else:
            target_name = getattr(target.config, "name_or_path", None)
        if heads is None:
            config = target.config.get_text_config()
            heads = MedusaHeads(
                HeadsConfig(config.hidden_size, config.vocab_size, num_heads, num_layers, shared_lm_head),
                target.get_output_embeddings().weight,
            )
        elif isinstance(heads, (str, Path)):
            from .export import load_heads

            heads = load_heads(heads, target)
        return cls(target, tokenizer, heads, backend=backend, target_name=target_name)

    @property
    def device(self) -> torch.device:
        return self.target.device

    def chat_ids(self, messages: list[dict]) -> torch.Tensor:
        """Prompt ids [1, T] under the target's own chat template."""
        return chat_input_ids(self.tokenizer, messages).to(self.device)

    def eos_token_ids(self) -> list[int]:
        eos = self.target.generation_config.eos_token_id
        if eos is None and self.tokenizer is not None:
            eos = self.tokenizer.eos_token_id
        if eos is None:
            return []
        return [eos] if isinstance(eos, int) else list(eos)

    def generate(
        self,
        input_ids: torch.Tensor,
        max_new_tokens: int = 256,
        tree: str | list | TokenTree | None = "small",
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

        `tree`: a preset ('chain', 'small', 'medusa', 'none' for plain decoding), a list of rank paths, a tree file
        (JSON from the tree search) or a `TokenTree`. `streamer`: a callable taking each step's new token ids, or a
        transformers streamer.
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
            self.heads,
            input_ids.to(self.device),
            resolve_tree(tree, self.heads.num_heads),
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
