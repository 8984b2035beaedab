"""Self-contained Hugging Face model code (``trust_remote_code``) shipped inside exports that no stock
``transformers`` architecture represents exactly (see ``megatron_cai.interop.hf``)."""
