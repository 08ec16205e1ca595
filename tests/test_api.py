"""The public API: what `import medusa_like` gives, and what it must not pull in."""

import subprocess
import sys

import medusa_like


def test_the_main_names_are_exported():
    from medusa_like import DynamicTreeSpec, Eagle3Drafter, MedusaHeads, MedusaLikeModel, TokenTree, load_drafter

    assert {"MedusaLikeModel", "Eagle3Drafter", "MedusaHeads", "speculative_generate", "load_drafter"} <= set(
        medusa_like.__all__
    )
    assert all(hasattr(medusa_like, name) for name in medusa_like.__all__)
    assert MedusaLikeModel and Eagle3Drafter and MedusaHeads and TokenTree and DynamicTreeSpec and load_drafter


def test_importing_the_package_does_not_import_training_data_or_config_libraries():
    code = (
        "import sys, medusa_like; "
        "print(sorted(m for m in ('lightning', 'datasets', 'hydra', 'omegaconf', 'wandb') if m in sys.modules))"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert done.stdout.strip() == "[]"
