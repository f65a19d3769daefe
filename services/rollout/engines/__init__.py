"""Generation engines behind one interface: hf (embedded transformers), vllm, sglang."""
