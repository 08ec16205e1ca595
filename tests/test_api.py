"""The public API: what `import medusa_like` gives, and what it must not pull in."""

import subprocess
import sys

import pytest

import medusa_like


def test_the_main_names_are_exported_and_work():
    from medusa_like import DynamicTreeSpec, MedusaLikeModel, TokenTree, load_drafter

    assert {"MedusaLikeModel", "Eagle3Drafter", "MedusaHeads", "speculative_generate", "load_drafter"} <= set(
        medusa_like.__all__
    )
    for name in medusa_like.__all__:  # each name is the package's own object, not a stray re-export
        assert getattr(medusa_like, name).__module__.startswith("medusa_like."), name
    assert TokenTree.from_paths([[0], [1], [0, 0]]).num_nodes == 4
    assert DynamicTreeSpec(depth=3, top_k=2, num_nodes=5).max_depth == 3
    with pytest.raises(FileNotFoundError, match="no_such_drafter"):
        load_drafter("no_such_drafter", None)
    assert callable(MedusaLikeModel.from_pretrained)


@pytest.mark.slow
def test_importing_the_package_does_not_import_training_data_or_config_libraries():
    code = (
        "import sys, medusa_like; "
        "print(sorted(m for m in ('lightning', 'datasets', 'hydra', 'omegaconf', 'wandb') if m in sys.modules))"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert done.stdout.strip() == "[]"
