"""medusa_like: self-speculative decoding with trainable draft models, lossless on any Hugging Face causal LM.

    from medusa_like import MedusaLikeModel

    model = MedusaLikeModel.from_pretrained("smollm2-135m-instruct", drafter="runs/<run>/drafter")
    out = model.generate(model.chat_ids([{"role": "user", "content": "Hi!"}]), max_new_tokens=128)

Importing the package loads the inference core only (torch, transformers, safetensors): training (Lightning),
data (datasets) and configs (Hydra) are imported by their own modules when used.
"""

from medusa_like.decoding.draft_tree import DraftTree
from medusa_like.decoding.generate import DecodeStats, GenerateOutput, speculative_generate
from medusa_like.decoding.tree import DynamicTreeSpec, InvalidTreeError, TokenTree
from medusa_like.drafters.base import DrafterMismatchError, check_fits
from medusa_like.drafters.eagle3 import Eagle3Config, Eagle3Drafter, Eagle3Proposer
from medusa_like.drafters.medusa import HeadsConfig, MedusaHeads, MedusaProposer
from medusa_like.drafters.protocol import Proposer
from medusa_like.drafters.vocab import DraftVocab
from medusa_like.formats import export_drafter, load_drafter, read_drafter, save_drafter
from medusa_like.model import MedusaLikeModel

__all__ = [
    "MedusaLikeModel",
    "MedusaHeads",
    "HeadsConfig",
    "Eagle3Drafter",
    "Eagle3Config",
    "DraftVocab",
    "Proposer",
    "MedusaProposer",
    "Eagle3Proposer",
    "TokenTree",
    "DynamicTreeSpec",
    "DraftTree",
    "InvalidTreeError",
    "speculative_generate",
    "GenerateOutput",
    "DecodeStats",
    "load_drafter",
    "read_drafter",
    "save_drafter",
    "export_drafter",
    "check_fits",
    "DrafterMismatchError",
]
