"""Text in and out of the generation loop: the checkpoint's tokenizer and chat rendering (`tokenizer`: tokenizer.json or
Kimi's tiktoken vocabulary, `tiktoken_vocab`; DeepSeek-V4's built-in chat encoding, `chat_dsv4`), token bounds of a
rendered prompt (`token_bound`), and incremental detokenization with stop strings (`detokenize`)."""
