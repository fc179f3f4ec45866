"""Models: loading Hugging Face causal LMs (and the built-in tiny model and tokenizer), packed variable-length
attention for the training forward, sequence packing, and LoRA adapters."""
