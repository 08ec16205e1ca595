"""Training rows from conversations: the chat template's token ids and a loss mask on the assistant's tokens."""


def build_sample(tokenizer, messages: list[dict], finished: list[bool]) -> tuple[list[int], list[int]]:
    """Tokenise a conversation with the chat template; the mask covers each answer and, if it finished, its end token."""
    text = render(tokenizer, messages)
    enc = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    offsets = enc["offset_mapping"]
    mask = [0] * len(offsets)
    cursor, answer = 0, 0
    for i, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        start, end = _locate(
            text, render(tokenizer, messages[:i], add_generation_prompt=True), message["content"], cursor
        )
        cursor = end
        inside = [j for j, (s, _) in enumerate(offsets) if start <= s < end]
        for j in inside:
            mask[j] = 1
        if finished[answer]:
            after = next((j for j, (s, e) in enumerate(offsets) if s >= end and e > s), None)
            if after is not None:
                mask[after] = 1
        answer += 1
    return list(enc["input_ids"]), mask


def render(tokenizer, messages: list[dict], add_generation_prompt: bool = False) -> str:
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError(
            f"tokenizer {tokenizer.name_or_path!r} has no chat template: self-distillation must use the target's own "
            f"template (set model.chat_template in the model config)"
        )
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)


def _locate(text: str, prefix: str, content: str, cursor: int) -> tuple[int, int]:
    """Character span of an answer in the rendered conversation."""
    if text.startswith(prefix) and text.startswith(content, len(prefix)):
        return len(prefix), len(prefix) + len(content)
    for needle in (content, content.strip()):  # some templates trim the content
        start = text.find(needle, cursor)
        if start >= 0:
            return start, start + len(needle)
    raise ValueError(f"answer {content[:60]!r} not found in the rendered conversation: the chat template rewrites it")
