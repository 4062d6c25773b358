"""Tiny random models for tests: sharp logits (large init scale) so rounding cannot flip a greedy argmax."""

from __future__ import annotations

import torch
from transformers import AutoModelForCausalLM, LlamaConfig, MistralConfig, Qwen2Config

from triforce.model.config import ModelConfig
from triforce.model.transformer import Transformer


def hf_config(family: str = "llama", vocab: int = 96, hidden: int = 64, layers: int = 2, heads: int = 4,
              kv_heads: int = 2, max_pos: int = 512, rope: dict | None = None, tie: bool = False, init: float = 0.25,
              **extra):
    cls = {"llama": LlamaConfig, "mistral": MistralConfig, "qwen2": Qwen2Config}[family]
    kw = dict(vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
              num_attention_heads=heads, num_key_value_heads=kv_heads, max_position_embeddings=max_pos,
              initializer_range=init, tie_word_embeddings=tie, bos_token_id=1, eos_token_id=2, pad_token_id=0)
    if rope:
        kw["rope_scaling"] = rope
    kw.update(extra)
    return cls(**kw)


def hf_model(seed: int = 0, **kw):
    """A random transformers model (fp32, eval) with sharp logits."""
    torch.manual_seed(seed)
    cfg = hf_config(**kw)
    model = AutoModelForCausalLM.from_config(cfg).eval()
    with torch.no_grad():  # larger norms make the logits sharper, so argmax ties cannot decide a test
        for name, p in model.named_parameters():
            if name.endswith("layernorm.weight") or name.endswith("norm.weight"):
                p.fill_(1.0)
    return model


def ours(hf, dtype=torch.float32) -> Transformer:
    """Our model with the weights of a transformers model."""
    return Transformer.from_state_dict(ModelConfig.from_hf(hf.config), hf.state_dict(), dtype=dtype)


def pair(seed: int = 0, vocab: int = 96, **kw):
    """(target, draft) of ours, sharing a vocabulary: a 3-layer target and a 1-layer draft."""
    target = ours(hf_model(seed, vocab=vocab, layers=3, **kw))
    draft = ours(hf_model(seed + 1000, vocab=vocab, layers=1, hidden=32, heads=2, kv_heads=1, **kw))
    return target, draft


def random_prompts(n: int, seed: int = 0, lo: int = 2, hi: int = 90) -> list[list[int]]:
    """``n`` prompts of ids 3..95 (the 96-token vocabulary's non-special ids), each of a length drawn from [lo, hi)."""
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 96, (int(torch.randint(lo, hi, (1,), generator=g)),), generator=g).tolist()
            for _ in range(n)]


def _char_level(chars: str, split: str, template: str):
    """A character-level fast tokenizer: ids 0-2 ``<unk>``, ``<s>``, ``</s>``, then one id per character of ``chars``
    in order; ``split`` is the pre-tokenizer's regex of one piece; ``template`` the chat template."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{c: 3 + i for i, c in enumerate(chars)}}
    tk = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tk.pre_tokenizer = pre_tokenizers.Split(Regex(split), behavior="isolated")
    tk.decoder = decoders.Fuse()
    tok = PreTrainedTokenizerFast(tokenizer_object=tk, unk_token="<unk>", bos_token="<s>", eos_token="</s>")
    tok.chat_template = template
    return tok


def char_tokenizer():
    """A 96-token character-level tokenizer (ids 0-2 special, then ASCII 32..124) with a chat template."""
    return _char_level("".join(map(chr, range(32, 125))), ".",
                       "{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}"
                       "{% if add_generation_prompt %}<assistant>{% endif %}")


#: a Hermes-style chat template with tools (as Qwen2.5's renders them, shortened): the tools' JSON in the system
#: turn, an assistant's calls as <tool_call> blocks, tool results as their own turns
HERMES_TEMPLATE = (
    "{% if tools %}<system>Tools:{% for t in tools %}\n{{ t | tojson }}{% endfor %}\n"
    "Reply with <tool_call>\n{\"name\": ..., \"arguments\": ...}\n</tool_call>{% endif %}"
    "{% for m in messages %}<{{ m.role }}>{% if m.content %}{{ m.content }}{% endif %}"
    "{% for c in m.tool_calls or [] %}<tool_call>\n"
    "{{ {'name': c.function.name, 'arguments': c.function.arguments} | tojson }}\n</tool_call>{% endfor %}"
    "{% endfor %}{% if add_generation_prompt %}<assistant>{% endif %}")


def tool_tokenizer():
    """A 99-token character-level tokenizer (ids 0-2 special, a newline, then ASCII 32..126, braces included) with
    :data:`HERMES_TEMPLATE`, for tool calls and JSON."""
    return _char_level("\n" + "".join(map(chr, range(32, 127))), "[\\s\\S]", HERMES_TEMPLATE)


def save_folder(path, seed: int = 0, **kw):
    """Save a tiny transformers model + the char tokenizer as a Hugging Face folder; returns the HF model."""
    model = hf_model(seed, vocab=96, **kw)
    model.save_pretrained(path)
    char_tokenizer().save_pretrained(path)
    return model
