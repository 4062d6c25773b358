"""Text in and out: prompts to token ids (documents, questions, chat templates), token ids back to text incrementally.
"""
