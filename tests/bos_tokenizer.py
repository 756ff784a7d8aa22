"""A tokenizer that adds a BOS as Llama 2/3, Mistral and Gemma's do, built here (nothing
downloaded): a byte-level BPE whose post-processor puts `<s>` before every text, saved as a
Hugging Face tokenizer directory (tokenizer.json included)."""

from __future__ import annotations

import os

WORDS = [f"what is {i} plus {j}? it is {i + j}. x = {i}; y = x + {j}" for i in range(10) for j in range(10)]


def bos_tokenizer(directory: str, bos: bool = True, template: str = "<s> $A") -> str:
    """Write the tokenizer to `directory` (with `bos=False`: the same without its post-processor;
    `template`: what its post-processor makes of a text, "$A </s>" for a T5-like one); returns the
    directory."""
    import transformers
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300,
        special_tokens=["<s>", "</s>", "<pad>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(WORDS, trainer)
    if bos:
        tok.post_processor = processors.TemplateProcessing(
            single=template,
            pair=f"{template} $B:1",
            special_tokens=[(t, tok.token_to_id(t)) for t in ("<s>", "</s>") if t in template],
        )
    fast = transformers.PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="<pad>"
    )
    os.makedirs(directory, exist_ok=True)
    fast.save_pretrained(directory)
    return directory
