"""Run in a process of its own by registry/chat_template.py: load a model directory's tokenizer (local
files only, no remote code) and render its chat template over the probe conversations given as JSON on
stdin; print each rendering's length as JSON on stdout. Apart, so that a template that never ends can be
killed, and so that registry's own modules need no transformers."""

from __future__ import annotations

import json
import sys

from transformers import AutoTokenizer


def main() -> None:
    model_dir, conversations = sys.argv[1], json.load(sys.stdin)
    tokenizer = AutoTokenizer.from_pretrained(model_dir, local_files_only=True, trust_remote_code=False)
    lengths = [
        len(tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False))
        for messages in conversations
    ]
    json.dump({"lengths": lengths}, sys.stdout)


if __name__ == "__main__":
    main()
