"""Model files: the GGUF reader, artifacts and their fingerprints, the catalogue of known
models, random-weight models, chat templates."""
