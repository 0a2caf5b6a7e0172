"""tuneproof: evidence-gated fine-tuning of Qwen models on Ray clusters."""
