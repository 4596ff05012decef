"""The policy model: its configuration, the Llama/Qwen2 network with its KV cache, and loading weights (HF
directories, GGUF, presets)."""
