"""Every benchmark of speed, and the analyses of runs and reports, by name: `python -m eval.bench <name> [options]`.

    python -m eval.bench                              # the list
    python -m eval.bench verify --help                # one benchmark's options
    python -m eval.bench core --drafter runs/make_run/train/drafter
    python -m eval.bench learning_curve runs/curve/train

Each prints its tables and writes its figures as JSON (`--out`); docs/benchmarks.md says what each measures. The work
is the checkout's `benchmarks` package (one module per benchmark, the shared setup and timing loop in `harness.py`).
"""

from benchmarks.command_line import main

if __name__ == "__main__":
    main()
