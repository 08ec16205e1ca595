"""Benchmarks of speed, and the analyses of training runs and evaluation reports: one function each, run by name with
`python -m eval.bench <name> [options]` (`command_line.py`, the table in docs/benchmarks.md), sharing one setup, one
timing loop and one output (`harness.py`).

A package of the checkout beside `train/` and `eval/`, not of the wheel: it imports the library (`medusa_like`), and
the library never imports it."""
