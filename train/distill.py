"""Build a training dataset with the target (Hydra app): self-distilled answers, or the conversations' own text.

    python -m train.distill                                    # the default experiment's data
    python -m train.distill experiment=smollm2_medusa_full distill.shard=0 distill.num_shards=4
    python -m train.distill data=local data.source=my_chats.jsonl data.generation.temperature=0

Running the same command again resumes; the last shard to finish combines all chunks into ${data.dir}/dataset. The
work is `medusa_like.apps.distill` (installed as `medusa-distill`); this file keeps the command working from the
checkout.
"""

from medusa_like.apps.distill import distill, main

__all__ = ["distill", "main"]

if __name__ == "__main__":
    main()
