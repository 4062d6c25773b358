"""Model files: one loader for every source (Hugging Face folder, GGUF file, hub id), GGUF's configs and block codes
as stored, and the embedded default model's download.
"""
