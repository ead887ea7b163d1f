"""Write the tokenizer shipped in `trainer/assets/tokenizer/`.

A byte-level BPE with no merges: every UTF-8 byte is one token (ids 0-255), then Qwen3's
three chat specials. It encodes any text, its 259 ids fit inside any Qwen3 vocabulary
(151,936), and it keeps Qwen3's chat template, so a model built from a config with no
tokenizer at hand (`model.init=random`, the tiny quickstart) still has a real one.

    python scripts/make_tokenizer.py [OUT_DIR]
"""

import sys
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def build() -> PreTrainedTokenizerFast:
    alphabet = pre_tokenizers.ByteLevel.alphabet()  # the 256 printable stand-ins for bytes
    vocab = {ch: i for i, ch in enumerate(sorted(alphabet, key=lambda c: ord(c)))}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(SPECIALS)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        bos_token=None,
    )
    fast.chat_template = CHAT_TEMPLATE
    return fast


if __name__ == "__main__":
    out = Path(
        sys.argv[1] if len(sys.argv) > 1 else Path(__file__).parents[1] / "trainer/assets/tokenizer"
    )
    tok = build()
    tok.save_pretrained(out)
    print(f"wrote {len(tok)} tokens to {out}")
