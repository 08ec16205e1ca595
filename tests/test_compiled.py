"""The compiled step (forward/compiled.py) against the eager one, on every tiny family: each tree node sees exactly its
path, greedy decoding gives the eager step's tokens, every drafter and tree is lossless on it (single nodes padded,
node counts from 1 to many), seeded sampling follows plain sampling, a failure falls back to eager with a log line,
an unsupported platform runs eager and says why, and the compile cache is keyed and rebuilt when foreign. The EAGLE-3
drafter's compiled level (forward/compiled_draft.py) drafts the eager level's trees, falls back alike and is keyed by
the drafter's weights; compiled Medusa heads give the eager heads' logits. A tree file measured on the compiled step
compiles an eager model's step and its drafter's level.

Compiling takes half a minute per tiny target: every test here is slow, one compiled target per family is shared, and
two families are left to make test-all (`family`)."""

import copy
import json
import logging
import threading
from pathlib import Path

import pytest
import torch

from medusa_like.decoding.projection import VocabProjection
from medusa_like.decoding.tree import BudgetedTreeSpec, DynamicTreeSpec
from medusa_like.decoding.tree_files import resolve_tree
from medusa_like.drafters.combined import CombinedDrafter
from medusa_like.drafters.eagle3 import EAGLE3
from medusa_like.drafters.eagle3_proposer import EagerLevel, Eagle3Proposer
from medusa_like.drafters.lookup import LookupDrafter
from medusa_like.drafters.vocab import DraftVocab
from medusa_like.forward import MachineProfile, compile_cache, prepare_target, write_profile
from medusa_like.forward import platform as forward_platform
from medusa_like.forward.compile_cache import progress
from medusa_like.forward.compiled import CompiledStep
from medusa_like.forward.compiled_draft import CompiledLevel, DraftCompiler
from medusa_like.forward.cpu import bf16_linear, few_row_linear
from medusa_like.forward.cpu.few_row_linear import FewRowLinear, onednn_packs_available
from medusa_like.forward.platform import CompileUnsupported, compile_settings
from medusa_like.model import MedusaLikeModel
from medusa_like.targets import weights_fingerprint

from .conftest import (
    VOCAB,
    assert_greedy_or_near_tie,
    random_heads,
    random_prompts,
    stock_greedy,
    tiny_target,
    untouched_target,
)

pytestmark = pytest.mark.slow

try:
    compile_settings(tiny_target("llama"))
    UNSUPPORTED = None
except CompileUnsupported as why:
    UNSUPPORTED = str(why)
needs_compile = pytest.mark.skipif(UNSUPPORTED is not None, reason=f"no compiled step here: {UNSUPPORTED}")

NEW_TOKENS = 20


@pytest.fixture(
    params=[
        "llama",
        "gemma3",
        pytest.param("qwen2", marks=pytest.mark.heavy),
        pytest.param("mistral", marks=pytest.mark.heavy),
    ]
)
def family(request) -> str:
    """Full attention (llama) and mixed sliding and full layers (gemma3) in make test; the other families, whose
    attention is one of those kinds, compile in make test-all (a compile is half a minute of a core)."""
    return request.param


@pytest.fixture(scope="module")
def compiled_targets():
    """family -> (a tiny target with its compiled step, an eager copy of the same weights): compiled once each."""
    return {}


def compiled(compiled_targets, family):
    """Compiled without autotuning the products (freezing and fusion as shipped): what these tests check is the graph
    around the products, its cache, masks and windows, and autotuning tiny products takes a minute a family for
    nothing they test. The options as shipped, autotuning included, run through the evaluation's entry point in
    tests/test_honest_eval.py."""
    if family not in compiled_targets:
        target = tiny_target(family)
        prepared = prepare_target(target, tuned_layers=False, compile=True)
        assert isinstance(prepared.step, CompiledStep)
        prepared.step.options = {**prepared.step.options, "max_autotune": False}
        compiled_targets[family] = (prepared, prepare_target(tiny_target(family), tuned_layers=False))
    return compiled_targets[family]


def eagle3_on(compiled_targets, family):
    """An EAGLE-3 drafter started from the compiled target's last layer and head (drafts that are often right:
    accepted paths of several nodes), adopted by it: its level compiled on first use, once per family."""
    key = f"{family} eagle3"
    if key not in compiled_targets:
        prepared, _ = compiled(compiled_targets, family)
        target = prepared.target
        eagle3 = EAGLE3.fresh(target)
        eagle3.init_layer_from_target(target, target.config.num_hidden_layers - 1)
        eagle3.init_from_target(target)
        compiled_targets[key] = prepared.adopt(eagle3)
    return compiled_targets[key]


def greedy(prepared, prompt, max_new_tokens=NEW_TOKENS) -> list[int]:
    model = MedusaLikeModel(prepared, None, random_heads())
    return model.generate(prompt, max_new_tokens=max_new_tokens, tree="none", eos_token_id=[]).new_tokens.tolist()


@needs_compile
@pytest.mark.parametrize("tree_name", ["chain", "small", "medusa"])
def test_every_tree_node_sees_exactly_its_path_compiled(compiled_targets, family, tree_name):
    """The compiled step's logits at each node equal those of the prompt + that node's path run through the target
    (sliding windows included: the tests' windows are shorter than the prompt)."""
    prepared, _ = compiled(compiled_targets, family)
    target, step = prepared.target, prepared.step
    tree = resolve_tree(tree_name, 4)
    g = torch.Generator().manual_seed(3)
    prompt = torch.randint(0, VOCAB, (1, 11), generator=g)
    tokens = torch.randint(0, VOCAB, (tree.num_nodes,), generator=g)
    cache = step.new_cache(11 + tree.num_nodes)
    with torch.inference_mode():
        step.forward(prompt, torch.arange(11)[None], None, cache, last=True)
        cache.commit_all(11)
        logits, _ = step.forward(tokens[None], (11 + tree.depth)[None], tree.attention_mask[None, None], cache)
        for node in range(tree.num_nodes):
            ancestors = tree.attention_mask[node].nonzero().flatten()  # ascending = root to node
            expected = target(torch.cat([prompt[0], tokens[ancestors]])[None]).logits[0, -1]
            torch.testing.assert_close(logits[node], expected, atol=1e-4, rtol=1e-4)
    assert step.failed is None  # compiled, not the eager fallback


@needs_compile
def test_compiled_greedy_equals_eager_greedy_and_every_drafter_is_lossless_on_it(compiled_targets, family):
    """Greedy on the compiled step gives transformers' own greedy tokens of an untouched copy, and so does the eager
    step; Medusa heads, the EAGLE-3 drafter, lookup and the combined tree, static and dynamic, give them too (trees of
    1 to many nodes, single nodes padded), each drafter with drafts accepted on the compiled step."""
    prepared, eager = compiled(compiled_targets, family)
    prompts = random_prompts(3, seed=11, min_len=1, max_len=30)
    references = stock_greedy(untouched_target(family), prompts, NEW_TOKENS)
    assert [greedy(prepared, p) for p in prompts] == references
    assert [greedy(eager, p) for p in prompts] == references
    eagle3 = eagle3_on(compiled_targets, family)
    heads = random_heads()
    runs = [
        (heads, "medusa"),
        (heads, "chain"),
        (eagle3, DynamicTreeSpec(depth=3, top_k=3, num_nodes=6)),
        (LookupDrafter(), "dynamic"),
        (CombinedDrafter(eagle3, LookupDrafter()), "dynamic"),
    ]
    accepted = {drafter.kind: 0 for drafter, _ in runs}
    for drafter, tree in runs:
        model = MedusaLikeModel(prepared, None, drafter)
        for prompt, reference in zip(prompts, references, strict=True):
            out = model.generate(prompt, max_new_tokens=NEW_TOKENS, tree=tree, eos_token_id=[], remember=False)
            assert out.new_tokens.tolist() == reference, (drafter.kind, tree)
            accepted[drafter.kind] += sum(out.stats.accepted_draft)
    assert all(accepted.values()), f"drafts accepted per drafter: {accepted} (0: only the all-rejected path tested)"
    # every run above ran compiled (a failed compile falls back to eager for good: equal tokens, nothing tested),
    # the EAGLE-3 drafter's levels and the Medusa heads too
    assert prepared.compiled.failed is None and prepared.step is prepared.compiled
    assert isinstance(eagle3.level(), CompiledLevel) and eagle3.level().failed is None
    assert heads.compiled_logits(None).compiled is not None and heads.compiled_logits(None).failed is None


@needs_compile
@pytest.mark.parametrize("family", ["llama", "qwen2"])  # qwen2: biased q, k and v products
def test_a_bf16_target_is_lossless_on_its_compiled_step(family):
    """bf16 rounds every activation, so a node verified as one row of a tree must get the very bits it gets in a
    one-node step, or tree methods drift from greedy decoding at near-ties; the step's attention kernel and (where the
    CPU has a bf16 dot product) its products' kernel give them (their own contracts: tests/test_tree_attention.py,
    tests/test_bf16_linear.py). On bf16 targets with 64-wide heads over prompts of up to 120 tokens, lookup and Medusa
    trees of 1 to 12 nodes give greedy's tokens on the same compiled step, each drafter's drafts accepted; that greedy
    decoding is transformers' own on an untouched bf16 copy up to near-ties (two bf16 forwards round apart)."""
    shape = dict(hidden_size=256, num_attention_heads=4, num_key_value_heads=2, intermediate_size=256)
    target = tiny_target(family, **shape)
    prepared = prepare_target(target.to(torch.bfloat16), tuned_layers=False, compile=True)
    prepared.step.options = {**prepared.step.options, "max_autotune": False}
    prompts = random_prompts(8, seed=5, min_len=20, max_len=120)
    heads = random_heads(hidden=256)
    plain = MedusaLikeModel(prepared, None, heads)
    references = [
        plain.generate(p, max_new_tokens=40, tree="none", eos_token_id=[]).new_tokens.tolist() for p in prompts
    ]
    untouched = untouched_target(family, dtype=torch.bfloat16, **shape)
    for prompt, reference, theirs in zip(prompts, references, stock_greedy(untouched, prompts, 40), strict=True):
        assert_greedy_or_near_tie(untouched, prompt, reference, theirs)
    runs = [(LookupDrafter(), BudgetedTreeSpec(None, 12, 8)), (heads, "medusa"), (heads, "chain")]
    accepted = {drafter.kind: 0 for drafter, _ in runs}
    for drafter, tree in runs:
        model = MedusaLikeModel(prepared, None, drafter)
        for prompt, reference in zip(prompts, references, strict=True):
            out = model.generate(prompt, max_new_tokens=40, tree=tree, eos_token_id=[], remember=False)
            assert out.new_tokens.tolist() == reference, (drafter.kind, tree)
            accepted[drafter.kind] += sum(out.stats.accepted_draft)
    assert all(accepted.values()), f"drafts accepted per drafter: {accepted} (0: only the all-rejected path tested)"
    assert prepared.step.failed is None and prepared.step is prepared.compiled
    # where the CPU has a bf16 dot product, the step's products ran this project's kernel (row-invariant too)
    assert ("bf16 dot-product kernel" in prepared.step.label) == (bf16_linear.unavailable() is None)


@needs_compile
@pytest.mark.skipif(bf16_linear.unavailable() is not None, reason=f"{bf16_linear.unavailable()}")
def test_the_compiler_traces_bf16_layers_on_the_kernel_and_the_cache_tells_the_builds_apart():
    """The compiled graph traces a copy sharing the weights: fp32 few-row layers back as `nn.Linear`s (Inductor's
    template computes them), bf16 ones as the dot-product kernel's `PackedLinear`s; a package of one is never loaded
    for the other."""
    fp32 = prepare_target(tiny_target("llama"), tuned_layers=True).target
    assert any(isinstance(m, FewRowLinear) for m in fp32.modules())
    traced = forward_platform.traced_layers(fp32, tuned=True)
    assert not any(isinstance(m, (FewRowLinear, bf16_linear.PackedLinear)) for m in traced.modules())
    bf16 = tiny_target("llama").to(torch.bfloat16)
    packed = forward_platform.traced_layers(bf16, tuned=False)
    swapped = [m for m in packed.modules() if isinstance(m, bf16_linear.PackedLinear)]
    assert swapped and not any(type(m) is torch.nn.Linear for m in packed.modules())
    assert {id(m.weight) for m in swapped} <= {id(p) for p in bf16.parameters()}  # no weight copied
    keys = [compile_cache.cache_key(CompiledStep(m, *compile_settings(m))) for m in (fp32, bf16)]
    assert keys[0]["products"] == "inductor"
    assert keys[1]["products"] == f"bf16_linear-{bf16_linear.KERNEL.build_key()}"
    # a bf16 drafter beside the fp32 target: its level traced on the kernel, and its log says so
    drafter = EAGLE3.fresh(fp32).to(dtype=torch.bfloat16)
    options, label = compile_settings(fp32)
    traced = DraftCompiler(fp32, options, label, lambda m: forward_platform.traced_layers(m, tuned=False))
    level = traced.level(drafter)
    assert any(isinstance(m, bf16_linear.PackedLinear) for m in level.drafter.modules())
    assert level.label == f"{label}; bf16 layers on the bf16 dot-product kernel"


def draft_twice(proposer, prompt, features, spec) -> list:
    """The trees `proposer` drafts after `prompt` (with `features` [P, F]): a first one (the prompt's rows committed
    at once), then a second after accepting the root and its first child (two rows committed); and the second's
    states of the nodes it expanded."""
    proposer.begin(prompt, features, prompt[-1], 64)
    with torch.inference_mode():
        first = proposer.propose(spec)
        proposer.accept(first.tokens[:2], features[:2] + 1, first.tokens[1])
        second = proposer.propose(spec)
    expanded = sorted(set(second.parents.tolist()) - {-1})  # the nodes whose states were computed (leaves' are not)
    return [(tree.tokens.tolist(), tree.parents.tolist()) for tree in (first, second)] + [proposer.states[expanded]]


@needs_compile
def test_the_drafters_compiled_level_drafts_the_eager_levels_trees(compiled_targets, family, caplog):
    """Where the target's step is compiled, the EAGLE-3 drafter drafts through its compiled level, which drafts the
    trees its eager level drafts (chains of one row a level, padded; wider levels; many prompt rows at once), with
    the same states up to rounding; a later process loads the level's package instead of compiling it."""
    prepared, _ = compiled(compiled_targets, family)
    eagle3 = eagle3_on(compiled_targets, family)
    level = eagle3.level()
    assert isinstance(level, CompiledLevel)
    width = len(eagle3.config.aux_layer_ids) * eagle3.config.target_hidden_size
    g = torch.Generator().manual_seed(7)
    for spec in (DynamicTreeSpec(depth=3, top_k=1, num_nodes=3), DynamicTreeSpec(depth=3, top_k=3, num_nodes=8)):
        prompt = torch.randint(0, VOCAB, (9,), generator=g)
        features = torch.randn(9, width, generator=g)
        drafted = []
        for own in (EagerLevel(eagle3), level):
            proposer = Eagle3Proposer(eagle3, prepared.target)
            proposer.level = own
            drafted.append(draft_twice(proposer, prompt, features, spec))
        (*eager_trees, eager_states), (*compiled_trees, compiled_states) = drafted
        assert compiled_trees == eager_trees and len(eager_trees[1][0]) == spec.max_nodes
        torch.testing.assert_close(compiled_states, eager_states, atol=1e-4, rtol=1e-4)
    assert level.failed is None and level.compiled is not None
    path = compile_cache.package_path(level)
    level.compiled = None  # as in a new process
    with caplog.at_level(logging.INFO):
        proposer = Eagle3Proposer(eagle3, prepared.target)
        assert draft_twice(proposer, prompt, features, spec)[:2] == compiled_trees
    assert f"loaded the drafter's level compiled from {path}" in caplog.text and "compiling" not in caplog.text


@needs_compile
def test_a_failing_compiled_draft_runs_eagerly_with_a_log_line_never_a_wrong_token(compiled_targets, caplog):
    """The EAGLE-3 drafter's compiled level and compiled Medusa heads, their compile broken: each drafts eagerly from
    then on, says why, and the output is greedy's."""
    prepared, _ = compiled(compiled_targets, "llama")
    prompt = random_prompts(1, seed=8, min_len=9, max_len=9)[0]
    expected = greedy(prepared, prompt)

    def broken():
        raise RuntimeError("the compiler broke")

    eagle3, heads = EAGLE3.fresh(prepared.target), random_heads(seed=5)
    for drafter, tree, said in (
        (eagle3, "chain", "the drafter's compiled level"),
        (heads, "medusa", "the compiled Medusa heads"),
    ):
        model = MedusaLikeModel(prepared, None, drafter)
        compiled_draft = eagle3.level() if drafter is eagle3 else heads.compiled_logits(None)
        compiled_draft._compiled = broken
        with caplog.at_level(logging.WARNING):
            out = model.generate(prompt, max_new_tokens=NEW_TOKENS, tree=tree, eos_token_id=[])
        assert out.new_tokens.tolist() == expected
        assert f"{said} failed (RuntimeError: the compiler broke)" in caplog.text
        assert compiled_draft.failed == "RuntimeError: the compiler broke"


@needs_compile
def test_a_profile_measured_on_the_compiled_step_compiles_the_target_and_the_drafters_level(
    compiled_targets, monkeypatch, tmp_path, caplog
):
    """A model handed a machine profile measured on the compiled step (a tree search with `target.compile=auto`),
    `compile` left to the profile, runs the compiled step, and its combined drafter drafts through the EAGLE-3 level
    compiled beside it; the output is greedy's. The tree argument only names the tree."""
    prepared, _ = compiled(compiled_targets, "llama")
    prompt = random_prompts(1, seed=12, min_len=9, max_len=9)[0]
    expected = greedy(prepared, prompt)  # runs the shared step, whatever ran before: its package is on disk
    # the fixture's options (no autotuning): the step's package on disk is loaded, not compiled again
    monkeypatch.setitem(forward_platform.CPU_OPTIONS, "max_autotune", False)
    target = tiny_target("llama")  # the compiled one's weights (a target is prepared once: another object)
    assert weights_fingerprint(target) == weights_fingerprint(prepared.target)
    learned = EAGLE3.fresh(target)
    learned.load_state_dict(eagle3_on(compiled_targets, "llama").state_dict())  # the same weights: its level's package
    cost = prepared.cost_model()
    path = tmp_path / "profile.json"
    write_profile(MachineProfile("auto", prepared.identity(), cost), path)
    assert json.loads(path.read_text())["identity"]["step"].startswith("compiled")
    eager = prepare_target(target, tuned_layers=False)
    assert eager.compiled is None
    model = MedusaLikeModel(eager, None, CombinedDrafter(learned, LookupDrafter()), profile=path)
    assert eager.compiled is not None and eager.profile.path == str(path)
    tree = BudgetedTreeSpec(DynamicTreeSpec(depth=2, top_k=2, num_nodes=3), num_nodes=6, lookup_depth=4)
    with caplog.at_level(logging.INFO):
        out = model.generate(prompt, max_new_tokens=NEW_TOKENS, tree=tree, eos_token_id=[], remember=False)
    assert out.new_tokens.tolist() == expected
    assert eager.step is eager.compiled and eager.compiled.failed is None
    assert model.drafter.cost_model.verify_ms == pytest.approx(cost.verify_ms, abs=1e-3)  # the profile's
    assert isinstance(learned.level(), CompiledLevel) and learned.level().failed is None
    assert learned.level().compiled is not None  # it drafted compiled, not only set up to
    assert "loaded the target's step compiled from" in caplog.text


@needs_compile
def test_compiled_medusa_heads_give_the_eager_heads_logits_over_a_draft_vocabulary(compiled_targets):
    """Medusa heads restricted to a draft vocabulary, compiled with the target's projection rows: every head's logits
    as the eager heads compute them, the same drafts, and greedy's tokens; other rows than those compiled run eagerly."""
    prepared, _ = compiled(compiled_targets, "llama")
    heads = random_heads(seed=3)
    heads.draft_vocab = DraftVocab(torch.arange(0, VOCAB, 2), VOCAB)  # every other token
    model = MedusaLikeModel(prepared, None, heads)
    compiled_heads = heads.compiled_logits(heads.draft_vocab.token_ids)
    assert compiled_heads is not None and heads.compiled_logits(None) is None
    hidden = torch.randn(heads.config.hidden_size, generator=torch.Generator().manual_seed(1))
    projection = VocabProjection(prepared.target, heads.draft_vocab.token_ids)
    with torch.inference_mode():
        compiled_logits, eager_logits = compiled_heads(hidden), heads(hidden, projection)  # [K, N]
    torch.testing.assert_close(compiled_logits, eager_logits, atol=1e-4, rtol=1e-4)
    assert torch.equal(compiled_logits.topk(3).indices, eager_logits.topk(3).indices)  # the same drafts
    prompt = random_prompts(1, seed=9, min_len=8, max_len=8)[0]
    out = model.generate(prompt, max_new_tokens=NEW_TOKENS, tree="medusa", eos_token_id=[])
    assert out.new_tokens.tolist() == greedy(prepared, prompt) and compiled_heads.failed is None


def test_the_compiled_levels_cache_is_keyed_by_the_drafters_weights():
    """A drafter retrained at the same path (other weights, same config) gets another compiled level; the same
    weights the same one; another dtype another."""
    target = tiny_target("llama")
    options, label = {"freezing": True}, "test"

    def level(seed, dtype=torch.float32):
        torch.manual_seed(seed)
        return DraftCompiler(target, options, label, lambda module: module).level(EAGLE3.fresh(target).to(dtype=dtype))

    first = compile_cache.cache_key(level(0))
    assert first["drafter_fingerprint"] and first["drafter_class"] == "Eagle3Drafter" and "drafter_code" in first
    assert compile_cache.cache_key(level(0)) == first
    assert compile_cache.cache_key(level(1))["drafter_fingerprint"] != first["drafter_fingerprint"]
    assert compile_cache.cache_directory(level(1)) != compile_cache.cache_directory(level(0))
    assert compile_cache.cache_key(level(0, torch.bfloat16))["dtype"] == "torch.bfloat16"
    assert compile_cache.cache_directory(level(0, torch.bfloat16)) != compile_cache.cache_directory(level(0))


@needs_compile
def test_seeded_sampling_on_the_compiled_step_follows_plain_sampling(compiled_targets):
    """A seeded run draws each position's token with that position's noise: whatever the tree, the same tokens as
    plain decoding with that seed, on the compiled step as on the eager one."""
    prepared, _ = compiled(compiled_targets, "llama")
    model = MedusaLikeModel(prepared, None, random_heads())
    prompt = random_prompts(1, seed=2, min_len=8, max_len=8)[0]
    for seed in range(3):
        settings = dict(max_new_tokens=NEW_TOKENS, temperature=0.8, top_k=20, seed=seed, eos_token_id=[])
        plain = model.generate(prompt, tree="none", **settings).new_tokens.tolist()
        for tree in ("medusa", "chain"):
            assert model.generate(prompt, tree=tree, **settings).new_tokens.tolist() == plain


@needs_compile
def test_a_failing_compile_falls_back_to_eager_with_a_log_line_never_a_wrong_token(monkeypatch, caplog):
    target = tiny_target("qwen2")
    prompt = random_prompts(1, seed=4, min_len=9, max_len=9)[0]
    expected = greedy(prepare_target(tiny_target("qwen2"), tuned_layers=False), prompt)

    def broken_compiler(*args, package_path=None, **kwargs):
        if package_path is not None:  # AOTInductor's build, cut halfway through writing its package
            Path(package_path).write_bytes(b"half a package")
        raise RuntimeError("the compiler broke")

    # the compiler (AOTInductor on CPUs, torch.compile on GPUs) and the loading of an earlier package both fail
    for name in ("aoti_compile_and_package", "aoti_load_package"):
        monkeypatch.setattr(torch._inductor, name, broken_compiler)
    monkeypatch.setattr(torch, "compile", broken_compiler)
    prepared = prepare_target(target, tuned_layers=False, compile=True)
    with caplog.at_level(logging.WARNING):
        assert greedy(prepared, prompt) == expected  # the failing generation finishes eagerly
    assert "the compiled step failed (RuntimeError: the compiler broke)" in caplog.text
    assert prepared.step is prepared.eager and greedy(prepared, prompt) == expected
    directory = compile_cache.cache_directory(prepared.compiled)
    assert not list(directory.glob("step*.pt2"))  # nothing half-written left to load, or to fill the disk


@needs_compile
@pytest.mark.skipif(not onednn_packs_available(), reason="oneDNN's packs do not run here")
@pytest.mark.parametrize("length", [80, 20])  # over the few-row layers' MAX_ROWS, and under it
def test_the_compiled_steps_prefill_runs_on_the_few_row_layers_onednn_pack_with_the_targets_logits(length):
    """A compiled fp32 target's prompt, long or short, is read eagerly on its few-row layers with oneDNN's pack
    (the compiled graph's stock layers would run F.linear, slower over a prompt's rows; a short prompt the eager
    step's fp32 kernel) and gives the target's own logits;
    nothing is compiled for it."""
    target = tiny_target("llama")
    prompt = torch.randint(0, VOCAB, (1, length), generator=torch.Generator().manual_seed(5))
    with torch.inference_mode():
        expected = target(prompt).logits[0, -1]
    prepared = prepare_target(target, compile=True)
    step = prepared.step
    assert isinstance(step, CompiledStep) and step.eager_target is prepared.target
    cache = step.new_cache(100)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as profile:
        logits, _ = step.forward(prompt, torch.arange(length)[None], None, cache, last=True)
    calls = {event.key: event.count for event in profile.key_averages()}
    layers = sum(isinstance(m, FewRowLinear) for m in prepared.target.base_model.modules())
    # every decoder layer's product over the prompt's rows on the pack; F.linear only for the last row's logits
    assert calls.get("mkldnn::_linear_pointwise") == layers > 0 and calls.get("aten::mm", 0) <= 1
    torch.testing.assert_close(logits[0], expected, atol=1e-4, rtol=1e-4)
    assert step.compiled is None  # a prefill compiles nothing


@needs_compile
@pytest.mark.skipif(not onednn_packs_available(), reason="oneDNN's packs do not run here")
def test_the_compiled_steps_prompts_keep_f_linear_where_a_pack_of_every_weight_would_not_fit(monkeypatch):
    """oneDNN's pack is a second copy of every weight: where it would not fit in memory, the compiled step reads its
    prompts on nn.Linear (no layer swapped, none holds a pack), and gives the target's logits."""
    target = tiny_target("llama")
    prompt = torch.randint(0, VOCAB, (1, 80), generator=torch.Generator().manual_seed(5))
    with torch.inference_mode():
        expected = target(prompt).logits[0, -1]
    monkeypatch.setattr(few_row_linear, "PACK_MEMORY_SHARE", 0.0)
    prepared = prepare_target(target, compile=True)
    assert isinstance(prepared.step, CompiledStep)
    assert not any(isinstance(m, FewRowLinear) for m in prepared.target.modules())
    logits, _ = prepared.step.forward(prompt, torch.arange(80)[None], None, prepared.step.new_cache(100), last=True)
    torch.testing.assert_close(logits[0], expected, atol=1e-4, rtol=1e-4)


@pytest.mark.skipif(forward_platform.platform.machine() not in ("x86_64", "AMD64"), reason="x86 CPUs only")
def test_the_products_of_one_input_are_concatenated_where_avx512_runs_and_the_cache_tells_them_apart(monkeypatch):
    """On CPUs whose torch kernels run AVX512 the compiled step concatenates the products of one input (faster there at
    every row count measured, slower from 4 rows on AVX2); its label and compile cache say so."""
    target = tiny_target("llama")
    settings = {}
    for capability in ("AVX2", "AVX512"):
        monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda c=capability: c)
        settings[capability] = compile_settings(target)
    (avx2, avx2_label), (avx512, avx512_label) = settings["AVX2"], settings["AVX512"]
    assert "cpp.enable_concat_linear" not in avx2 and avx512["cpp.enable_concat_linear"] is True
    assert {k: v for k, v in avx512.items() if k != "cpp.enable_concat_linear"} == avx2
    assert avx512_label == avx2_label + ", concatenated products"
    keys = [compile_cache.cache_key(CompiledStep(target, options, label)) for options, label in settings.values()]
    assert keys[0]["options"] != keys[1]["options"]  # a package built with either is never loaded for the other


@needs_compile
def test_the_gemm_templates_micro_kernels_reach_the_generated_code_declared_noexcept():
    """Where the step compiles, the template's micro-kernels are declared noexcept (the compiler then keeps their
    accumulators in registers) in the code a compiled product generates at 7 rows (g++ left the 6-8-row kernels out of
    line), and the product is still nn.Linear's up to fp32 rounding."""
    from torch._inductor.codegen.cpp_micro_gemm import CppMicroGemmFP32Vec
    from torch._inductor.utils import run_and_get_code

    options, _ = compile_settings(tiny_target("llama"))
    assert forward_platform.micro_kernels_noexcept()
    assert CppMicroGemmFP32Vec.TEMPLATE_KERNEL.count(forward_platform.NOEXCEPT_SIGNATURE_END) == 1
    linear = torch.nn.Linear(64, 96, bias=False).eval()
    x = torch.randn(7, 64, generator=torch.Generator().manual_seed(0))
    torch._dynamo.reset()
    compiled = torch.compile(linear, fullgraph=True, options=options)
    torch._dynamo.mark_dynamic(x, 0, min=2, max=64)
    with torch.no_grad(), torch._inductor.config.patch({**options, "fx_graph_cache": False}):
        out, code = run_and_get_code(compiled, x)
    source = "\n".join(code)
    assert "micro_gemm" in source and ") noexcept {" in source
    torch.testing.assert_close(out, linear(x), atol=1e-5, rtol=1e-5)


def test_an_unsupported_platform_runs_eager_and_says_why(monkeypatch, caplog):
    monkeypatch.setattr(forward_platform.platform, "machine", lambda: "riscv64")
    with caplog.at_level(logging.INFO):
        prepared = prepare_target(tiny_target("llama"), tuned_layers=False, compile="auto")
    assert prepared.compiled is None and prepared.step is prepared.eager
    assert (
        "compile: the C++ GEMM template is measured on x86 CPUs only, not riscv64; the eager step runs" in caplog.text
    )
    with caplog.at_level(logging.WARNING):
        prepare_target(tiny_target("llama"), tuned_layers=False, compile=True)
    assert any(r.levelno == logging.WARNING and "riscv64" in r.message for r in caplog.records)


def test_a_long_compile_logs_its_progress_until_it_ends(caplog):
    """`progress` logs "still <doing>" while its block runs, and its reporter thread is gone once the block ends, a
    failed one too. The test waits for the lines themselves and looks at the threads: no pause decides it."""
    lines = threading.Semaphore(0)

    class Counting(logging.Handler):
        def emit(self, record):
            if "still building" in record.getMessage():
                lines.release()

    def reporters() -> list:
        return [t for t in threading.enumerate() if t.name == "compile progress" and t.is_alive()]

    logger = logging.getLogger("medusa_like.forward.compile_cache")
    counting = Counting()
    logger.addHandler(counting)
    try:
        with caplog.at_level(logging.INFO, logger=logger.name):
            with progress("building", every=0.01):
                assert len(reporters()) == 1
                for _ in range(
                    3
                ):  # three lines while the block runs (the wait is for a line: a loaded machine is slower)
                    assert lines.acquire(timeout=600)
            assert reporters() == []  # stopped with its block: no line can follow
            with pytest.raises(RuntimeError, match="broke"), progress("building", every=0.01):
                assert lines.acquire(timeout=600)
                raise RuntimeError("broke")
            assert reporters() == []  # the failed block's too
    finally:
        logger.removeHandler(counting)
    assert "s so far" in caplog.text


def test_compile_must_be_a_known_choice():
    with pytest.raises(ValueError, match=r"compile must be one of \(False, True, 'auto'\), got 'yes'"):
        prepare_target(tiny_target("llama"), tuned_layers=False, compile="yes")


@needs_compile
def test_a_compiled_step_that_would_not_fit_in_memory_runs_eagerly_and_says_why(compiled_targets, monkeypatch, caplog):
    """Building a package takes several times the weights' bytes, loading one about four: where the machine has
    less memory available, the build is refused before any tracing (a process killed for memory minutes in would be
    no fallback) and the eager step decodes the same tokens; a package built earlier is not loaded either."""
    target = tiny_target("llama", seed=31)  # weights no other test compiled: no package to load
    weights = sum(p.numel() * p.element_size() for p in target.parameters())
    prompt = random_prompts(1, seed=5, min_len=8, max_len=8)[0]
    expected = greedy(prepare_target(tiny_target("llama", seed=31), tuned_layers=False), prompt)
    traced = []
    monkeypatch.setattr(torch.export, "export", lambda *a, **k: traced.append(a))
    monkeypatch.setattr(compile_cache, "available_memory", lambda: 5 * weights)
    prepared = prepare_target(target, tuned_layers=False, compile=True)
    with caplog.at_level(logging.WARNING):
        assert greedy(prepared, prompt) == expected
    assert not traced and prepared.step is prepared.eager
    said = f"compiling the target's step would take about {7 * weights / 2**30:.1f} GiB of memory (7x the weights'"
    assert f"the compiled step failed (NotEnoughMemory: {said}" in caplog.text

    monkeypatch.undo()
    shared, _ = compiled(compiled_targets, "llama")
    greedy(shared, prompt)  # its package built (or loaded)
    step, built = shared.step, shared.step.compiled
    weights = sum(p.numel() * p.element_size() for p in step.target.parameters())
    monkeypatch.setattr(compile_cache, "available_memory", lambda: 3 * weights)
    step.compiled = None  # a later process
    try:
        with pytest.raises(compile_cache.NotEnoughMemory, match="loading the target's step compiled would take"):
            step._compiled()
    finally:
        step.compiled = built


@needs_compile
def test_a_later_process_loads_the_compiled_step_and_a_corrupt_package_is_compiled_again(compiled_targets, caplog):
    """A step whose compiled graph is gone (a new process) loads the package the first one saved, with the same
    tokens; a package cut short is refused with a log line and compiled again, never run."""
    prepared, _ = compiled(compiled_targets, "llama")
    prompt = random_prompts(1, seed=6, min_len=7, max_len=7)[0]
    prepared.step.compiled = None  # loaded again, or compiled again where another test emptied its directory
    expected = greedy(prepared, prompt)
    path = compile_cache.package_path(prepared.step)
    assert path.is_file() and not list(path.parent.glob("*.partial-*"))
    prepared.step.compiled = None
    with caplog.at_level(logging.INFO):
        assert greedy(prepared, prompt) == expected
    assert f"loaded the target's step compiled from {path}" in caplog.text and "compiling" not in caplog.text
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])  # a copy cut halfway
    prepared.step.compiled = None
    caplog.clear()
    with caplog.at_level(logging.INFO):
        assert greedy(prepared, prompt) == expected
    assert "is unreadable" in caplog.text and "saved to" in caplog.text and prepared.step.failed is None


@needs_compile
def test_the_compile_cache_is_keyed_by_weights_and_versions_and_a_foreign_one_is_rebuilt(
    compiled_targets, monkeypatch, caplog
):
    prepared, _ = compiled(compiled_targets, "llama")
    greedy(prepared, random_prompts(1, seed=5, min_len=6, max_len=6)[0])  # compiled (or loaded) by now
    step = prepared.step
    key = compile_cache.cache_key(step)
    assert key["target_fingerprint"] == prepared.identity()["target_fingerprint"] and key["torch"] == torch.__version__
    directory = compile_cache.cache_directory(step)
    assert json.loads((directory / "key.json").read_text()) == key and (directory / "step.pt2").is_file()
    other = CompiledStep(tiny_target("llama", seed=1), step.options, step.label)  # other weights, same config
    assert compile_cache.cache_directory(other) != directory
    other = CompiledStep(tiny_target("mistral"), step.options, step.label)  # the same weights, another forward
    assert weights_fingerprint(other.target) == key["target_fingerprint"]
    assert compile_cache.cache_directory(other) != directory
    monkeypatch.setattr(torch, "__version__", "0.0.0")  # another torch: another directory
    assert compile_cache.cache_directory(step) != directory
    monkeypatch.undo()
    (directory / "key.json").write_text(json.dumps(key | {"torch": "another"}))  # a foreign directory at this key
    marker = directory / "artifact"
    marker.write_text("built elsewhere")
    with caplog.at_level(logging.WARNING):
        rebuilt = compile_cache.checked_directory(step)
    assert rebuilt == directory and not marker.exists() and "rebuilding it" in caplog.text
    assert json.loads((directory / "key.json").read_text()) == key


@needs_compile
def test_the_block_drafter_drafts_through_its_compiled_block_and_stays_lossless(compiled_targets, family):
    """Where the target's step is compiled, the block drafter's block is compiled beside it (`compile_drafting`): it
    gives the eager graph's logits for the same context and root, and alone or merged with lookup it decodes
    transformers' own greedy tokens, drafts accepted, every step but the first (the prompt's rows, eager) compiled."""
    from .test_block import trained_block

    prepared, _ = compiled(compiled_targets, family)
    _, trained = trained_block(family)
    block = prepared.adopt(copy.deepcopy(trained))
    prompts = random_prompts(3, seed=12, min_len=3, max_len=30)
    references = stock_greedy(untouched_target(family), prompts, NEW_TOKENS)
    accepted = 0
    for drafter, tree in ((block, "dynamic"), (block, "chain"), (CombinedDrafter(block, LookupDrafter()), "dynamic")):
        model = MedusaLikeModel(prepared, None, drafter)
        for prompt, reference in zip(prompts, references, strict=True):
            out = model.generate(prompt, max_new_tokens=NEW_TOKENS, tree=tree, eos_token_id=[], remember=False)
            assert out.new_tokens.tolist() == reference, (drafter.kind, tree)
            accepted += sum(out.stats.accepted_draft)
    step = block.block_step()  # the last model's adoption's: every adoption compiles it again, or loads the package
    assert accepted > 0 and step.compiled is not None and step.failed is None
    # a bf16 drafter beside the fp32 target (what drafter_dtype=auto picks where bf16 is native): its block takes
    # the target's fp32 features and still drafts compiled, losslessly
    model = MedusaLikeModel(prepared, None, copy.deepcopy(trained), drafter_dtype=torch.bfloat16)
    assert model.drafter.fc.weight.dtype == torch.bfloat16
    for prompt, reference in zip(prompts, references, strict=True):
        assert model.generate(prompt, max_new_tokens=NEW_TOKENS, tree="chain", eos_token_id=[]).new_tokens.tolist() == (
            reference
        )
    assert model.drafter.block_step().compiled is not None and model.drafter.block_step().failed is None
    proposer = block.proposer(prepared.target)
    features = torch.randn(9, block.fc.weight.shape[1])
    proposer.begin(prompts[0][0], features, torch.tensor(3), 64)
    proposer.block_log_probs(7)  # the prompt's rows, eager
    proposer.accept(torch.tensor([3, 4]), features[:2], torch.tensor(5))
    compiled_logp = proposer.block_log_probs(7)
    proposer.cache.length -= 2  # the same step again, eagerly
    proposer.pending, proposer.compiled = features[:2], None
    torch.testing.assert_close(compiled_logp, proposer.block_log_probs(7), atol=1e-4, rtol=1e-4)
