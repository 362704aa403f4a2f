"""tidegate workers: run admitted jobs against model backends."""
