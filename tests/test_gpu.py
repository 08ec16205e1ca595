"""The CUDA paths: decoding with both drafters on the GPU (fp32 and bf16 targets, static and dynamic trees) and a bf16
training run of each drafter. Skipped without CUDA (CI never has a GPU).

What is asserted is what holds: in fp32 the output equals the target's greedy output token for token; in bf16 it
equals it, or differs first where the target's own logits put the two tokens within a few bf16 steps of each other
(a near-tie: the tree's forward over several nodes and greedy's over one round differently, so it can flip; a bug
would give a wide margin)."""

import json
import math

import pytest
import torch

from medusa_like.decoding.tree import DynamicTreeSpec
from medusa_like.drafters.eagle3 import Eagle3Config, Eagle3Drafter
from medusa_like.model import MedusaLikeModel

from .conftest import random_heads, random_prompts, tiny_target

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

NEAR_TIE_STEPS = 4  # the widest margin at a first difference, in steps of the dtype at the row's largest logit


def cuda_greedy(target, prompt, n: int) -> list[int]:
    out = target.generate(
        prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=n, min_new_tokens=n, do_sample=False
    )
    return out[0, prompt.shape[1] :].tolist()


@torch.inference_mode()
def assert_greedy_or_near_tie(target, prompt: torch.Tensor, ours: list[int], reference: list[int]) -> None:
    """fp32: `ours` equals greedy's `reference` token for token. Lower precision: equal, or at the first difference
    the target's logits after the prompt and the common prefix (one full forward) give the reference's token and ours
    within NEAR_TIE_STEPS steps of the dtype (its spacing at the row's largest logit)."""
    if target.dtype == torch.float32 or ours == reference:
        assert ours == reference
        return
    assert len(ours) == len(reference), (ours, reference)  # eos_token_id=[]: both run to max_new_tokens
    index = next(i for i, (a, b) in enumerate(zip(ours, reference, strict=True)) if a != b)
    ids = torch.cat([prompt[0], torch.tensor(reference[:index], dtype=torch.long, device=prompt.device)])[None]
    row = target(ids).logits[0, -1].float()  # [V]
    margin = float(row[reference[index]] - row[ours[index]])  # as the evaluation reports it
    step = torch.finfo(target.dtype).eps * 2 ** math.floor(math.log2(float(row.abs().max())))
    assert abs(margin) <= NEAR_TIE_STEPS * step, (index, margin, step, ours, reference)


@pytest.fixture
def true_fp32(monkeypatch):
    """fp32 products in fp32: no TF32, whatever a library or an earlier test set."""
    monkeypatch.setattr(torch.backends.cuda.matmul, "allow_tf32", False)
    monkeypatch.setattr(torch.backends.cudnn, "allow_tf32", False)


def eagle3_drafter(target, seed: int = 0) -> Eagle3Drafter:
    torch.manual_seed(seed)
    drafter = Eagle3Drafter(Eagle3Config.for_target(target.config, target.config.vocab_size))
    for p in drafter.parameters():
        torch.nn.init.normal_(p, std=0.3)
    return drafter


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("family", ["llama", "qwen2", "gemma3"])
@pytest.mark.parametrize("kind", ["medusa", "eagle3"])
def test_lossless_on_cuda(family, kind, dtype, true_fp32):
    target = tiny_target(family).to("cuda", dtype)
    drafter = random_heads() if kind == "medusa" else eagle3_drafter(target)
    model = MedusaLikeModel(target, None, drafter, backend="sdpa")
    for prompt in random_prompts(6, seed=3):
        prompt = prompt.cuda()
        expected = cuda_greedy(target, prompt, 20)
        for tree in ("small", DynamicTreeSpec(4, 3, 10)):
            out = model.generate(prompt, max_new_tokens=20, tree=tree, eos_token_id=[])
            assert_greedy_or_near_tie(target, prompt, out.new_tokens.tolist(), expected)


@pytest.mark.parametrize("drafter", ["medusa", "eagle3"])
def test_bf16_training_on_cuda(drafter, tmp_path, train_cfg):
    from train.train import train

    chats = tmp_path / "chats.jsonl"
    rows = [
        {
            "id": str(i),
            "messages": [
                {"role": "user", "content": f"Count to {i}."},
                {"role": "assistant", "content": " ".join(map(str, range(i + 3)))},
            ],
        }
        for i in range(24)
    ]
    chats.write_text("\n".join(json.dumps(r) for r in rows))
    cfg = train_cfg(
        "data=local",
        f"data.source={chats}",
        "data.recipe=original",
        "data.val_fraction=0.25",
        f"drafter={drafter}",
        "trainer=gpu",
        "trainer.precision=bf16-mixed",
        "trainer.max_epochs=2",
    )
    metrics = train(cfg)
    assert (tmp_path / "drafter" / "model.safetensors").is_file()
    keys = [f"val/loss_head{k}" for k in range(1, 5)] if drafter == "medusa" else ["val/loss_depth1", "val/loss"]
    keys += ["val/acc_top1_head1" if drafter == "medusa" else "val/acc_top1_depth1"]
    for key in keys:  # named metrics: an empty or renamed metrics dict fails here
        assert key in metrics and math.isfinite(metrics[key]), (key, sorted(metrics))
    assert 0 <= metrics[keys[-1]] <= 1 and metrics[keys[0]] > 0
