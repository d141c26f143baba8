"""Reading weights from disk: safetensors (single or sharded, memory-mapped) and GGUF import."""
