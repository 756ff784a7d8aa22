"""How many of the embedded instruction records (finetune.dataset=stdlib_functions) get other ids
now that prompt and response are encoded together ([Note: prompt and reply are encoded together] in
framework/finetune/data.py) than when they were encoded apart, with the stdlib corpus's BPE
(data.vocab_size=2048, the main job's tokenizer).

    .venv/bin/python bench/sft_encoding.py      # writes bench/results/sft_encoding.txt

A prompt ends with a newline and a response starts with the body's indentation: the byte-level
pre-tokenizer keeps the newline with the indentation's spaces, so encoded together, one token spans
the boundary and is the response's first.
"""

from __future__ import annotations

import os
import sys
import tempfile

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)


def main() -> None:
    from framework.data.prepare import default_tokenizer_for
    from framework.data.stdlib import ensure_stdlib
    from framework.data.tokenizer import load_tokenizer
    from framework.finetune.data import encode_record
    from framework.finetune.stdlib_tasks import stdlib_function_records

    cache = os.environ.get("SFT_ENCODING_CACHE") or tempfile.mkdtemp()
    prefix = ensure_stdlib(cache, 2048, 1, is_main=True, barrier=lambda: None)
    tok = load_tokenizer(default_tokenizer_for(prefix))
    records = stdlib_function_records()
    changed = trained_before = trained_now = tokens_before = tokens_now = 0
    for record in records:
        doc = encode_record(record, tok)
        prompt, response = tok.encode(record["prompt"]), tok.encode(record["response"]) + [tok.eod]
        changed += doc.ids != prompt + response
        trained_before += len(response)
        trained_now += sum(doc.train)
        tokens_before += len(prompt) + len(response)
        tokens_now += len(doc.ids)
    lines = [
        f"records: {len(records)} (stdlib_functions, Python {sys.version_info[0]}.{sys.version_info[1]})",
        f"ids differ from prompt and response encoded apart: {changed} records ({changed / len(records):.1%})",
        f"trained tokens: {trained_now} now, {trained_before} apart ({trained_now / trained_before - 1:+.2%})",
        f"tokens: {tokens_now} now, {tokens_before} apart",
    ]
    text = "\n".join(lines) + "\n"
    print(text, end="")
    os.makedirs(os.path.join(REPO, "bench", "results"), exist_ok=True)
    with open(os.path.join(REPO, "bench", "results", "sft_encoding.txt"), "w") as f:
        f.write("$ .venv/bin/python bench/sft_encoding.py\n" + text)


if __name__ == "__main__":
    main()
