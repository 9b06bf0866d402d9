"""Running models: ORT sessions, comparing a rewritten model with its original."""
