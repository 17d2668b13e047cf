"""Text: tokenizers (bytes, tokenizer.json, the release tiktoken)."""
