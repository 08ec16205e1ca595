"""The EAGLE-3-style drafter: lossless decoding on every family and backend with static and dynamic trees, its tree
attention against sequential drafting, the reduced vocabulary, and the training-time-test loss."""

import warnings

import pytest
import torch

from medusa_like.decoding.generate import speculative_generate
from medusa_like.decoding.tree import DynamicTreeSpec
from medusa_like.decoding.tree_files import resolve_tree
from medusa_like.drafters.eagle3 import Eagle3Config, Eagle3Drafter
from medusa_like.drafters.eagle3_proposer import Eagle3Proposer
from medusa_like.drafters.vocab import DraftVocab, DraftVocabError, count_tokens
from medusa_like.training.ttt import unrolled_mask

from .conftest import VOCAB, random_prompts, stock_greedy, tiny_target, untouched_target

BACKENDS = ["eager", "sdpa", "flash"]
TREES = {"small": "small", "dynamic": DynamicTreeSpec(depth=4, top_k=3, num_nodes=10)}
NEW_TOKENS = 20

_references: dict = {}


def random_drafter(target, vocab: DraftVocab | None = None, seed: int = 0, norm_aux: bool = False) -> Eagle3Drafter:
    """A drafter with random weights large enough that its guesses vary (and are sometimes right)."""
    torch.manual_seed(seed)
    size = vocab.size if vocab is not None else VOCAB
    drafter = Eagle3Drafter(Eagle3Config.for_target(target.config, size, norm_aux=norm_aux), vocab)
    for p in drafter.parameters():
        torch.nn.init.normal_(p, std=0.3)
    return drafter.eval()


def references(family: str) -> tuple:
    """A new tiny target of `family` for each test (decoding swaps its layers in place), 10 prompts and transformers'
    own greedy continuations on an untouched copy (`stock_greedy`, computed once per family)."""
    if family not in _references:
        prompts = random_prompts(10, seed=5, min_len=1, max_len=30)
        continuations = stock_greedy(untouched_target(family), prompts, NEW_TOKENS)
        _references[family] = prompts, [torch.tensor(tokens) for tokens in continuations]
    prompts, expected = _references[family]
    return tiny_target(family), prompts, expected


def tree_spec(name: str):
    spec = TREES[name]
    return resolve_tree(spec, 8) if isinstance(spec, str) else spec


@pytest.mark.slow
@pytest.mark.parametrize("tree_name", sorted(TREES))
@pytest.mark.parametrize("backend", BACKENDS)
def test_eagle3_greedy_equals_target_greedy(family, backend, tree_name):
    """A random drafter (sometimes right on these repetitive tiny targets): the target's greedy output, and some
    drafts accepted, so the matrix does not exercise only the all-rejected path."""
    target, prompts, expected = references(family)
    proposer = Eagle3Proposer(random_drafter(target), target)
    accepted = 0
    for prompt, reference in zip(prompts, expected, strict=True):
        out = speculative_generate(target, proposer, prompt, tree_spec(tree_name), NEW_TOKENS, backend=backend)
        assert out.new_tokens.tolist() == reference.tolist(), f"prompt of length {prompt.shape[1]}"
        accepted += sum(out.stats.accepted_draft)
    assert accepted > 0, "no draft token was ever accepted: only the all-rejected path was tested"


def test_the_cache_is_passed_under_the_keyword_transformers_takes(family):
    """The target's and the drafter's forwards get their KV cache under the keyword the installed transformers names
    (`targets.cache_keyword`): a deprecated keyword would warn on every layer of every step (and break on removal)."""
    target, prompts, expected = references(family)
    proposer = Eagle3Proposer(random_drafter(target), target)
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=".*past_key_values.*")
        out = speculative_generate(target, proposer, prompts[0], tree_spec("dynamic"), NEW_TOKENS)
    assert out.new_tokens.tolist() == expected[0].tolist()


def test_a_drafter_initialised_from_the_target_stays_lossless():
    """A drafter initialised from the target (its projection, an identity fc on the highest aux layer) runs through
    a dynamic tree and stays lossless."""
    target, prompts, expected = references("llama")
    drafter = random_drafter(target)
    with torch.no_grad():
        for p in drafter.parameters():
            p.zero_()
        size = target.config.hidden_size
        layer = drafter.config.aux_layer_ids.index(max(drafter.config.aux_layer_ids))
        drafter.fc.weight[:, layer * size : (layer + 1) * size] = torch.eye(size)
        drafter.init_from_target(target)
    proposer = Eagle3Proposer(drafter.eval(), target)
    out = speculative_generate(target, proposer, prompts[0], tree_spec("dynamic"), NEW_TOKENS)
    assert out.new_tokens.tolist() == expected[0].tolist()


def test_tree_node_states_equal_sequential_drafting():
    """The drafter's state at every node of a dynamic tree that it expanded equals running the drafter causally over
    the committed entries followed by that node's path, one entry at a time (`assert_close`): the drafter's tree mask,
    positions and cache are exact. The proposer's `_expand` is watched (called as it is) for the nodes it drafted."""
    target = tiny_target("qwen2")
    drafter = random_drafter(target, seed=3)
    proposer = Eagle3Proposer(drafter, target)
    prompt = random_prompts(1, seed=9, min_len=7, max_len=7)[0][0]
    features = torch.randn(7, 3 * target.config.hidden_size)
    root = torch.tensor(5)
    drafted = {}  # drafted node id -> its parent's id and its token, for every node the tree grew
    expand = proposer._expand

    def watched(frontier, tokens, parents, depth):
        drafted.update({node: (int(parents[node]), int(tokens[node])) for node in range(len(tokens))})
        return expand(frontier, tokens, parents, depth)

    proposer._expand = watched
    with torch.no_grad():
        proposer.begin(prompt, features, root, capacity=64)
        proposer.propose(DynamicTreeSpec(depth=3, top_k=3, num_nodes=12))
        # the committed entries, causal: the prompt's features with the token after each (the root last)
        feature = drafter.fuse(features)[None]  # [1, 7, h]
        embeds = proposer.embed(torch.cat([prompt[1:], root.view(1)]))[None]
        positions = torch.arange(prompt.numel())[None]
        root_state = drafter(feature, embeds, positions)[0, -1]
        torch.testing.assert_close(proposer.states[0], root_state)
        checked = 0
        for node in sorted(drafted):  # the nodes expanded (their states kept for their children): depths 1 and 2
            if node == 0 or node not in {parent for parent, _ in drafted.values()}:
                continue
            path, walk = [], node
            while walk > 0:
                path.append(drafted[walk][1])
                walk = drafted[walk][0]
            # each path entry: the previous entry's output state and the entry's own token, one position further
            entries = (feature, embeds, positions)
            state = root_state
            for depth, token in enumerate(path[::-1], start=1):
                entries = (
                    torch.cat([entries[0], state.view(1, 1, -1)], dim=1),
                    torch.cat([entries[1], proposer.embed(torch.tensor([token]))[None]], dim=1),
                    torch.cat([entries[2], torch.tensor([[prompt.numel() - 1 + depth]])], dim=1),
                )
                state = drafter(*entries)[0, -1]
            torch.testing.assert_close(proposer.states[node], state, msg=lambda m, node=node: f"node {node}: {m}")
            checked += 1
    assert checked >= 3  # the three expanded at depth 1, and more


@pytest.mark.slow
@pytest.mark.parametrize("family", ["llama", "gemma3"])
def test_reduced_vocabulary_is_never_left_and_stays_lossless(family):
    target = tiny_target(family)
    vocab = DraftVocab(torch.arange(0, VOCAB, 3), VOCAB)  # every third token
    proposer = Eagle3Proposer(random_drafter(target, vocab), target)
    allowed = set(vocab.token_ids.tolist())
    proposed: list[int] = []
    propose = proposer.propose

    def recording(spec):
        tree = propose(spec)
        proposed.extend(tree.tokens[1:].tolist())
        return tree

    proposer.propose = recording
    for prompt in random_prompts(4, seed=11):
        out = speculative_generate(target, proposer, prompt, tree_spec("dynamic"), NEW_TOKENS)
        assert out.new_tokens.tolist() == stock_greedy(untouched_target(family), [prompt], NEW_TOKENS)[0]
    assert proposed and set(proposed) <= allowed


def test_draft_vocabulary_maps_round_trip():
    counts = torch.tensor([5, 0, 9, 9, 1, 7, 0, 3])
    vocab = DraftVocab.from_counts(counts, 4)
    assert vocab.token_ids.tolist() == [0, 2, 3, 5]  # the four most frequent, in id order
    assert vocab.d2t.tolist() == [0, 1, 1, 2]  # target id = i + d2t[i]
    assert vocab.t2d.tolist() == [True, False, True, True, False, True, False, False]
    again = DraftVocab.from_maps(vocab.d2t, vocab.t2d)
    assert torch.equal(again.token_ids, vocab.token_ids)
    assert vocab.token_ids[torch.tensor([3, 0])].tolist() == [5, 0]  # draft index -> target id
    broken = vocab.t2d.clone()
    broken[2] = False
    with pytest.raises(DraftVocabError, match="disagree"):
        DraftVocab.from_maps(vocab.d2t, broken)
    with pytest.raises(DraftVocabError, match="increasing"):
        DraftVocab(torch.tensor([3, 1]), 8)
    assert count_tokens([([1, 2, 2, 3], [0, 1, 1, 0])], 5).tolist() == [0, 0, 2, 0, 0]


def test_unrolled_mask_sees_the_prefix_and_the_rows_own_drafts():
    mask = unrolled_mask(torch.tensor([[1, 1, 1, 0]]), step=2)[0, 0]  # [T, 3T]
    assert mask.shape == (4, 12)
    assert mask[2, :4].tolist() == [True, True, True, False]  # step 0: causal prefix
    assert mask[2, 4:8].tolist() == [False, False, True, False]  # step 1: the row's own entry
    assert mask[2, 8:].tolist() == [False, False, True, False]  # step 2 likewise
    assert not mask[1, 2]  # never the future


def test_native_format_round_trips_and_is_checked_against_the_target(tmp_path):
    from medusa_like import DrafterMismatchError, MedusaLikeModel, load_drafter, save_drafter

    target = tiny_target("gemma3")  # a family whose layer is not Llama's: native keeps its extra tensors
    vocab = DraftVocab(torch.arange(0, VOCAB, 2), VOCAB)
    drafter = random_drafter(target, vocab, seed=4)
    out = save_drafter(drafter, tmp_path / "drafter", target, "tiny_gemma3")
    loaded = load_drafter(out, target)
    feature, embeds = torch.randn(1, 5, 96), torch.randn(1, 5, 32)
    with torch.no_grad():
        expected = drafter.logits(drafter(drafter.fuse(feature), embeds, torch.arange(5)[None]))
        got = loaded.logits(loaded(loaded.fuse(feature), embeds, torch.arange(5)[None]))
    torch.testing.assert_close(got, expected, rtol=0, atol=0)
    assert torch.equal(loaded.token_ids, vocab.token_ids)
    model = MedusaLikeModel.from_pretrained(target, drafter=out)
    prompt = random_prompts(1, seed=2)[0]
    out_tokens = model.generate(prompt, max_new_tokens=12, tree="dynamic", eos_token_id=[]).new_tokens
    assert out_tokens.tolist() == stock_greedy(untouched_target("gemma3"), [prompt], 12)[0]
    with pytest.raises(DrafterMismatchError, match="fingerprint"):
        load_drafter(out, tiny_target("gemma3", intermediate_size=48))
    with pytest.raises(DrafterMismatchError, match="hidden size"):
        load_drafter(out, tiny_target("gemma3", hidden_size=48))


def test_normalised_captured_states_round_trip_stay_lossless_and_are_refused_by_engine_formats(tmp_path):
    """EAGLE-3.1's option (`norm_aux`): each captured state is RMS-normalised before fc, so scaling one aux stream
    leaves the feature unchanged; the native format keeps the norms, greedy stays the target's, and the engine formats
    (whose layer has no such norms) refuse it instead of dropping them."""
    from medusa_like import load_drafter, save_drafter
    from medusa_like.formats import export_drafter
    from medusa_like.formats.common import FormatError

    target = tiny_target("llama")
    drafter = random_drafter(target, seed=6, norm_aux=True)
    assert len(drafter.aux_norms) == len(drafter.config.aux_layer_ids)
    h = drafter.config.target_hidden_size
    aux = torch.randn(1, 5, len(drafter.config.aux_layer_ids) * h)
    scaled = aux.clone()
    scaled[..., :h] *= 7.0  # the low stream 7x larger: its norm takes the scale out
    with torch.no_grad():
        torch.testing.assert_close(drafter.fuse(scaled), drafter.fuse(aux), rtol=1e-4, atol=1e-4)
    out = save_drafter(drafter, tmp_path / "native", target, "tiny_llama")
    loaded = load_drafter(out, target)
    assert loaded.config.norm_aux
    with torch.no_grad():
        torch.testing.assert_close(loaded.fuse(aux), drafter.fuse(aux), rtol=0, atol=0)
    prompt = random_prompts(1, seed=3)[0]
    got = speculative_generate(target, Eagle3Proposer(loaded, target), prompt, tree_spec("dynamic"), NEW_TOKENS)
    assert got.new_tokens.tolist() == stock_greedy(untouched_target("llama"), [prompt], NEW_TOKENS)[0]
    with pytest.raises(FormatError, match="normalises each captured state"):
        export_drafter(drafter, tmp_path / "engine", "eagle3", target, "tiny_llama")
