"""Train a drafter on a frozen target with Lightning (Hydra app); exports it to <run dir>/drafter at the end.

    python -m train.train experiment=smollm2_eagle3                # the default experiment (builds its data first)
    python -m train.train experiment=smollm2_medusa                # Medusa heads on self-distilled answers
    python -m train.train model=tiny_llama data=tiny debug=fdr      # a fast dev run on a tiny random model
    python -m train.train trainer=ddp trainer.devices=8 ckpt_path=last

The work is `medusa_like.apps.train` (installed as `medusa-train`; `train(cfg)` is importable from there); this file
keeps the command working from the checkout.
"""

from medusa_like.apps.train import main, train

__all__ = ["main", "train"]

if __name__ == "__main__":
    main()
