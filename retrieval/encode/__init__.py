"""Text to vectors: the encoder protocol and specs, the transformers encoder, its attention kernel, and the numpy
BERT of a one-shot search's query."""
