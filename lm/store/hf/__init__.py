"""Hugging Face interop: config mapping, lazy sharded import, export, tokenizer export, one file per architecture."""
