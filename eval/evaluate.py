"""Evaluation: tau, honest speed against strong baselines, and losslessness, on any MT-Bench-form question set.

    python -m eval.evaluate data.path=/path/to/mt_bench_question.jsonl drafter.path=runs/<run>/drafter
    python -m eval.evaluate data.source=humaneval data.limit=20 drafter.path=... tree=trees/t.json
    python -m eval.evaluate data.source=validation drafter.path=... tree=auto eval.max_new_tokens=64

Every turn of every question is one prompt (turn n carries the reference's answers to turns 1..n-1). Per prompt, after
one untimed warm-up pass, the methods run interleaved, in an order rotated from prompt to prompt:

    hf_greedy         (a) transformers `generate`, do_sample=False
    hf_prompt_lookup  (b) transformers prompt-lookup decoding (`prompt_lookup_num_tokens`)
    plain_loop        (c) this project's loop without a drafter (tree "none": same KV cache and attention backend)
    speculative       (d) this project's speculative decoding with the drafter and `tree`
    learned, lookup   (e), (f) a combined drafter's learned drafter alone and lookup alone
    hf_greedy_stock   (g) (a) with the target's stock nn.Linear layers (the others share the few-row layers)

all with the same max_new_tokens and EOS ids. (a) is the reference: (d) must reproduce it token for token. Each prompt's
result is appended to `prompts.jsonl` as soon as it is measured, so a killed run keeps what it did and continues with
`eval.resume=true`; a prompt too long for the target's context is recorded as skipped. Then Medusa heads' top-k
accuracy is measured teacher-forced over (a)'s answers, and tau / tokens/s are swept over tree sizes. `report.json`,
`report.md` and PNG plots land in the run directory; definitions are in `medusa_like.evaluation.metrics`. Exit status
1 when `eval.fail_on_mismatch` and some output differs from (a).

The work is `medusa_like.apps.evaluate` (installed as `medusa-evaluate`); this file keeps the command working from the
checkout.
"""

from medusa_like.apps.evaluate import METHODS, evaluate, exit_code, main

__all__ = ["METHODS", "evaluate", "exit_code", "main"]

if __name__ == "__main__":
    main()
