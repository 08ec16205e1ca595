"""The row-invariant attention kernel of the compiled CPU step (forward/cpu/tree_attention.py): SDPA's result to
rounding, the bits of a node's one-node step in any tree (fp32 and bf16, head sizes from 8 to 256, grouped heads, any
committed length), and clear errors for inputs it does not take; and the eager step's `rows` backend over it, the
default of bf16 CPU targets, lossless where SDPA was not."""

import logging
import os
import time

import pytest
import torch
import torch.nn.functional as F

from benchmarks.attention import TREES, drifting_rows, tree_inputs
from medusa_like.decoding.step import EagerStep
from medusa_like.decoding.tree import BudgetedTreeSpec
from medusa_like.decoding.tree_files import resolve_tree
from medusa_like.drafters.lookup import LookupDrafter
from medusa_like.forward import prepare_target
from medusa_like.forward.cpu import extension, fp32_linear, tree_attention
from medusa_like.forward.cpu.few_row_linear import DOT, bf16_pack
from medusa_like.model import MedusaLikeModel

from .conftest import (
    VOCAB,
    assert_greedy_or_near_tie,
    random_heads,
    random_prompts,
    stock_greedy,
    tiny_target,
    untouched_target,
)

pytestmark = pytest.mark.skipif(tree_attention.unavailable() is not None, reason=f"{tree_attention.unavailable()}")


# bf16 products give a row the same bits at any row count on the dot-product kernel, which the few-row layers run where
# the CPU has AVX512-BF16, and fp32 ones on the fp32 kernel (AVX2 or AVX512): there the eager step is exact; elsewhere only
# its attention is row-invariant
ROW_INVARIANT_BF16 = bf16_pack(torch.zeros(1, dtype=torch.bfloat16)) == DOT
ROW_INVARIANT = {torch.bfloat16: ROW_INVARIANT_BF16, torch.float32: fp32_linear.unavailable() is None}


def attend(query, key, value, visible, scale):
    return torch.ops.medusa_like.tree_attention(query, key, value, visible, scale)


@pytest.mark.parametrize("dim", [8, 64, 72, 128, 256])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_it_computes_sdpa_to_rounding(dim, dtype):
    query, key, value, visible, _ = tree_inputs(TREES["mixed, 12 nodes"], 37, heads=6, kv_heads=2, dim=dim, dtype=dtype)
    out = attend(query, key, value, visible, dim**-0.5)
    assert out.dtype == dtype and out.shape == query.shape and out.is_contiguous()
    expected = F.scaled_dot_product_attention(
        query.float(), key.float(), value.float(), attn_mask=visible, scale=dim**-0.5, enable_gqa=True
    )
    tolerance = 1e-5 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(out.float(), expected, atol=tolerance, rtol=tolerance)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("committed", [5, 64, 301])
@pytest.mark.parametrize("tree", list(TREES))
def test_a_tree_row_gets_the_bits_of_its_one_node_step(tree, committed, dtype):
    """Each node of a tree step against the same node computed as greedy decoding computes it: its ancestors
    committed in consecutive slots, then the node and a dummy row that sees only itself (the compiled step's padding;
    `drifting_rows`, whose own test shows it catches a row-count dependence). SDPA changes some of these rows
    (docs/cpu-kernels.md); the kernel changes none."""
    assert drifting_rows(attend, TREES[tree], committed, 9, 3, 64, dtype) == 0


def test_a_row_does_not_depend_on_the_thread_count():
    query, key, value, visible, _ = tree_inputs(TREES["mixed, 12 nodes"], 200, heads=9, kv_heads=3, dim=64,
                                              dtype=torch.bfloat16)  # fmt: skip
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = attend(query, key, value, visible, 0.125)
        torch.set_num_threads(2)
        two = attend(query, key, value, visible, 0.125)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(one, two)


def test_the_build_is_kept_under_its_key_in_the_user_cache():
    from medusa_like.io import user_cache_dir

    directory = tree_attention.KERNEL.directory()
    assert directory.parent == user_cache_dir() / "kernels" and directory.name.startswith("tree_attention-")
    assert len(list(directory.glob("*.so"))) == 1


def test_a_lock_left_by_a_killed_build_is_removed_and_a_live_one_kept(tmp_path, caplog):
    lock = tmp_path / "lock"
    lock.touch()
    assert not extension.clear_stale_lock(tmp_path) and lock.exists()  # a build at work: waited for
    old = time.time() - extension.STALE_LOCK_SECONDS - 1
    os.utime(lock, (old, old))
    with caplog.at_level(logging.WARNING):
        assert extension.clear_stale_lock(tmp_path)
    assert not lock.exists() and "did not finish" in caplog.text
    assert not extension.clear_stale_lock(tmp_path)  # nothing left to remove


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_batch_gives_each_sequence_the_bits_it_gets_alone(dtype):
    """Two sequences of other committed lengths and trees in one call, the shorter padded (its extra rows see one
    key, its extra keys are junk it does not see): each sequence's rows are its own call's, bit for bit."""
    alone = [
        tree_inputs(TREES["mixed, 12 nodes"], 37, heads=6, kv_heads=2, dim=64, dtype=dtype),
        tree_inputs(TREES["chain of 4"], 10, heads=6, kv_heads=2, dim=64, dtype=dtype, seed=1),
    ]
    rows, keys = 12, 49
    query = torch.randn(2, 6, rows, 64).to(dtype)
    key, value = torch.randn(2, 2, keys, 64).to(dtype), torch.randn(2, 2, keys, 64).to(dtype)
    visible = torch.zeros(2, 1, rows, keys, dtype=torch.bool)
    visible[:, :, :, 0] = True
    for b, (q, k, v, seen, _) in enumerate(alone):
        query[b, :, : q.shape[2]], key[b, :, : k.shape[2]], value[b, :, : v.shape[2]] = q[0], k[0], v[0]
        visible[b, :, : seen.shape[2], : seen.shape[3]] = seen[0]
    out = attend(query, key, value, visible, 0.125)
    for b, (q, k, v, seen, _) in enumerate(alone):
        assert torch.equal(out[b : b + 1, :, : q.shape[2]], attend(q, k, v, seen, 0.125)), b


@pytest.mark.parametrize(
    "change, message",
    [
        (lambda q, k, v, m: (q.half(), k.half(), v.half(), m), "float32 or bfloat16"),
        (lambda q, k, v, m: (q, k.bfloat16(), v, m), "share a dtype"),
        (lambda q, k, v, m: (q, k, v, m.float()), "bool mask"),
        (lambda q, k, v, m: (q, k, v, m[..., :-1]), r"visible must be \[B, 1, T, S\]"),
        (lambda q, k, v, m: (q[:, :5], k, v, m), "multiple of key heads"),
        (lambda q, k, v, m: (q.expand(2, -1, -1, -1), k, v, m), "share the batch size"),
        (lambda q, k, v, m: (q, k, v[:, :, :-1], m), r"key and value must be \[B, H_kv, S, D\]"),
        (lambda q, k, v, m: (*(t.repeat(1, 1, 1, 4)[..., :200] for t in (q, k, v)), m), "head_dim 1..128 or 241..256"),
    ],
)  # fmt: skip
def test_inputs_it_does_not_take_are_refused_with_what_is_wrong(change, message):
    query, key, value, visible, _ = tree_inputs(TREES["chain of 4"], 10, heads=6, kv_heads=3, dim=64,
                                              dtype=torch.float32)  # fmt: skip
    with pytest.raises(RuntimeError, match=message):
        attend(*change(query, key, value, visible), 0.125)


def tree_and_alone(target, backend):
    """A small tree's step over a 13-token prompt on `target`'s eager step with attention `backend`: its logits
    [T, V], and the nodes whose logits are not bit for bit those of the node run alone after its ancestors, one token
    a step (what greedy decoding computes)."""
    tree = resolve_tree("small", 4)
    g = torch.Generator().manual_seed(4)
    prompt = torch.randint(0, VOCAB, (1, 13), generator=g)
    tokens = torch.randint(0, VOCAB, (tree.num_nodes,), generator=g)
    step = EagerStep(target, backend)
    cache = step.new_cache(13 + tree.num_nodes)
    differ = []
    with torch.inference_mode():
        step.forward(prompt, torch.arange(13)[None], None, cache, last=True)
        cache.commit_all(13)
        rows, _ = step.forward(tokens[None], (13 + tree.depth)[None], tree.attention_mask[None, None], cache)
        for node in range(tree.num_nodes):
            cache.rewind(13)
            ancestors = tree.attention_mask[node].nonzero().flatten().tolist()  # root to node
            for depth, index in enumerate(ancestors):
                alone, _ = step.forward(tokens[index].view(1, 1), torch.tensor([[13 + depth]]),
                                        torch.ones(1, 1, 1, 1, dtype=torch.bool), cache)  # fmt: skip
                cache.commit_all(1)
            if not torch.equal(alone[0], rows[node]):
                differ.append(node)
    return rows, differ


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("family", ["llama", "mistral"])  # mistral: a sliding window shorter than the prompt
def test_the_rows_backend_gives_sdpas_logits_to_rounding_and_each_row_its_one_node_bits(family, dtype):
    """The eager step of a bf16 or fp32 target (this machine's layers) with attention `rows`: a tree step's logits are
    SDPA's to rounding (tree mask, positions and sliding window as decoding/attention.py's contract says), and, where
    the products are row-invariant too (the bf16 or fp32 kernel runs), each node's are bit for bit those of the node
    run alone after its ancestors (what greedy decoding computes)."""
    overrides = {"sliding_window": 8} if family == "mistral" else {}
    target = prepare_target(tiny_target(family, **overrides).to(dtype), compile=False).target
    rows, differ = tree_and_alone(target, tree_attention.BACKEND)
    tolerance = 0.05 if dtype == torch.bfloat16 else 1e-5
    torch.testing.assert_close(rows.float(), tree_and_alone(target, "sdpa")[0].float(), atol=tolerance, rtol=tolerance)
    if ROW_INVARIANT[dtype]:
        assert differ == []


@pytest.mark.usefixtures("fp32_kernel_off")
def test_on_nn_linear_and_sdpa_an_fp32_tree_row_rounds_apart_from_its_one_node_step():
    """What the fp32 kernel and `rows` fix (the test above can fail): on nn.Linear and SDPA, as where the fp32 kernel
    does not run, some tree rows get other bits than their one-node steps."""
    target = prepare_target(tiny_target("llama", hidden_size=256, intermediate_size=512), compile=False).target
    assert not any(getattr(m, "fp32_kernel", False) for m in target.modules())
    _, differ = tree_and_alone(target, "sdpa")
    assert differ


@pytest.mark.skipif(not ROW_INVARIANT_BF16, reason="bf16 products on the dot-product kernel need AVX512-BF16")
def test_an_eager_bf16_target_attends_by_rows_and_its_trees_give_greedys_tokens(monkeypatch):
    """A bf16 CPU target's eager step (the Python API's default) attends by the kernel, so a tree row gets its
    one-node step's bits and tree methods equal greedy decoding on the same step: with SDPA, tree rows rounded apart
    and these trees left greedy's tokens (the same prompts, `backend="sdpa"`: the last assertion). That greedy
    decoding is transformers' own on an untouched bf16 copy, up to near-ties (two bf16 forwards round apart; a wrong
    kernel differs by whole logits). An fp32 target attends by the kernel too where the fp32 kernel runs (else SDPA),
    a bf16 one keeps SDPA where the kernel cannot be built, and a backend asked for is the one used."""
    shape = dict(hidden_size=256, num_attention_heads=4, num_key_value_heads=2, intermediate_size=256)
    target = tiny_target("llama", **shape).to(torch.bfloat16)
    prepared = prepare_target(target, compile=False)
    assert prepared.backend == tree_attention.BACKEND and prepared.step is prepared.eager
    prompts = random_prompts(8, seed=5, min_len=20, max_len=120)
    heads = random_heads(hidden=256)
    untouched = untouched_target("llama", dtype=torch.bfloat16, **shape)
    stock = stock_greedy(untouched, prompts, 40)

    def mismatches(backend) -> int:
        prepare_target(target, backend=backend)
        plain = MedusaLikeModel(prepared, None, heads)
        references = [plain.generate(p, max_new_tokens=40, tree="none", eos_token_id=[]).new_tokens for p in prompts]
        for prompt, reference, theirs in zip(prompts, references, stock, strict=True):
            assert_greedy_or_near_tie(untouched, prompt, reference.tolist(), theirs)
        differ = 0
        for drafter, tree in [(LookupDrafter(), BudgetedTreeSpec(None, 12, 8)), (heads, "medusa"), (heads, "chain")]:
            model = MedusaLikeModel(prepared, None, drafter)
            for prompt, reference in zip(prompts, references, strict=True):
                out = model.generate(prompt, max_new_tokens=40, tree=tree, eos_token_id=[], remember=False)
                differ += not torch.equal(out.new_tokens, reference)
        return differ

    assert mismatches("auto") == 0
    assert prepared.backend == tree_attention.BACKEND
    assert mismatches("sdpa") > 0 and prepared.backend == "sdpa"  # the check can fail: SDPA's rows drift
    fp32_backend = tree_attention.BACKEND if fp32_linear.unavailable() is None else "sdpa"  # rows with the fp32 kernel
    assert prepare_target(tiny_target("llama"), compile=False).backend == fp32_backend
    monkeypatch.setattr(tree_attention, "unavailable", lambda: "not built")  # where it cannot be built: SDPA
    assert prepare_target(tiny_target("llama").to(torch.bfloat16), compile=False).backend == "sdpa"
