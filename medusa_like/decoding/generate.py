"""The speculative decoding loop: prefill, propose, verify a whole tree in one target forward, accept, commit.

One step, for whatever drafter stands behind the `Proposer` protocol (`drafters/protocol.py`):

    propose     the drafter's candidate tree for this step, rooted at the target's own next token   DraftTree [T]
    verify      one target forward over all T nodes, tree mask, depth positions               -> logits [T, V]
    accept      the longest root-to-leaf path whose every token equals the target's token at its
                parent: its argmax, or when sampling the token its distribution picks with the
                position's noise (`sampling.py`); the target's token after its last node is the bonus
    commit      accepted nodes' KV move to contiguous cache slots; the drafter takes in the accepted
                tokens and the target's features at them (no extra forward)

A sequence's own state (its tokens, stop rule, stats and sampling noise) is a `Row`, the same in the batched loop
(`batch.py`), which runs these steps for many sequences at once.

At temperature 0 the output is the target's own greedy output, token for token: every committed token is the
target's argmax given the committed prefix, whatever the drafter proposed. tau = generated tokens / target forwards,
the prefill included, so plain decoding has tau = 1 exactly and the bonus token counts (as in Medusa, EAGLE and
Spec-Bench).
"""

import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from .checks import check_inputs
from .draft_tree import DraftTree
from .sampling import PositionNoise, race, warp_logits
from .step import EagerStep, TargetStep


@dataclass
class DecodeStats:
    new_tokens: int = 0
    target_forwards: int = 0  # prefill included
    accepted_draft: list[int] = field(default_factory=list)  # draft tokens accepted per tree step (bonus excluded)
    accepted_by_source: dict[str, int] = field(default_factory=dict)  # accepted draft tokens each source proposed
    prefill_seconds: float = 0.0
    decode_seconds: float = 0.0
    draft_seconds: float = 0.0  # of decode_seconds: the drafter proposing trees
    verify_seconds: float = 0.0  # of decode_seconds: target forwards, acceptance and commits

    @property
    def tau(self) -> float:
        """Generated tokens per target forward (the bonus token counts)."""
        return self.new_tokens / max(self.target_forwards, 1)

    @property
    def mean_accepted_draft(self) -> float:
        return sum(self.accepted_draft) / max(len(self.accepted_draft), 1)

    @property
    def tokens_per_second(self) -> float:
        return self.new_tokens / max(self.prefill_seconds + self.decode_seconds, 1e-9)

    def as_dict(self) -> dict:
        return {
            "new_tokens": self.new_tokens,
            "target_forwards": self.target_forwards,
            "tau": self.tau,
            "mean_accepted_draft": self.mean_accepted_draft,
            "accepted_draft": list(self.accepted_draft),
            "accepted_by_source": dict(self.accepted_by_source),
            "prefill_seconds": self.prefill_seconds,
            "decode_seconds": self.decode_seconds,
            "draft_seconds": self.draft_seconds,
            "verify_seconds": self.verify_seconds,
            "tokens_per_second": self.tokens_per_second,
        }


@dataclass
class GenerateOutput:
    sequences: torch.Tensor  # [1, prompt + new]
    new_tokens: torch.Tensor  # [new]
    stats: DecodeStats
    finish_reason: str  # "eos", "stop_string" or "length"


# ---------------------------------------------------------------------------------------------------------------------
# The tensor functions of a step


def accept_greedy(tokens: torch.Tensor, predictions: torch.Tensor, tree) -> torch.Tensor:
    """The accepted nodes, root first [n + 1]: the longest path whose tokens equal the target's argmax at the parent.

    tokens, predictions [T]: node tokens and the target's argmax after each node.
    """
    valid = tree.retrieve >= 0  # [P, D+1]
    paths = tree.retrieve.clamp(min=0)
    match = (tokens[paths[:, 1:]] == predictions[paths[:, :-1]]) & valid[:, 1:]  # [P, D]
    accepted = match.long().cumprod(dim=1).sum(dim=1)  # [P]
    best = accepted.argmax()
    return paths[best, : int(accepted[best]) + 1]


def count_sources(counts: dict[str, int], draft: DraftTree, accepted: torch.Tensor) -> None:
    """Add the accepted draft nodes to the count of every source that proposed them (a tree may not say)."""
    if draft.sources is None or accepted.numel() == 0:
        return
    masks = draft.sources[accepted.cpu()]  # [a]
    for bit, name in enumerate(draft.source_names):
        counts[name] = counts.get(name, 0) + int(((masks >> bit) & 1).sum())


# ---------------------------------------------------------------------------------------------------------------------
# The loop


class PlainProposer:
    """The `Proposer` of plain decoding (a tree of the root alone: `tree="none"`), whatever drafter the model holds:
    it drafts nothing and reads no features, so each step is one target forward over one node and tau is 1."""

    feature_layers = None
    max_depth = None
    max_rank = None

    def begin(self, prompt_ids: torch.Tensor, features: torch.Tensor, root: torch.Tensor, capacity: int) -> None:
        self.root = root

    def propose(self, spec) -> DraftTree:
        return spec.grow(self.root, None)

    def accept(self, tokens: torch.Tensor, features: torch.Tensor, bonus: torch.Tensor) -> None:
        self.root = bonus


class StopChecker:
    """EOS ids and stop strings; `cut(tokens)` returns where to cut the generated tokens, or None to go on.

    `stop_strings`: one string or a list of them (as transformers takes them), none empty."""

    def __init__(self, eos_token_ids=(), stop_strings=(), tokenizer=None):
        self.eos = set(int(t) for t in eos_token_ids)
        if isinstance(stop_strings, str):
            stop_strings = [stop_strings]
        if not isinstance(stop_strings, (list, tuple)) or not all(isinstance(s, str) for s in stop_strings):
            raise TypeError(f"stop_strings must be a string or a list of strings, got {stop_strings!r}")
        if "" in stop_strings:  # ignoring it would be a guess, and so would stopping before the first token
            raise ValueError(
                f"stop_strings {stop_strings!r} holds an empty string, which any text contains: it would stop "
                "generation at once; give non-empty strings (none: None or [])"
            )
        self.stop_strings = list(stop_strings)
        if self.stop_strings and tokenizer is None:
            raise ValueError("stop_strings need a tokenizer to decode the generated text")
        self.tokenizer = tokenizer
        self.window = max((len(s) for s in self.stop_strings), default=0) + 2  # a token is at least one character

    def cut(self, generated: list[int], first_new: int) -> tuple[int, str] | None:
        for i in range(first_new, len(generated)):
            if generated[i] in self.eos:
                return i + 1, "eos"
            if self.stop_strings:
                text = self.tokenizer.decode(generated[max(0, i + 1 - self.window) : i + 1])
                if any(s in text for s in self.stop_strings):
                    return i + 1, "stop_string"
        return None


def _emit(streamer, tokens: list[int]) -> None:
    if streamer is None or not tokens:
        return
    if hasattr(streamer, "put"):  # a transformers streamer
        streamer.put(torch.tensor(tokens))
    else:
        streamer(tokens)


def target_tokens(
    logits, noise: PositionNoise | None, first: int, depth, max_depth: int, temperature: float, top_k: int, top_p: float
) -> torch.Tensor:
    """The target's token after each node [T] from its logits [T, V]: its argmax, or its pick by the exponential race
    with the noise of its position (the node's `depth` past `first`, counted from the first generated token)."""
    if noise is None:
        return logits.argmax(-1)
    probs = warp_logits(logits, temperature, top_k, top_p)
    return race(probs, noise.take(first, max_depth + 1)[depth])


def vocab_size(step: TargetStep) -> int:
    """The width of the target's logits (its output layer's rows): what the sampling noise covers."""
    return step.target.get_output_embeddings().weight.shape[0]


class Row:
    """One sequence's state, in the single-row loop and in the batched one alike: its generated tokens, stop rule,
    stats and sampling noise (each row its own, so that a row decodes as it would alone)."""

    def __init__(
        self,
        prompt: torch.Tensor,
        max_new_tokens: int,
        stop: StopChecker | None,
        sampling: tuple[float, int, float],
        noise: PositionNoise | None,
        streamer: Callable | None = None,
    ):
        """`prompt` [P]; `sampling`: (temperature, top_k, top_p); `noise`: the row's own (None at temperature 0)."""
        self.prompt, self.max_new_tokens, self.stop = prompt, max_new_tokens, stop or StopChecker()
        self.temperature, self.top_k, self.top_p = sampling
        self.noise, self.streamer, self.stats = noise, streamer, DecodeStats()
        self.generated: list[int] = []
        self.finish: tuple[int, str] | None = None

    @property
    def done(self) -> bool:
        return self.finish is not None or len(self.generated) >= self.max_new_tokens

    def pick(self, logits: torch.Tensor, depth: torch.Tensor, max_depth: int) -> torch.Tensor:
        """The target's token after each node of this row's forward [T] (logits [T, V], node depths [T]): the
        positions counted from the next token to generate."""
        return target_tokens(
            logits, self.noise, len(self.generated), depth, max_depth, self.temperature, self.top_k, self.top_p
        )

    def start(self, root: torch.Tensor) -> None:
        """The prefill's token: the first generated one."""
        self.stats.target_forwards = 1
        self.extend([int(root)])

    def record(self, draft: DraftTree, nodes: torch.Tensor, root: torch.Tensor) -> None:
        """A tree step's outcome: the accepted nodes [n + 1] of `draft` (root first) and the bonus token `root`."""
        self.stats.target_forwards += 1
        self.stats.accepted_draft.append(nodes.numel() - 1)
        count_sources(self.stats.accepted_by_source, draft, nodes[1:])
        self.extend(draft.tokens[nodes[1:]].tolist() + [int(root)])

    def extend(self, new: list[int]) -> None:
        """Add new tokens, cut at max_new_tokens and at the first stop; stream what is kept."""
        first_new = len(self.generated)
        self.generated.extend(new)
        del self.generated[self.max_new_tokens :]
        self.finish = self.stop.cut(self.generated, first_new)
        if self.finish is not None:
            del self.generated[self.finish[0] :]
        _emit(self.streamer, self.generated[first_new:])

    def output(self) -> GenerateOutput:
        reason = self.finish[1] if self.finish is not None else "length"
        new_tokens = torch.tensor(self.generated, dtype=torch.long, device=self.prompt.device)
        self.stats.new_tokens = len(self.generated)
        return GenerateOutput(torch.cat([self.prompt, new_tokens])[None], new_tokens, self.stats, reason)


@torch.inference_mode()
def speculative_generate(
    target,
    proposer,
    input_ids: torch.Tensor,
    tree,
    max_new_tokens: int,
    backend: str = "sdpa",
    stop: StopChecker | None = None,
    streamer: Callable | None = None,
    max_cache_len: int | None = None,
    temperature: float = 0.0,
    top_k: int = 0,
    top_p: float = 1.0,
    generator: torch.Generator | None = None,
) -> GenerateOutput:
    """Tree speculative decoding of one sequence, lossless: at temperature 0 the output is the target's greedy output
    token for token; above it, every token is drawn from the target's own (temperature, top-k, top-p) distribution.

    `target` is a model (its forward then runs eagerly with attention `backend`) or a `TargetStep` (`step.py`: what
    `medusa_like.forward` prepares for this machine). `proposer` follows `medusa_like.drafters.protocol.Proposer`
    (Medusa heads, the EAGLE-3 drafter, lookup, their combination, an oracle in tests); `tree` is any `TreeSpec`
    (`decoding/tree.py`). Verification and acceptance are the same for every drafter and tree, so the output is too.
    Arguments are checked first (`checks.py`); `MedusaLikeModel.generate` checks the rest of its own before this.
    """
    step = target if isinstance(target, TargetStep) else EagerStep(target, backend)
    capacity = check_inputs(step.target, proposer, input_ids, tree, max_new_tokens, max_cache_len, temperature,
                            top_k, top_p)  # fmt: skip
    return decode(step, proposer, input_ids, tree, max_new_tokens, capacity, stop, streamer, temperature, top_k, top_p,
                  generator)  # fmt: skip


@torch.inference_mode()
def decode(
    step: TargetStep,
    proposer,
    input_ids: torch.Tensor,
    tree,
    max_new_tokens: int,
    capacity: int,
    stop: StopChecker | None = None,
    streamer: Callable | None = None,
    temperature: float = 0.0,
    top_k: int = 0,
    top_p: float = 1.0,
    generator: torch.Generator | None = None,
) -> GenerateOutput:
    """The loop of `speculative_generate`, on arguments `checks.check_inputs` accepted (`capacity`: its answer)."""
    device = input_ids.device
    prompt_len = input_ids.shape[1]
    tree = tree.to(device)
    layers = proposer.feature_layers
    cache = step.new_cache(capacity)
    noise = None if temperature == 0 else PositionNoise(vocab_size(step), device, generator)
    row = Row(input_ids[0], max_new_tokens, stop, (temperature, top_k, top_p), noise, streamer)
    stats = row.stats

    if streamer is not None and hasattr(streamer, "put"):  # a transformers streamer takes the prompt first, as from
        streamer.put(input_ids.cpu())  # transformers' own generate (its `skip_prompt` drops it)
    start = time.perf_counter()
    positions = torch.arange(prompt_len, device=device)[None]
    logits, features = step.forward(input_ids, positions, None, cache, layers, last=True)  # [1, V], [P, F]
    cache.commit_all(prompt_len)
    root = row.pick(logits, torch.zeros(1, dtype=torch.long, device=device), 0)[0]
    proposer.begin(input_ids[0], features, root, capacity)
    stats.prefill_seconds = time.perf_counter() - start
    row.start(root)

    start = time.perf_counter()
    while not row.done:
        step_start = time.perf_counter()
        draft: DraftTree = proposer.propose(tree)
        stats.draft_seconds += time.perf_counter() - step_start
        step_start = time.perf_counter()
        tokens = draft.tokens  # [T]
        prefix = cache.length
        cache.check_room(draft.num_nodes)
        mask = draft.attention_mask[None, None]  # [1, 1, T, T]
        logits, features = step.forward(tokens[None], (prefix + draft.depth)[None], mask, cache, layers)  # [T, V]
        predictions = row.pick(logits, draft.depth, draft.max_depth)  # [T]
        nodes = accept_greedy(tokens, predictions, draft)  # [n + 1]
        root = predictions[nodes[-1]]
        cache.commit(prefix + nodes)
        proposer.accept(tokens[nodes], features[nodes], root)
        row.record(draft, nodes, root)
        stats.verify_seconds += time.perf_counter() - step_start
    stats.decode_seconds = time.perf_counter() - start

    if streamer is not None and hasattr(streamer, "end"):
        streamer.end()
    return row.output()
