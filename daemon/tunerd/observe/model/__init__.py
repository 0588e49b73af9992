"""The model directory, read as vLLM reads it: `directory` does the I/O (config.json, tokenizer
config, safetensors headers); `hf_config`, `info` and `weights` interpret what was read (pure)."""
