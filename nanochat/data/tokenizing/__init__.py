"""
The tokenizer's files beside nanochat's API in tokenizer.py.
Their names and format, the checks of a tokenizer's tables, the safe reader of nanochat's
tokenizer.pkl, and the export for Hugging Face tools.

May import: nanochat.data.base.
"""
