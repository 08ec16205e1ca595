"""vLLM serves our EAGLE-3, Medusa and block (DFlash) exports: a tiny target and a drafter trained here, exported with
`format=eagle3` (Medusa heads with `format=vllm`, a block drafter with `format=dflash`), loaded and run by vLLM's CPU
build in its own environment (`make vllm-install`).
Greedy with the drafter equals vLLM's greedy without it (and transformers' greedy), some drafts are accepted, and a
drafter exported for another target is refused before vLLM sees it. The vLLM tests skip, with the reason, where vLLM is not installed; the refusal runs everywhere."""

import lightning as L
import pytest
import torch
from torch.utils.data import DataLoader

from medusa_like.data import generation, storage
from medusa_like.decoding.generate import speculative_generate
from medusa_like.decoding.tree_files import resolve_tree
from medusa_like.drafters.base import DrafterMismatchError
from medusa_like.drafters.medusa import HeadsConfig, MedusaHeads
from medusa_like.drafters.vocab import DraftVocab
from medusa_like.engines.vllm.driver import VllmEngine, check_export, eagle3, ngram, unavailable_reason
from medusa_like.formats import export_drafter
from medusa_like.formats.common import FormatError
from medusa_like.formats.eagle3 import write_eagle3
from medusa_like.tiny import tiny_chat_target, tiny_model
from medusa_like.training.block_module import BlockModule
from medusa_like.training.eagle3_module import Eagle3Module
from medusa_like.training.medusa_module import MedusaHeadsModule

from .conftest import VOCAB, greedy_rows, random_prompts, stock_greedy
from .test_distill import conversations

NEW_TOKENS = 24
needs_vllm = pytest.mark.skipif(unavailable_reason() is not None, reason=f"vLLM: {unavailable_reason()}")


def vllm_target(num_layers: int = 8, seed: int = 0):
    """A tiny llama in shapes vLLM's CPU attention takes (head size 32), its logits scaled x20: nearly deterministic
    (no near-ties between two engines' arithmetic), its greedy text falls into loops a drafter can learn."""
    target = tiny_model(
        "llama", VOCAB, seed, hidden_size=64, num_hidden_layers=num_layers, num_attention_heads=2,
        num_key_value_heads=1, head_dim=32, intermediate_size=128, tie_word_embeddings=False,
    )  # fmt: skip
    with torch.no_grad():
        target.get_output_embeddings().weight.mul_(20)
    return target


def fit(module, target, steps: int) -> None:
    """`module` trained for `steps` steps on the target's greedy continuations of 32 random prompts, on the CPU."""
    trainer = L.Trainer(
        max_steps=steps, accelerator="cpu", logger=False, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False,
    )  # fmt: skip
    trainer.fit(module, DataLoader(greedy_rows(target, 32, seed=0), batch_size=8, shuffle=True))


def trained_drafter(target, steps: int = 80):
    """An EAGLE-3 drafter trained for `steps` AdamW steps on the target's greedy continuations of random prompts."""
    torch.manual_seed(0)
    module = Eagle3Module(
        target, DraftVocab.full(VOCAB), "tiny_llama", optimizer=lambda p: torch.optim.AdamW(p, lr=1e-2), ttt_steps=3
    )
    fit(module, target, steps)
    return module.drafter.eval()


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """(target, drafter, target directory, export directory)."""
    root = tmp_path_factory.mktemp("vllm")
    target = vllm_target()
    drafter = trained_drafter(target)
    target.save_pretrained(root / "target", safe_serialization=True)
    export = write_eagle3(drafter, root / "eagle3", "eagle3", target, "tiny_llama")
    return target, drafter, root / "target", export


def transformers_greedy(target_dir, prompts) -> list[list[int]]:
    """transformers' own greedy on the target loaded again from the files vLLM serves (untouched: the fixture's object
    trained the drafter)."""
    from transformers import AutoModelForCausalLM

    loaded = AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32).eval()
    return stock_greedy(loaded, prompts, NEW_TOKENS)


def framework_chain_counts(target, drafter, prompts, depth: int) -> tuple[int, list[int], list[int]]:
    """This framework with a chain of `depth`, counted as vLLM counts `drafts` and `accepted_per_pos`: its draft
    steps; per draft position, the steps that accepted it; and per position, the prompts whose last step accepted it."""
    chain = resolve_tree([[0] * (i + 1) for i in range(depth)], None)
    accepted, last = [], []
    for prompt in prompts:
        out = speculative_generate(target, drafter.proposer(target), prompt, chain, NEW_TOKENS)
        accepted += out.stats.accepted_draft
        last.append(out.stats.accepted_draft[-1])
    per_position = [sum(n > i for n in accepted) for i in range(depth)]
    return len(accepted), per_position, [sum(n > i for n in last) for i in range(depth)]


def assert_drafts_as_ours(counters: dict, target, drafter, prompts, depth: int) -> None:
    """vLLM's speculative counters (`drafts`, `accepted_per_pos`) are this framework's for the same drafter and a
    chain of `depth` on the same prompts, within the one step a prompt may differ by (see the EAGLE-3 test)."""
    steps, accepted, last = framework_chain_counts(target, drafter, prompts, depth)
    drafts, theirs = counters["drafts"], counters["accepted_per_pos"]
    assert steps - len(prompts) <= drafts <= steps, (drafts, steps)
    assert all(a - n <= t <= a for t, a, n in zip(theirs, accepted, last, strict=True)), (theirs, accepted, last)


def plain_and_speculative(target_dir, prompts, speculative: dict) -> tuple[list, list, dict]:
    """vLLM's greedy tokens for `prompts` without a drafter and with `speculative`, and the latter's counters."""
    ids = [p[0].tolist() for p in prompts]
    with VllmEngine(target_dir, tokenizer=False) as engine:
        plain = engine.generate(ids, NEW_TOKENS, ignore_eos=True)
    with VllmEngine(target_dir, speculative=speculative, tokenizer=False) as engine:
        spec = engine.generate(ids, NEW_TOKENS, ignore_eos=True)
    return [o["token_ids"] for o in plain.outputs], [o["token_ids"] for o in spec.outputs], spec.spec


@pytest.mark.slow
@needs_vllm
def test_vllm_serves_the_export_losslessly_and_accepts_its_drafts(served):
    target, drafter, target_dir, export = served
    check_export(export, target)
    prompts = random_prompts(8, seed=123, min_len=4, max_len=12)  # not the training prompts
    ids = [p[0].tolist() for p in prompts]
    expected = transformers_greedy(target_dir, prompts)

    with VllmEngine(target_dir, tokenizer=False) as engine:
        plain = engine.generate(ids, NEW_TOKENS, ignore_eos=True)
    with VllmEngine(target_dir, speculative=eagle3(export, 2), tokenizer=False) as engine:
        spec = engine.generate(ids, NEW_TOKENS, ignore_eos=True)

    plain_tokens = [o["token_ids"] for o in plain.outputs]
    assert [o["token_ids"] for o in spec.outputs] == plain_tokens  # lossless in vLLM
    assert plain_tokens == expected  # and the same text as transformers' greedy
    assert spec.spec["drafts"] > 0 and spec.spec["accepted"] > 0, spec.spec
    assert plain.spec["drafts"] == 0
    # The same drafter drafts the same chains in both engines, step for step: both decode the same greedy tokens
    # (asserted above), and the drafter, fed the same target layers in fp32, picks the same top-1 draft from the same
    # context (a near-tie that the engines' arithmetic flipped would fail this, every run of one setup alike). Both
    # count a step's accepted drafts before cutting the output at NEW_TOKENS (vLLM's scheduler: len(sampled) - 1
    # before its stop check; ours: accepted_draft before `del generated[max_new_tokens:]`). The one step that may
    # differ is each prompt's last: we draft a full chain there, while a vLLM version may draft only the tokens left
    # (or none, then it counts no draft step), so vLLM counts at most one draft step fewer per prompt, and per position
    # at most the prompts whose last step accepted that position fewer, never more.
    assert_drafts_as_ours(spec.spec, target, drafter, prompts, 2)


def trained_heads(target, steps: int = 80) -> MedusaHeads:
    """Two Medusa heads trained for `steps` AdamW steps on the target's greedy continuations of random prompts."""
    torch.manual_seed(0)
    config = HeadsConfig(target.config.hidden_size, VOCAB, num_heads=2)
    module = MedusaHeadsModule(target, config, "tiny_llama", optimizer=lambda p: torch.optim.AdamW(p, lr=1e-2))
    fit(module, target, steps)
    return module.heads.eval()


@pytest.mark.slow
@needs_vllm
def test_vllm_serves_our_medusa_export_with_plain_decodings_tokens_and_accepts_its_drafts(served, tmp_path):
    """Medusa heads exported in vLLM's layout (`format=vllm`), drafting two tokens in vLLM: its plain decoding's
    tokens, which are transformers' greedy, and drafts accepted (the layout alone is checked in tests/test_export.py)."""
    target, _, target_dir, _ = served
    export = export_drafter(trained_heads(target), tmp_path / "medusa", "vllm", target, "tiny_llama")
    prompts = random_prompts(8, seed=123, min_len=4, max_len=12)
    medusa = {"method": "medusa", "model": str(export), "num_speculative_tokens": 2}
    plain, drafted, spec = plain_and_speculative(target_dir, prompts, medusa)
    assert drafted == plain
    assert plain == transformers_greedy(target_dir, prompts)
    assert spec["drafts"] > 0 and spec["accepted"] > 0, spec


def trained_block_drafter(target, steps: int = 80):
    """A block drafter (blocks of 4: the root and three drafted positions) trained for `steps` AdamW steps on the
    target's greedy continuations of random prompts."""
    torch.manual_seed(0)
    module = BlockModule(
        target, DraftVocab.full(VOCAB), "tiny_llama", optimizer=lambda p: torch.optim.AdamW(p, lr=1e-2), block_size=4,
        anchors=8,
    )  # fmt: skip
    fit(module, target, steps)
    return module.drafter.eval()


@pytest.mark.slow
@needs_vllm
def test_vllm_serves_our_dflash_export_with_plain_decodings_tokens_and_accepts_its_drafts(served, tmp_path):
    """A block drafter exported in the layout vLLM loads for DFlash drafters (`format=dflash`), drafting its block's
    three positions in vLLM: its plain decoding's tokens, which are transformers' greedy, and drafts accepted."""
    target, _, target_dir, _ = served
    drafter = trained_block_drafter(target)
    export = export_drafter(drafter, tmp_path / "dflash", "dflash", target, "tiny_llama")
    prompts = random_prompts(8, seed=123, min_len=4, max_len=12)
    dflash = {"method": "dflash", "model": str(export), "num_speculative_tokens": 3}
    plain, drafted, spec = plain_and_speculative(target_dir, prompts, dflash)
    assert drafted == plain
    assert plain == transformers_greedy(target_dir, prompts)
    assert spec["drafts"] > 0 and spec["accepted"] > 0, spec
    # vLLM drafts what this framework drafts from the same block: its chain of 3 accepted position for position as ours
    assert_drafts_as_ours(spec, target, drafter, prompts, 3)


@pytest.mark.slow
@needs_vllm
def test_vllm_ngram_speculation_is_lossless_on_the_same_target(served):
    _, _, target_dir, _ = served
    prompts = random_prompts(4, seed=7, min_len=4, max_len=12)
    with VllmEngine(target_dir, speculative=ngram(3), tokenizer=False) as engine:
        out = engine.generate([p[0].tolist() for p in prompts], NEW_TOKENS, ignore_eos=True)
    assert [o["token_ids"] for o in out.outputs] == transformers_greedy(target_dir, prompts)


def test_a_drafter_exported_for_another_target_is_refused_before_vllm_sees_it(tmp_path):
    target, other = vllm_target(num_layers=8), vllm_target(num_layers=10)  # same widths and vocabulary
    drafter = trained_drafter(target, steps=1)
    export = write_eagle3(drafter, tmp_path / "eagle3", "eagle3", target, "tiny_llama")
    check_export(export, target)
    with pytest.raises(DrafterMismatchError, match="fingerprint"):
        check_export(export, other)
    native = write_eagle3(drafter, tmp_path / "native", "native", target, "tiny_llama")
    with pytest.raises(FormatError, match="format=eagle3"):
        check_export(native, target)


# ---------------------------------------------------------------------------------------------------------------------
# vLLM as the data engine (`distill.engine=vllm`)

GREEDY = generation.GenerationConfig(temperature=0.0, max_new_tokens=12, max_prompt_tokens=64, max_length=256)


@pytest.mark.slow
@needs_vllm
def test_distilling_through_vllm_stores_transformers_greedy_answers_and_resumes(tmp_path):
    model, tokenizer = tiny_chat_target(
        "llama", hidden_size=64, num_attention_heads=2, num_key_value_heads=1, tie_word_embeddings=False
    )
    with torch.no_grad():
        model.get_output_embeddings().weight.mul_(20)  # no near-ties between the two engines' arithmetic
    convs = conversations(6)
    common = dict(batch_size=4, chunk_size=4, progress=False)
    generation.run(model, tokenizer, convs, tmp_path / "hf", GREEDY, **common)
    sampled = generation.GenerationConfig(temperature=0.8, max_new_tokens=12, max_prompt_tokens=64, max_length=256)
    model.save_pretrained(tmp_path / "target")
    tokenizer.save_pretrained(tmp_path / "target")
    with VllmEngine(tmp_path / "target", max_model_len=256) as engine:
        vllm = dict(generator=generation.vllm_generator(engine), engine="vllm", **common)
        assert generation.run(model, tokenizer, convs, tmp_path / "v", GREEDY, max_chunks=1, **vllm) is None
        assert generation.run(model, tokenizer, convs, tmp_path / "v", GREEDY, **vllm) == tmp_path / "v" / "dataset"
        for name in ("s1", "s2"):  # seeded per chunk and batch: a resumed chunk samples what it did
            generation.run(model, tokenizer, convs, tmp_path / name, sampled, **vllm)
    hf, vl = storage.load_distilled(tmp_path / "hf"), storage.load_distilled(tmp_path / "v")
    assert vl["input_ids"] == hf["input_ids"] and vl["loss_mask"] == hf["loss_mask"]
    s1, s2 = storage.load_distilled(tmp_path / "s1"), storage.load_distilled(tmp_path / "s2")
    assert s1["input_ids"] == s2["input_ids"] and s1["input_ids"] != hf["input_ids"]
    with pytest.raises(ValueError, match="recipe"):  # one directory, one engine
        generation.run(
            model, tokenizer, convs, tmp_path / "hf", GREEDY, generator=lambda *a: [], engine="vllm", **common
        )
