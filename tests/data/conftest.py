"""Hugging Face tokenizer directories (tests/hf_tokenizers.py), built once per session."""

import pytest


@pytest.fixture(scope="session")
def llama3_tokenizer(tmp_path_factory):
    pytest.importorskip("transformers")
    from tests.hf_tokenizers import llama3_like

    return llama3_like(tmp_path_factory.mktemp("llama3"))


@pytest.fixture(scope="session")
def qwen_tokenizer(tmp_path_factory):
    pytest.importorskip("transformers")
    from tests.hf_tokenizers import qwen_like

    return qwen_like(tmp_path_factory.mktemp("qwen"))


@pytest.fixture(scope="session")
def gemma_tokenizer(tmp_path_factory):
    pytest.importorskip("transformers")
    from tests.hf_tokenizers import gemma_like

    return gemma_like(tmp_path_factory.mktemp("gemma"))
