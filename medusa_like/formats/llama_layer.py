"""Whether an EAGLE-3 drafter's layer has the Llama shape that serving engines load (vLLM, SGLang, llama.cpp).

The engines build the draft layer as a Llama decoder layer (`midlayer.*`, q/k/v reading [embedding; feature]); a
drafter of another family exports only natively. One rule, used by every engine export (`eagle3.py`, `gguf.py`).
"""

from medusa_like.drafters.eagle3 import Eagle3Drafter

LAYER_PARTS = ("self_attn.", "mlp.", "input_layernorm.", "hidden_norm.", "post_attention_layernorm.")
LLAMA_LAYER = {
    "self_attn.q_proj.weight",
    "self_attn.k_proj.weight",
    "self_attn.v_proj.weight",
    "self_attn.o_proj.weight",
    "mlp.gate_proj.weight",
    "mlp.up_proj.weight",
    "mlp.down_proj.weight",
    "input_layernorm.weight",
    "hidden_norm.weight",
    "post_attention_layernorm.weight",
}


def llama_refusal(drafter: Eagle3Drafter) -> str | None:
    """Why the engines' Llama-shaped EAGLE-3 layer cannot hold this drafter, or None when it can."""
    layer = drafter.config.layer
    if drafter.config.norm_aux:
        return "it normalises each captured state before fc (EAGLE-3.1, drafter.module.norm_aux), which the engines' layer does not"
    names = {name for name in drafter.state_dict() if name.startswith(LAYER_PARTS)}
    if layer.get("model_type") not in ("llama", "qwen2", "mistral", "qwen3"):
        extra = sorted(names - LLAMA_LAYER)
        return (
            f"its layer is a {layer.get('model_type')} layer"
            + (f" with tensors the Llama layer lacks ({', '.join(extra)})" if extra else "")
            + " and other norms than Llama's"
        )
    if names != LLAMA_LAYER:
        return f"its layer's tensors differ from the Llama layer's: {sorted(names ^ LLAMA_LAYER)}"
    if layer.get("hidden_act", "silu") != "silu":
        return f"its MLP uses {layer.get('hidden_act')!r}, the engines' Llama layer SiLU"
    if layer.get("attention_bias") or layer.get("mlp_bias"):
        return "its attention or MLP has biases, which the engines' Llama layer does not load"
    return None
