"""medusa_like: self-speculative decoding with trainable draft models, lossless on any Hugging Face causal LM.

    from medusa_like import MedusaLikeModel

    model = MedusaLikeModel.from_pretrained("smollm2-135m-instruct", drafter="runs/<run>/drafter")
    out = model.generate(model.chat_ids([{"role": "user", "content": "Hi!"}]), max_new_tokens=128)

Importing the package loads the inference core only (torch, transformers, safetensors): training (Lightning),
data (datasets) and configs (Hydra) are imported by their own modules when used. What a user needs is here; the
protocols' internals (`Proposer`, `DraftTree`, the kinds' registry) stay importable from their modules.
"""

from medusa_like.decoding.cost_model import CostModel
from medusa_like.decoding.generate import DecodeStats, GenerateOutput, speculative_generate
from medusa_like.decoding.kv_cache import CacheOverflowError
from medusa_like.decoding.tree import BudgetedTreeSpec, DynamicTreeSpec, InvalidTreeError, TokenTree
from medusa_like.decoding.tree_files import load_tree, save_tree
from medusa_like.drafters.base import DrafterMismatchError
from medusa_like.drafters.combined import CombinedDrafter
from medusa_like.drafters.eagle3 import Eagle3Config, Eagle3Drafter
from medusa_like.drafters.lookup import LookupDrafter
from medusa_like.drafters.lookup_sources import OutputStore
from medusa_like.drafters.medusa import HeadsConfig, MedusaHeads
from medusa_like.drafters.vocab import DraftVocab
from medusa_like.formats import export_drafter, load_drafter, read_drafter, save_drafter
from medusa_like.formats.common import FormatError
from medusa_like.model import MedusaLikeModel

__all__ = [
    "MedusaLikeModel",
    # drafters and their configs
    "Eagle3Drafter",
    "Eagle3Config",
    "MedusaHeads",
    "HeadsConfig",
    "LookupDrafter",
    "OutputStore",
    "CombinedDrafter",
    "DraftVocab",
    # trees
    "TokenTree",
    "DynamicTreeSpec",
    "BudgetedTreeSpec",
    "load_tree",
    "save_tree",
    "CostModel",
    # decoding and its output
    "speculative_generate",
    "GenerateOutput",
    "DecodeStats",
    # files
    "load_drafter",
    "read_drafter",
    "save_drafter",
    "export_drafter",
    # errors
    "InvalidTreeError",
    "DrafterMismatchError",
    "FormatError",
    "CacheOverflowError",
]
