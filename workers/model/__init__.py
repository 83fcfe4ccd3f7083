"""The model: Llama-family weights (GGUF or safetensors), its config, rotary embeddings, tokenizer."""
