"""Models: which GGUF file a model means, and the catalog of models an operator keeps."""
